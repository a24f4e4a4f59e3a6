"""torchtune's recipe configs (``tune run lora_finetune_single_device --config their.yaml``; its documented config
layout: ``model._component_`` a model builder such as ``torchtune.models.llama3_2.lora_llama3_2_1b`` with
``lora_attn_modules``, ``apply_lora_to_mlp``, ``apply_lora_to_output``, ``lora_rank``, ``lora_alpha``,
``lora_dropout``, ``use_dora``; ``checkpointer.checkpoint_dir`` the Hugging Face checkpoint; ``tokenizer.max_seq_len``;
``batch_size``; ``dataset.packed``; ``dtype``; ``enable_activation_checkpointing``; ``optimizer._component_``).

torchtune trains the model in ``dtype`` (precision pure). Its modules are its own, not transformers': the plan is made
for the checkpoint's transformers model with the same shapes, and says so (an estimate of torchtune's activations).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core.importers.base import Format, Imported, Reader, optimizer

SCHEDULERS = {"torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup": "cosine",
              "torchtune.modules.get_cosine_schedule_with_warmup": "cosine"}
DTYPES = {"bf16": "bf16", "fp32": "fp32", "fp16": "fp16"}
#: torchtune's model builders (``torchtune.models.<family>.<builder>``, LoRA and QLoRA ones by the same name) -> the
#: Hub model they are made for, as its configs download it (``tune download <id>``): the shapes the plan reads when
#: the config's checkpoint folder is not here (pytorch/torchtune recipes/configs/*, their header comments)
BUILDERS = {"llama2_7b": "meta-llama/Llama-2-7b-hf", "llama2_13b": "meta-llama/Llama-2-13b-hf",
            "llama2_70b": "meta-llama/Llama-2-70b-hf", "llama3_8b": "meta-llama/Meta-Llama-3-8B-Instruct",
            "llama3_70b": "meta-llama/Meta-Llama-3-70B-Instruct",
            "llama3_1_8b": "meta-llama/Meta-Llama-3.1-8B-Instruct",
            "llama3_1_70b": "meta-llama/Meta-Llama-3.1-70B-Instruct",
            "llama3_1_405b": "meta-llama/Meta-Llama-3.1-405B-Instruct",
            "llama3_2_1b": "meta-llama/Llama-3.2-1B-Instruct", "llama3_2_3b": "meta-llama/Llama-3.2-3B-Instruct",
            "llama3_3_70b": "meta-llama/Llama-3.3-70B-Instruct"}
MLP = ("gate_proj", "up_proj", "down_proj")
#: torchtune's attention module names -> transformers' (Llama)
ATTENTION_MODULES = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}
NO_MEMORY = frozenset({"output_dir", "metric_logger", "log_every_n_steps", "log_peak_memory_stats", "profiler",
                       "resume_from_checkpoint", "save_adapter_weights_only", "shuffle", "epochs", "device",
                       "loss", "clip_grad_norm", "tokenizer", "checkpointer", "dataset", "seed", "compile",
                       "log_level", "optimizer_in_bwd"})


def detect(data: dict[str, Any]) -> bool:
    model = data.get("model")
    return isinstance(model, dict) and str(model.get("_component_", "")).startswith("torchtune.")


def read(data: dict[str, Any], path: Path, overrides: Mapping[str, Any]) -> Imported:
    r = Reader("torchtune", _interpolated(data), path, NO_MEMORY, overrides)
    component = str(r.value("model._component_"))
    _model(r, component)
    r.take("batch_size", "batch_size", int)
    r.take("gradient_accumulation_steps", "grad_accum", int)
    if r.has("tokenizer.max_seq_len"):
        r.set("tokenizer.max_seq_len", "seq_len", r.number("tokenizer.max_seq_len"))
    else:
        r.need("tokenizer.max_seq_len", "seq_len", "is null (or absent): torchtune then truncates nothing and each "
                                                    "batch is as long as its longest sample, which the plan cannot "
                                                    "know; the plan needs the longest sequence")
    r.set("dataset.packed", "padding", "packed" if r.value("dataset.packed", False) else "padded")
    dtype = str(r.value("dtype", "bf16"))
    if dtype not in DTYPES:
        raise r.refuse("dtype", f"{dtype!r}: give bf16, fp16 or fp32")
    if r.has("dtype"):
        r.set("dtype", "dtype", DTYPES[dtype])
    else:
        r.default("dtype", DTYPES[dtype], "the recipes' dtype: bf16")
    if dtype != "fp32":
        r.settings["precision"] = "pure"
    r.set("enable_activation_checkpointing", "gradient_checkpointing",
          bool(r.value("enable_activation_checkpointing", False)))
    if r.value("enable_activation_offloading", False):
        raise r.refuse("enable_activation_offloading", "activations offloaded to the CPU: the planner plans device "
                                                       "memory without offload; turn it off to plan")
    fused = bool(r.value("optimizer.fused", False))
    optimizer(r, "optimizer._component_", "torchtune", "fused" if fused else "default")
    if r.has("optimizer.fused"):
        r.used["optimizer.fused"] = f"{fused}: torch's {'fused' if fused else 'default'} implementation"
    r.take("optimizer.lr", "learning_rate", float)
    r.run_length("max_steps_per_epoch", "lr_scheduler.num_warmup_steps")
    name = str(r.value("lr_scheduler._component_", ""))
    if name:
        if name in SCHEDULERS:
            r.set("lr_scheduler._component_", "lr_scheduler", SCHEDULERS[name])
        else:
            r.ignore("lr_scheduler._component_", f"the schedule {name} moves no memory; the run uses linear")
    _adapters(r, component)
    return r.done()


def _interpolated(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with OmegaConf's ``${key}`` references in string values replaced by the top-level values they name
    (torchtune reads its configs with OmegaConf: ``checkpoint_dir: ${checkpoint_dir}``, ``log_dir: ${output_dir}/logs``);
    a reference to a key the file does not hold stays as it is (torchtune takes it from the command line)."""
    def resolve(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: resolve(v) for k, v in value.items()}
        if isinstance(value, str):
            return re.sub(r"\$\{([A-Za-z_][\w.]*)\}", lambda m: _lookup(data, m.group(1), m.group(0)), value)
        return value
    return {k: resolve(v) for k, v in data.items()}


def _lookup(data: dict[str, Any], dotted: str, unresolved: str) -> str:
    value: Any = data
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return unresolved
        value = value[part]
    return unresolved if isinstance(value, (dict, list)) or value is None or "${" in str(value) else str(value)


def _model(r: Reader, component: str) -> None:
    """The model torchtune builds: ``model._component_`` (its builder) defines the shapes; its weights are
    ``checkpointer.checkpoint_dir``. A checkpoint folder here (with its config.json) is planned from; otherwise the
    Hub model the builder is made for (the id of its configs' ``tune download`` line), from the local Hub cache."""
    builder = component.rsplit(".", 1)[-1].removeprefix("lora_").removeprefix("qlora_")
    folder = str(r.value("checkpointer.checkpoint_dir", "")).rstrip("/").removesuffix("/original")
    if folder and "${" not in folder and (Path(folder) / "config.json").is_file():
        r.set("checkpointer.checkpoint_dir", "model", folder,
              f"the checkpoint's transformers model stands for {builder} (an estimate of torchtune's own modules)")
        return
    hub = BUILDERS.get(builder)
    if hub is None:
        r.need("checkpointer.checkpoint_dir", "model",
               f"names {folder or 'no folder'} (not here), and the builder {component} is not one whose Hub model "
               "gpuaccept knows: give the model's folder or config.json")
        return
    r.set("model._component_", "model", hub,
          f"the builder {builder} is made for {hub} (torchtune's `tune download` of it); checkpoint_dir "
          f"{folder or '(unset)'} is not here, so its config is read from the Hub cache; the transformers model "
          "stands for torchtune's own modules (an estimate)")
    r.value("checkpointer.checkpoint_dir")


def _adapters(r: Reader, component: str) -> None:
    lora = "lora_" in component.rsplit(".", 1)[-1] or r.has("model.lora_rank")
    if r.value("model.quantize_base", False):
        raise r.refuse("model.quantize_base", "torchtune's own NF4 base (torchao): the planner models bitsandbytes' "
                                              "4-bit base; plan it as lora, or with a bitsandbytes recipe")
    if not lora:
        r.set("model._component_", "mode", "full")
        return
    dora = bool(r.value("model.use_dora", False))
    r.set("model._component_", "mode", "dora" if dora else "lora")
    r.take("model.lora_rank", "lora_r", int)
    r.take("model.lora_alpha", "lora_alpha", lambda v: int(float(v)))
    r.take("model.lora_dropout", "lora_dropout", float)
    modules = [ATTENTION_MODULES.get(str(m), str(m)) for m in r.value("model.lora_attn_modules", [])]
    if r.value("model.apply_lora_to_mlp", False):
        modules += MLP
    if r.value("model.apply_lora_to_output", False):
        modules.append("lm_head")
    if modules:
        r.set("model.lora_attn_modules", "lora_targets", ",".join(modules), "torchtune's names as transformers'")


FORMAT = Format("torchtune", detect, read,
                out_keys=("output_dir", "checkpointer.output_dir", "metric_logger.log_dir"))
