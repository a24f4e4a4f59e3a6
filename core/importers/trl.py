"""TRL's ``trl sft --config their.yml``: one YAML file of ``ScriptArguments``, ``SFTConfig`` (transformers'
``TrainingArguments`` with TRL's defaults) and ``ModelConfig`` keys.

Read in TRL at commit f2cd577 (``trl/trainer/sft_config.py``, ``trl/trainer/model_config.py``, ``trl/scripts/sft.py``):
the model is loaded in ``dtype`` (default ``float32``); ``SFTConfig`` defaults ``bf16`` to true when ``fp16`` is not
set, ``gradient_checkpointing`` to true and ``max_length`` to 1,024; ``packing`` defaults to false; LoRA (``use_peft``)
defaults to r 16, alpha 32, dropout 0.05; ``load_in_4bit`` with ``bnb_4bit_quant_type`` and ``use_bnb_nested_quant``
is QLoRA, ``use_dora`` DoRA. A default the config leaves out is used as TRL's and said so.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core.importers.base import Format, Imported, Reader, deepspeed_strategy, precision, targets, training_keys

DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}
NO_MEMORY = frozenset({"output_dir", "logging_steps", "save_steps", "save_strategy", "eval_strategy", "eval_steps",
                       "report_to", "run_name", "dataset_name", "dataset_config", "dataset_train_split",
                       "dataset_test_split", "dataset_text_field", "num_train_epochs", "push_to_hub", "hub_model_id",
                       "logging_dir", "save_total_limit", "model_revision", "trust_remote_code", "dataloader_num_workers",
                       "completion_only_loss", "assistant_only_loss", "eos_token", "chat_template_path", "weight_decay",
                       "max_grad_norm", "adam_beta1", "adam_beta2", "adam_epsilon", "dataset_num_proc"})


def detect(data: dict[str, Any]) -> bool:
    return "model_name_or_path" in data and not {"stage", "finetuning_type", "cutoff_len"} & set(data)


def read(data: dict[str, Any], path: Path, overrides: Mapping[str, Any]) -> Imported:
    r = Reader("trl", data, path, NO_MEMORY, overrides)
    r.take("model_name_or_path", "model", str)
    training_keys(r, batch="per_device_train_batch_size", packing="packing", schedule="lr_scheduler_type", optim="optim")
    length_key = "max_length" if "max_length" in data else "max_seq_length"  # the older name
    if r.has(length_key):
        r.set(length_key, "seq_len", r.number(length_key))
    elif length_key in data:
        raise r.refuse(length_key, "no length (None): the planner needs the longest sequence; give max_length")
    else:
        r.settings["seq_len"] = 1024
        r.used["max_length"] = "seq_len = 1024 (TRL's default; not in the config)"
    _dtype(r, data)
    r.set("gradient_checkpointing", "gradient_checkpointing", bool(r.value("gradient_checkpointing", True)),
          "" if "gradient_checkpointing" in data else "TRL's default")
    if r.has("attn_implementation"):
        r.set("attn_implementation", "attn_implementation", str(r.value("attn_implementation")))
    _adapters(r)
    if r.has("deepspeed"):
        deepspeed_strategy(r, "deepspeed")
    if r.value("fsdp"):
        r.set("fsdp", "strategy", "zero3", "FSDP full shard")
    if r.value("load_in_8bit", False):
        raise r.refuse("load_in_8bit", "an 8-bit base: the planner models 4-bit bases (QLoRA) only")
    return r.done()


def _dtype(r: Reader, data: dict[str, Any]) -> None:
    fp16 = bool(r.value("fp16", False))
    bf16 = bool(r.value("bf16", not fp16))  # SFTConfig: bf16 defaults to true when fp16 is not set
    compute = "fp16" if fp16 else "bf16" if bf16 else "fp32"
    key = "fp16" if fp16 else "bf16"
    name = str(r.value("dtype", r.value("torch_dtype", "float32")))
    if name == "auto":
        raise r.refuse("dtype", "dtype auto: the checkpoint's dtype decides; give bfloat16, float16 or float32")
    if name not in DTYPES:
        raise r.refuse("dtype", f"{name!r}: give bfloat16, float16 or float32")
    loaded = DTYPES[name]
    if compute == "fp32":
        r.set(key, "dtype", loaded, "no bf16/fp16: the model's dtype")
        return
    precision(r, compute, loaded if loaded != compute else None, key)
    if key not in data:
        r.used[key] += "; bf16 is SFTConfig's default"


def _adapters(r: Reader) -> None:
    if not r.value("use_peft", False):
        for key in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "use_dora", "load_in_4bit"):
            r.ignore(key, "use_peft is off: no adapters")
        r.set("use_peft", "mode", "full", "use_peft off: every parameter trained")
        return
    four_bit = bool(r.value("load_in_4bit", False))
    dora = bool(r.value("use_dora", False))
    if four_bit and dora:
        raise r.refuse("use_dora", "DoRA over a 4-bit base: the planner models one LoRA variant at a time")
    r.set("use_peft", "mode", "qlora" if four_bit else "dora" if dora else "lora")
    r.set("lora_r", "lora_r", int(r.value("lora_r", 16)), "" if r.has("lora_r") else "TRL's default")
    r.set("lora_alpha", "lora_alpha", int(r.value("lora_alpha", 32)), "" if r.has("lora_alpha") else "TRL's default")
    r.set("lora_dropout", "lora_dropout", float(r.value("lora_dropout", 0.05)),
          "" if r.has("lora_dropout") else "TRL's default")
    if r.has("lora_target_modules"):
        r.set("lora_target_modules", "lora_targets", targets(r.value("lora_target_modules")))
    if four_bit:  # a 4-bit base has no fp32 master copy: the spec's dtype is its compute dtype, precision pure
        r.settings["precision"] = "pure"
        r.set("load_in_4bit", "qlora_quant_type", str(r.value("bnb_4bit_quant_type", "nf4")))
        r.set("use_bnb_nested_quant", "qlora_double_quant", bool(r.value("use_bnb_nested_quant", False)))


FORMAT = Format("trl", detect, read, out_keys=("output_dir",))
