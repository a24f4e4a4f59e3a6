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

from core.importers.base import Format, Imported, Reader, optimizer, sharded
from core.objectives import named as objective_named

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
                       "clip_grad_norm", "tokenizer", "checkpointer", "dataset", "seed", "log_level",
                       "loss.label_smoothing", "loss.gamma", "ref_checkpointer"})
#: torchtune's loss classes that make SFT's cross-entropy -> the spec's loss (core/losses.py)
LOSSES = {"torch.nn.CrossEntropyLoss": "standard", "torchtune.modules.loss.CEWithChunkedOutputLoss": "chunked",
          "torchtune.modules.loss.LinearCrossEntropyLoss": "linear_chunked"}


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
    if r.has("dataset.packed"):
        r.set("dataset.packed", "padding", "packed" if r.value("dataset.packed") else "padded")
    else:
        r.default("padding", "padded", "dataset.packed off")
    dtype = str(r.value("dtype", "fp32"))
    if dtype not in DTYPES:
        raise r.refuse("dtype", f"{dtype!r}: give bf16, fp16 or fp32")
    if r.has("dtype"):
        r.set("dtype", "dtype", DTYPES[dtype], "the whole model in it, no autocast")
    else:
        r.default("dtype", DTYPES[dtype], "training.get_dtype(None) is float32 (training/precision.py:102)")
    if dtype != "fp32":
        r.settings["precision"] = "pure"
    if r.has("enable_activation_checkpointing"):
        r.set("enable_activation_checkpointing", "gradient_checkpointing",
              bool(r.value("enable_activation_checkpointing")))
    else:
        r.default("gradient_checkpointing", False, "enable_activation_checkpointing")
    if r.value("enable_activation_offloading", False):
        r.set("enable_activation_offloading", "activation_offloading", True,
              "OffloadActivations: each checkpointed layer's input to pinned host memory")
    elif r.has("enable_activation_offloading"):
        r.used["enable_activation_offloading"] = "off"
    if r.has("compile"):
        r.set("compile", "compile", bool(r.value("compile")), "each decoder layer and the loss compiled")
    if r.has("optimizer_in_bwd"):
        r.set("optimizer_in_bwd", "optimizer_in_backward", bool(r.value("optimizer_in_bwd")))
    fused = bool(r.value("optimizer.fused", False))
    optimizer(r, "optimizer._component_", "torchtune", "fused" if fused else "default")
    if r.has("optimizer.fused"):
        r.used["optimizer.fused"] = f"{fused}: torch's {'fused' if fused else 'default'} implementation"
    r.take("optimizer.lr", "learning_rate", float)
    r.ignore("optimizer.weight_decay", "a hyper-parameter: moves no memory")
    r.settings["embedding_fp32_states"] = False  # only transformers' Trainer registers embeddings for 32-bit states
    r.run_length("max_steps_per_epoch", "lr_scheduler.num_warmup_steps")
    name = str(r.value("lr_scheduler._component_", ""))
    if name:
        if name in SCHEDULERS:
            r.set("lr_scheduler._component_", "lr_scheduler", SCHEDULERS[name])
        else:
            r.ignore("lr_scheduler._component_", f"the schedule {name} moves no memory; the run uses linear")
    _loss(r)
    _adapters(r, component)
    _distributed(r)
    r.ignore("low_cpu_ram", "host memory while loading: not the device's")
    r.ignore("loss.beta", "a loss hyper-parameter: moves no memory")
    if r.has("custom_sharded_layers"):
        r.not_modelled("custom_sharded_layers", "the embedding and the output sharded as units of their own: the root "
                                                "unit the plan gathers is smaller (an upper bound)")
    return r.done()


def _loss(r: Reader) -> None:
    """``loss._component_``: SFT's cross-entropy in one of its forms, or DPO's loss (the recipe is a DPO recipe)."""
    name = str(r.value("loss._component_", ""))
    if not name:
        return
    if name in LOSSES:
        r.set("loss._component_", "loss", LOSSES[name])
        r.take("loss.num_output_chunks", "loss_chunks", int)
        return
    found = objective_named("torchtune", name)
    if found is None:
        r.refuse_unless_given("loss._component_", f"{name}: not a loss the planner models", "loss")
        return
    r.set("loss._component_", "objective", found.name, f"{name}: the recipe is a {found.label} one")
    if r.has("ref_checkpointer.checkpoint_dir"):
        r.set("ref_checkpointer.checkpoint_dir", "reference", "copy", "full_dpo_distributed: a reference model of its "
                                                                      "own, in the recipe's dtype")
        r.ignore("ref_checkpointer._component_", "which class loads the reference: its weights are planned as the "
                                                 "reference copy (ref_checkpointer.checkpoint_dir)")


def _distributed(r: Reader) -> None:
    """A distributed recipe shards the model with FSDP2 (``fully_shard``) over the ranks ``tune run
    --nproc_per_node`` starts, which the file does not say; ``fsdp_cpu_offload`` offloads the parameters, gradients and
    optimizer states (and the step) to the CPU."""
    offload = bool(r.value("fsdp_cpu_offload", False))
    if r.has("fsdp.cpu_offload"):
        r.ignore("fsdp.cpu_offload", "not read by the recipes (they read fsdp_cpu_offload)")
    if r.has("fsdp_cpu_offload") or offload:
        sharded(r, "fsdp_cpu_offload", "zero3", "FSDP2 full shard" + (" with the parameters, gradients and optimizer "
                                                                      "states offloaded to the CPU" if offload else ""),
                "all" if offload else "none")


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
    builder = component.rsplit(".", 1)[-1]
    lora = builder.startswith(("lora_", "qlora_")) or r.has("model.lora_rank")
    quantised = builder.startswith("qlora_") or bool(r.value("model.quantize_base", False))
    if not lora:
        r.set("model._component_", "mode", "full")
        return
    dora = bool(r.value("model.use_dora", False))
    if quantised and dora:
        raise r.refuse("model.use_dora", "DoRA over a 4-bit base: the planner models one LoRA variant at a time")
    mode = "qlora" if quantised else "dora" if dora else "lora"
    r.set("model._component_", "mode", mode, "torchao's NF4 base (QLoRA), planned with bitsandbytes' NF4 layout with "
                                             "double quantisation (the same 0.5 B a parameter and a byte a block of "
                                             "64)" if quantised else "")
    if quantised:
        r.settings.update(qlora_quant_type="nf4", qlora_double_quant=True)
        r.not_modelled("model._component_", "torchtune keeps the frozen base's unquantised parameters and the "
                                            "adapters in the model's dtype (bf16); the plan keeps them fp32, as "
                                            "peft's prepare_model_for_kbit_training does (an upper bound)")
    r.settings["lora_dtype"] = "model"
    r.defaults["lora_dtype"] = "'model' (torchtune's LoRA parameters are built in the model's dtype)"
    r.take("model.lora_rank", "lora_r", int)
    if r.has("model.lora_alpha"):  # a float in torchtune's builders; the spec's alpha is an integer
        alpha = r.number("model.lora_alpha", float)
        if alpha != int(alpha):
            raise r.refuse("model.lora_alpha", f"{alpha!r}: the plan takes an integer alpha (it moves no memory: give "
                                               f"{round(alpha)})")
        r.set("model.lora_alpha", "lora_alpha", int(alpha))
    r.take("model.lora_dropout", "lora_dropout", float)
    modules = [ATTENTION_MODULES.get(str(m), str(m)) for m in r.value("model.lora_attn_modules", [])]
    if r.value("model.apply_lora_to_mlp", False):
        modules += MLP
    if r.value("model.apply_lora_to_output", False):
        modules.append("lm_head")
    for key in ("model.apply_lora_to_mlp", "model.apply_lora_to_output"):
        if r.has(key):
            r.used[key] = f"{r.value(key)}: in lora_targets"
    if modules:
        r.set("model.lora_attn_modules", "lora_targets", ",".join(modules), "torchtune's names as transformers'")


FORMAT = Format("torchtune", detect, read,
                out_keys=("output_dir", "checkpointer.output_dir", "metric_logger.log_dir"))
