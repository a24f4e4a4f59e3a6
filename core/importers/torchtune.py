"""torchtune's recipe configs (``tune run lora_finetune_single_device --config their.yaml``; its documented config
layout: ``model._component_`` a model builder such as ``torchtune.models.llama3_2.lora_llama3_2_1b`` with
``lora_attn_modules``, ``apply_lora_to_mlp``, ``apply_lora_to_output``, ``lora_rank``, ``lora_alpha``,
``lora_dropout``, ``use_dora``; ``checkpointer.checkpoint_dir`` the Hugging Face checkpoint; ``tokenizer.max_seq_len``;
``batch_size``; ``dataset.packed``; ``dtype``; ``enable_activation_checkpointing``; ``optimizer._component_``).

torchtune trains the model in ``dtype`` (precision pure). Its modules are its own, not transformers': the plan is made
for the checkpoint's transformers model with the same shapes, and says so (an estimate of torchtune's activations).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.importers.base import Format, Imported, Reader, optimizer

SCHEDULERS = {"torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup": "cosine",
              "torchtune.modules.get_cosine_schedule_with_warmup": "cosine"}
DTYPES = {"bf16": "bf16", "fp32": "fp32", "fp16": "fp16"}
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


def read(data: dict[str, Any], path: Path) -> Imported:
    r = Reader("torchtune", data, path, NO_MEMORY)
    component = str(r.value("model._component_"))
    if r.has("checkpointer.checkpoint_dir"):
        r.set("checkpointer.checkpoint_dir", "model", str(r.value("checkpointer.checkpoint_dir")),
              f"the checkpoint's transformers model stands for {component.rsplit('.', 1)[-1]} (an estimate of "
              "torchtune's own modules)")
    else:
        raise r.refuse("checkpointer.checkpoint_dir", "no checkpoint folder: the planner reads the model's shapes "
                                                      "from its Hugging Face checkpoint; give checkpoint_dir")
    r.take("batch_size", "batch_size", int)
    r.take("gradient_accumulation_steps", "grad_accum", int)
    if not r.has("tokenizer.max_seq_len"):
        raise r.refuse("tokenizer.max_seq_len", "not given: the planner needs the sequence length; set it")
    r.set("tokenizer.max_seq_len", "seq_len", r.number("tokenizer.max_seq_len"))
    r.set("dataset.packed", "padding", "packed" if r.value("dataset.packed", False) else "padded")
    dtype = str(r.value("dtype", "bf16"))
    if dtype not in DTYPES:
        raise r.refuse("dtype", f"{dtype!r}: give bf16, fp16 or fp32")
    r.set("dtype", "dtype", DTYPES[dtype], "" if r.has("dtype") else "torchtune's default")
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
