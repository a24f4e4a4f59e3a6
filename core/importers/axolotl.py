"""axolotl's YAML config (its documented config reference: ``base_model``, ``micro_batch_size``, ``sequence_len``,
``adapter: lora | qlora``, ``lora_*``, ``peft_use_dora``, ``bf16``, ``sample_packing``, ``flash_attention``,
``deepspeed``, ``fsdp``...). axolotl loads the model in the 16-bit dtype it trains in when ``bf16`` or ``fp16`` is
set: precision pure. ``sequence_len`` has to be given (the plan does not guess a length)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core.importers.base import Format, Imported, Reader, deepspeed_strategy, precision, targets, training_keys

NO_MEMORY = frozenset({"output_dir", "datasets", "dataset_prepared_path", "val_set_size", "num_epochs",
                       "logging_steps", "saves_per_epoch", "evals_per_epoch", "save_steps", "eval_steps", "wandb_project",
                       "wandb_entity", "wandb_name", "wandb_log_model", "wandb_watch", "hub_model_id", "strict",
                       "special_tokens", "tokenizer_type", "model_type", "chat_template", "train_on_inputs",
                       "group_by_length", "weight_decay", "max_grad_norm", "early_stopping_patience", "resume_from_checkpoint",
                       "local_rank", "logging_dir", "debug", "trust_remote_code", "pad_to_sequence_len", "tf32"})

#: axolotl's ``adapter`` values the planner models, each with whether its base is stored in 4 bits
ADAPTERS = {"lora": False, "qlora": True}


def detect(data: dict[str, Any]) -> bool:
    return "base_model" in data


def read(data: dict[str, Any], path: Path, overrides: Mapping[str, Any]) -> Imported:
    r = Reader("axolotl", data, path, NO_MEMORY, overrides)
    r.take("base_model", "model", str)
    training_keys(r, batch="micro_batch_size", packing="sample_packing", schedule="lr_scheduler", optim="optimizer")
    if not r.has("sequence_len"):
        raise r.refuse("sequence_len", "not given: the planner needs the sequence length; add sequence_len")
    r.set("sequence_len", "seq_len", r.number("sequence_len"))
    bf16, fp16 = r.value("bf16", False), bool(r.value("fp16", False))
    if bf16 or fp16:
        precision(r, "bf16" if bf16 else "fp16", None, "bf16" if bf16 else "fp16")
        if bf16 == "auto":
            r.used["bf16"] += "; auto: bf16 where the GPU has it"
    else:
        r.set("bf16", "dtype", "fp32", "neither bf16 nor fp16")
    r.take("gradient_checkpointing", "gradient_checkpointing", bool)
    if r.value("flash_attention", False):
        r.set("flash_attention", "attn_implementation", "flash_attention_2")
    elif r.value("sdp_attention", False):
        r.set("sdp_attention", "attn_implementation", "sdpa")
    if r.value("xformers_attention", False):
        raise r.refuse("xformers_attention", "xformers attention is not one the planner models; use flash_attention "
                                             "or sdp_attention")
    _adapter(r)
    if r.has("deepspeed"):
        deepspeed_strategy(r, "deepspeed")
    if r.value("fsdp") or r.has("fsdp_config"):
        r.value("fsdp_config")
        r.set("fsdp" if r.has("fsdp") else "fsdp_config", "strategy", "zero3", "FSDP full shard")
    return r.done()


def _adapter(r: Reader) -> None:
    adapter = r.value("adapter")
    if r.value("load_in_8bit", False):
        raise r.refuse("load_in_8bit", "an 8-bit base: the planner models 4-bit bases (QLoRA) only")
    if adapter in (None, ""):
        r.set("adapter", "mode", "full", "no adapter: every parameter trained")
        return
    if adapter not in ADAPTERS:
        raise r.refuse("adapter", f"adapter {adapter!r}: the planner models {' and '.join(ADAPTERS)}")
    four_bit = ADAPTERS[adapter] or bool(r.value("load_in_4bit", False))
    dora = bool(r.value("peft_use_dora", False))
    if four_bit and dora:
        raise r.refuse("peft_use_dora", "DoRA over a 4-bit base: the planner models one LoRA variant at a time")
    r.set("adapter", "mode", "qlora" if four_bit else "dora" if dora else "lora")
    if four_bit:
        r.value("load_in_4bit")
        r.settings["precision"] = "pure"  # a 4-bit base keeps no fp32 master copy
    r.take("lora_r", "lora_r", int)
    r.take("lora_alpha", "lora_alpha", int)
    r.take("lora_dropout", "lora_dropout", float)
    if r.value("lora_target_linear", False):
        r.set("lora_target_linear", "lora_targets", "all-linear")
        r.ignore("lora_target_modules", "lora_target_linear names every linear layer")
    else:
        r.take("lora_target_modules", "lora_targets", targets)


FORMAT = Format("axolotl", detect, read, out_keys=("output_dir",))
