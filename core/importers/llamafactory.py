"""LLaMA-Factory's YAML config (``llamafactory-cli train their.yaml``; its documented arguments: ``model_name_or_path``,
``stage``, ``finetuning_type``, ``lora_rank``, ``lora_alpha``, ``lora_target``, ``use_dora``, ``quantization_bit``,
``cutoff_len``, ``packing``, ``flash_attn``, ``disable_gradient_checkpointing``, transformers' training arguments).
LLaMA-Factory loads the model in the compute dtype (precision pure) and turns gradient checkpointing on unless
``disable_gradient_checkpointing`` is set; ``lora_alpha`` defaults to twice ``lora_rank``, ``lora_rank`` to 8,
``lora_target`` to ``all``, ``cutoff_len`` to 2,048, ``finetuning_type`` to ``lora``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core.importers.base import Format, Imported, Reader, deepspeed_strategy, precision, targets, training_keys

NO_MEMORY = frozenset({"output_dir", "dataset", "dataset_dir", "template", "overwrite_cache", "overwrite_output_dir",
                       "preprocessing_num_workers", "logging_steps", "save_steps", "plot_loss", "num_train_epochs",
                       "report_to", "val_size", "eval_strategy", "eval_steps", "per_device_eval_batch_size",
                       "do_train", "trust_remote_code", "max_samples", "dataloader_num_workers", "save_only_model",
                       "ddp_timeout", "resume_from_checkpoint", "weight_decay", "max_grad_norm", "run_name"})
#: LLaMA-Factory's ``finetuning_type`` values the planner models, each with whether every parameter is trained
FINETUNING = {"full": True, "lora": False}
ATTENTION = {"fa2": "flash_attention_2", "sdpa": "sdpa", "disabled": "eager", "auto": "sdpa"}


def detect(data: dict[str, Any]) -> bool:
    return "model_name_or_path" in data and bool({"stage", "finetuning_type", "cutoff_len"} & set(data))


def read(data: dict[str, Any], path: Path, overrides: Mapping[str, Any]) -> Imported:
    r = Reader("llamafactory", data, path, NO_MEMORY, overrides)
    r.take("model_name_or_path", "model", str)
    stage = r.value("stage", "sft")
    if stage not in ("sft", "pt"):
        raise r.refuse("stage", f"stage {stage}: the planner models one trained model (sft, pt); {stage} holds a "
                                "reference or reward model too")
    training_keys(r, batch="per_device_train_batch_size", packing="packing", schedule="lr_scheduler_type", optim="optim")
    r.set("cutoff_len", "seq_len", r.number("cutoff_len") if r.has("cutoff_len") else 2048,
          "" if r.has("cutoff_len") else "LLaMA-Factory's default")
    if r.value("pure_bf16", False) or r.value("bf16", False):
        precision(r, "bf16", None, "pure_bf16" if r.has("pure_bf16") else "bf16")
    elif r.value("fp16", False):
        precision(r, "fp16", None, "fp16")
    else:
        r.set("bf16", "dtype", "fp32", "neither bf16 nor fp16")
    off = bool(r.value("disable_gradient_checkpointing", False))
    r.set("disable_gradient_checkpointing", "gradient_checkpointing", not off,
          "" if r.has("disable_gradient_checkpointing") else "LLaMA-Factory's default: on")
    attention = str(r.value("flash_attn", "auto"))
    if attention not in ATTENTION:
        raise r.refuse("flash_attn", f"{attention!r}: give auto, sdpa, fa2 or disabled")
    r.set("flash_attn", "attn_implementation", ATTENTION[attention])
    _finetuning(r)
    if r.has("deepspeed"):
        deepspeed_strategy(r, "deepspeed")
    return r.done()


def _finetuning(r: Reader) -> None:
    kind = r.value("finetuning_type", "lora")
    if kind not in FINETUNING:
        raise r.refuse("finetuning_type", f"{kind}: the planner models {' and '.join(FINETUNING)} (freeze trains "
                                          "some layers)")
    if FINETUNING[kind]:
        r.set("finetuning_type", "mode", "full")
        return
    bits = r.value("quantization_bit")
    if bits not in (None, 4):
        raise r.refuse("quantization_bit", f"{bits}-bit base: the planner models 4-bit bases (QLoRA) only")
    method = str(r.value("quantization_method", "bnb"))
    if bits == 4 and method not in ("bnb", "bitsandbytes"):
        raise r.refuse("quantization_method", f"{method}: the planner models bitsandbytes' 4-bit base")
    dora = bool(r.value("use_dora", False))
    if bits == 4 and dora:
        raise r.refuse("use_dora", "DoRA over a 4-bit base: the planner models one LoRA variant at a time")
    r.set("finetuning_type", "mode", "qlora" if bits == 4 else "dora" if dora else "lora")
    if bits == 4:
        r.settings["precision"] = "pure"
        r.set("quantization_bit", "qlora_quant_type", str(r.value("quantization_type", "nf4")))
        r.set("quantization_bit", "qlora_double_quant", bool(r.value("double_quantization", True)))
    rank = int(r.value("lora_rank", 8))
    r.set("lora_rank", "lora_r", rank, "" if r.has("lora_rank") else "LLaMA-Factory's default")
    r.set("lora_alpha", "lora_alpha", int(r.value("lora_alpha", 2 * rank)),
          "" if r.has("lora_alpha") else "LLaMA-Factory's default: 2 x lora_rank")
    r.take("lora_dropout", "lora_dropout", float)
    r.set("lora_target", "lora_targets", targets(r.value("lora_target", "all")),
          "" if r.has("lora_target") else "LLaMA-Factory's default: all")


FORMAT = Format("llamafactory", detect, read, out_keys=("output_dir",))
