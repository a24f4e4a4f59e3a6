"""LLaMA-Factory's YAML config (``llamafactory-cli train their.yaml``; its ``hparams/`` dataclasses, read at
LLaMA-Factory ff6d4d12: ``model_name_or_path``, ``stage``, ``finetuning_type``, ``pref_loss``, ``lora_rank``,
``lora_alpha``, ``lora_target``, ``use_dora``, ``quantization_bit``, ``cutoff_len``, ``packing``, ``flash_attn``,
``disable_gradient_checkpointing``, ``use_galore``, ``use_badam``, ``deepspeed`` and transformers' training
arguments).

What LLaMA-Factory does with them (docs/trainers.md):

- the model is loaded in the checkpoint's dtype and trained in ``bf16`` / ``fp16`` / ``pure_bf16``; its trainable
  parameters are upcast to fp32 unless ``pure_bf16``, BAdam or ZeRO-3 (so full fine-tuning with ``bf16`` keeps an fp32
  copy under autocast: precision amp); LoRA adapters are fp32 either way;
- defaults: ``cutoff_len`` 2,048, ``finetuning_type`` lora, ``lora_rank`` 8 and ``lora_alpha`` twice it,
  ``lora_target`` all (every linear layer but the LM head), gradient checkpointing on,
  ``per_device_train_batch_size`` 8 and ``optim`` transformers' (``adamw_torch_fused``);
- ``stage: dpo | kto``: a preference objective with a reference (the base with adapters disabled under LoRA, a second
  copy in the checkpoint's dtype in full fine-tuning); ``pref_loss: orpo | simpo`` needs none;
- ``deepspeed: examples/deepspeed/ds_z3_config.json`` is resolved against the working directory (the examples expect
  the repository's root), as transformers' ``HfDeepSpeedConfig`` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core.importers.base import (
    NO_MEMORY_TRAINER,
    Format,
    Imported,
    Reader,
    deepspeed_strategy,
    evaluation,
    precision,
    sharded_master,
    targets,
    trainer_defaults,
    training_keys,
)
from core.methods import method_of
from core.objectives import named as objective_named

NO_MEMORY = NO_MEMORY_TRAINER | frozenset({
    "dataset", "dataset_dir", "template", "overwrite_cache", "preprocessing_num_workers", "plot_loss",
    "trust_remote_code", "max_samples", "pref_ftx", "simpo_gamma", "badam_verbose", "galore_scale",
    "galore_proj_type"})
#: ``finetuning_type`` values -> whether every parameter is trained
FINETUNING = {"full": True, "lora": False}
FINETUNING_FULL = "full"
ATTENTION = {"fa2": "flash_attention_2", "sdpa": "sdpa", "disabled": "eager", "auto": "sdpa"}


def detect(data: dict[str, Any]) -> bool:
    return "model_name_or_path" in data and bool({"stage", "finetuning_type", "cutoff_len"} & set(data))


def read(data: dict[str, Any], path: Path, overrides: Mapping[str, Any]) -> Imported:
    r = Reader("llamafactory", data, path, NO_MEMORY, overrides)
    r.take("model_name_or_path", "model", str)
    _stage(r)
    training_keys(r, batch="per_device_train_batch_size", packing="packing", schedule="lr_scheduler_type",
                  optim="optim")
    if str(r.value("stage", "sft")) == "pt" and not r.has("packing"):
        r.default("padding", "packed", "packing unset: on for stage pt (hparams/parser.py:645)")
    trainer_defaults(r, "LLaMA-Factory")
    if r.has("cutoff_len"):
        r.set("cutoff_len", "seq_len", r.number("cutoff_len"))
    else:
        r.default("seq_len", 2048, "cutoff_len (hparams/data_args.py)")
    off = bool(r.value("disable_gradient_checkpointing", False))
    if r.has("disable_gradient_checkpointing"):
        r.set("disable_gradient_checkpointing", "gradient_checkpointing", not off)
    else:
        r.default("gradient_checkpointing", True, "disable_gradient_checkpointing off (model_utils/checkpointing.py)")
    attention = str(r.value("flash_attn", "auto"))
    if attention not in ATTENTION:
        raise r.refuse("flash_attn", f"{attention!r}: give auto, sdpa, fa2 or disabled")
    if r.has("flash_attn"):
        r.set("flash_attn", "attn_implementation", ATTENTION[attention])
    else:
        r.default("attn_implementation", "sdpa", "flash_attn auto: transformers' sdpa")
    _finetuning(r)
    if r.has("deepspeed"):
        deepspeed_strategy(r, "deepspeed")
    _precision(r)
    _optimizers(r)
    if r.value("enable_liger_kernel", False):
        r.set("enable_liger_kernel", "loss", "fused_linear", "Liger's kernels, its fused linear cross-entropy")
        r.not_modelled("enable_liger_kernel", "Liger's RMSNorm and SwiGLU keep less than the eager layers planned: "
                                              "an upper bound")
    sharded_master(r, ("deepspeed",))
    _reference_dtype(r)
    evaluation(r)
    return r.done()


def _reference_dtype(r: Reader) -> None:
    """A reference model of its own (full fine-tuning, or ``ref_model``) is loaded with ``torch_dtype="auto"``
    (model/loader.py:154): the checkpoint's dtype, not upcast as the trained policy is; planned in the run's 16-bit
    dtype, which the checkpoints of the models these configs name are stored in."""
    dtype = r.settings.get("dtype", "fp32")
    if "objective" not in r.settings or dtype == "fp32":
        return
    r.settings["reference_dtype"] = dtype
    r.defaults["reference_dtype"] = (f"{dtype!r} (LLaMA-Factory's: a reference of its own is loaded with torch_dtype "
                                     "auto, the checkpoint's dtype (model/loader.py:154), not upcast like the policy)")


def _stage(r: Reader) -> None:
    stage = str(r.value("stage", "sft"))
    if stage in ("sft", "pt"):
        if r.has("stage"):
            r.used["stage"] = f"{stage}: supervised (objective sft)"
        return
    if stage == "orpo":  # LLaMA-Factory's stage before pref_loss: orpo
        stage, loss = "dpo", "orpo"
    elif stage not in ("dpo", "kto"):
        r.refuse_unless_given("stage", f"stage {stage}: the planner models sft, pt, dpo and kto ({stage} holds a "
                                       "reward or value model too)", "objective")
        return
    else:
        loss = str(r.value("pref_loss", "sigmoid"))
    found = objective_named("llamafactory", loss) if stage == "dpo" else objective_named("llamafactory", "kto")
    if found is None:
        r.refuse_unless_given("pref_loss", f"pref_loss {loss}: the planner models sigmoid, hinge, ipo, orpo and "
                                           "simpo", "objective")
        return
    r.set("stage", "objective", found.name, f"stage {stage}" + (f", pref_loss {loss}" if r.has("pref_loss") else ""))
    if r.has("pref_loss"):
        r.used["pref_loss"] = f"objective = {found.name!r} ({found.label})"
    if r.has("ref_model"):
        r.set("ref_model", "reference", "copy", "a reference model of its own")


def _precision(r: Reader) -> None:
    """bf16 / fp16 / pure_bf16, and LLaMA-Factory's fp32 upcast of the trainable parameters (unless pure_bf16,
    BAdam, a quantised base or ZeRO-3): full fine-tuning under bf16 keeps fp32 parameters (precision amp)."""
    full = method_of(str(r.settings.get("mode") or FINETUNING_FULL)).trains_base
    upcast = full and not r.value("pure_bf16", False) and not r.value("use_badam", False) and \
        r.settings.get("strategy") != "zero3"
    if r.value("pure_bf16", False):
        precision(r, "bf16", None, "pure_bf16")
    elif r.value("bf16", False):
        precision(r, "bf16", "fp32" if upcast else None, "bf16")
        if upcast:
            r.also("bf16", "; LLaMA-Factory upcasts the trained parameters to fp32 (model/adapter.py)")
    elif r.value("fp16", False):
        precision(r, "fp16", "fp32" if upcast else None, "fp16")
    else:
        r.default("dtype", "bf16", "neither bf16 nor fp16: infer_optim_dtype of the checkpoint (bf16), no autocast")
        r.settings["precision"] = "pure"


def _finetuning(r: Reader) -> None:
    kind = r.value("finetuning_type", "lora")
    if kind not in FINETUNING:
        r.refuse_unless_given("finetuning_type", f"{kind}: the planner models full and lora (freeze trains some "
                                                 "layers)", "mode")
        return
    if FINETUNING[kind]:
        if r.value("use_badam", False):
            mode = str(r.value("badam_mode", "layer"))
            if mode != "layer":
                raise r.refuse("badam_mode", f"{mode}: the planner models BAdam's layer mode (one decoder layer a "
                                             "block)")
            r.set("use_badam", "mode", "badam", "BAdam: one decoder layer trained at a time")
            for key in ("badam_switch_interval", "badam_switch_mode", "badam_start_block"):
                r.ignore(key, "which layer is active when: every layer holds the same, so the plan does not depend "
                              "on it")
        else:
            r.set("finetuning_type", "mode", "full")
        return
    if not r.has("finetuning_type"):
        r.default("mode", "lora", "finetuning_type")
    bits = r.value("quantization_bit")
    if bits not in (None, 4, 8):
        raise r.refuse("quantization_bit", f"{bits}-bit base: the planner models 4-bit (QLoRA) and 8-bit "
                                           "(LLM.int8) bases")
    dora = bool(r.value("use_dora", False))
    if bits and dora:
        raise r.refuse("use_dora", "DoRA over a quantised base: the planner models one LoRA variant at a time")
    mode = "qlora" if bits == 4 else "lora_int8" if bits == 8 else "dora" if dora else "lora"
    if r.has("finetuning_type"):
        r.set("finetuning_type", "mode", mode)
    else:
        r.settings["mode"] = mode
    if bits:
        r.settings["precision"] = "pure"
        r.set("quantization_bit", "mode", mode, "bitsandbytes' 4-bit base" if bits == 4 else "LLM.int8")
    method = str(r.value("quantization_method", "bnb"))
    if bits and method not in ("bnb", "bitsandbytes"):
        raise r.refuse("quantization_method", f"{method}: the planner models bitsandbytes' quantised bases")
    if r.has("quantization_method"):
        r.used["quantization_method"] = f"{method}: bitsandbytes' layout, as planned"
    if bits == 4:
        r.set("quantization_bit", "qlora_quant_type", str(r.value("quantization_type", "nf4")))
        r.set("quantization_bit", "qlora_double_quant", bool(r.value("double_quantization", True)))
    rank = r.number("lora_rank") if r.has("lora_rank") else 8
    if r.has("lora_rank"):
        r.set("lora_rank", "lora_r", rank)
    else:
        r.default("lora_r", rank, "lora_rank")
    if r.has("lora_alpha"):
        r.set("lora_alpha", "lora_alpha", r.number("lora_alpha"))
    else:
        r.default("lora_alpha", 2 * rank, "lora_alpha: 2 x lora_rank")
    r.take("lora_dropout", "lora_dropout", float)
    if r.has("lora_target"):
        r.set("lora_target", "lora_targets", targets(r.value("lora_target")))
    else:
        r.default("lora_targets", "all-linear", "lora_target all: every linear layer but the LM head")
    if r.has("additional_target"):
        r.set("additional_target", "lora_modules_to_save", targets(r.value("additional_target")))


def _optimizers(r: Reader) -> None:
    """GaLore (``use_galore``: its rank, targets, layer-wise) over the optimizer the arguments name."""
    if not r.value("use_galore", False):
        return
    r.set("use_galore", "optimizer", "galore_adamw", "GaLore's AdamW over the targeted matrices")
    r.defaults.pop("optimizer", None)
    rank = r.number("galore_rank") if r.has("galore_rank") else 16
    r.set("galore_rank", "galore_rank", rank) if r.has("galore_rank") else r.default("galore_rank", 16, "galore_rank")
    r.ignore("galore_update_interval", "how often the projection is remade by an SVD of the gradient: one step in it "
                                       "makes the SVD's workspace, not planned")
    target = r.value("galore_target", "all")
    r.set("galore_target", "galore_targets", targets(target)) if r.has("galore_target") else \
        r.default("galore_targets", "all-linear", "galore_target all")
    if r.value("galore_layerwise", False):
        r.set("galore_layerwise", "optimizer_in_backward", True, "one optimizer per parameter stepped in its gradient "
                                                                 "hook")


FORMAT = Format("llamafactory", detect, read, out_keys=("output_dir",))
