"""TRL's ``trl sft --config their.yml`` and ``trl dpo`` (and alignment-handbook's recipes, read by the same
``TrlParser``): one YAML file of ``ScriptArguments``, the trainer's config (``SFTConfig``, ``DPOConfig``, ...:
transformers' ``TrainingArguments`` with TRL's defaults) and ``ModelConfig`` keys.

Read in TRL at commit f2cd577 (1.10.0.dev0; ``trl/trainer/sft_config.py``, ``dpo_config.py``, ``base_config.py``,
``model_config.py``, ``trl/trainer/utils.py`` ``create_model_from_path``) and transformers 5.24's
``TrainingArguments`` (docs/trainers.md):

- the model is loaded in ``dtype`` / ``torch_dtype`` (default ``float32``); ``bf16`` defaults to true when ``fp16``
  is not set, so an fp32 model trains under bf16 autocast (precision amp); ``gradient_checkpointing`` defaults to true,
  ``per_device_train_batch_size`` to 8, ``max_length`` to 1,024, ``packing`` to false, ``optim`` to
  ``adamw_torch_fused`` (transformers >= 4.54 with torch >= 2.8);
- the SFT loss: ``loss_type`` defaults to ``chunked_nll`` (TRL >= 1.7) unless ``use_liger_kernel`` (Liger's fused
  linear cross-entropy); ``nll`` and ``dft`` are the full cross-entropy;
- which trainer runs the file is the command's (``trl sft``, ``trl dpo``, alignment-handbook's ``run_dpo.py`` /
  ``run_orpo.py``): a preference loss type (``sigmoid``, ``apo_zero`` ...) says DPO; keys of the preference trainers
  alone (``beta``, ``max_prompt_length``) say "a preference trainer" without saying which, and the objective is asked
  for by name (``--objective``);
- DPO's reference: the model with its adapters disabled under PEFT, else a second copy loaded like the model (in its
  ``dtype``, fp32 by default), or none with ``precompute_ref_log_probs``.

A default the config leaves out is TRL's, said so.
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
    fsdp_strategy,
    precision,
    sharded_master,
    targets,
    trainer_defaults,
    training_keys,
)
from core.objectives import named as objective_named

DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}
NO_MEMORY = NO_MEMORY_TRAINER | frozenset({
    "dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split", "dataset_text_field",
    "dataset_mixer", "dataset_mixture", "dataset_splits", "dataset_num_proc", "preprocessing_num_workers",
    "completion_only_loss", "assistant_only_loss", "eos_token", "chat_template", "chat_template_path",
    "model_revision", "trust_remote_code", "rpo_alpha", "desirable_weight",
    "undesirable_weight", "simpo_gamma", "cpo_alpha", "truncation_mode", "disable_dropout", "ref_model_mixup_alpha",
    "ref_model_sync_steps", "sync_ref_model", "dataset_kwargs", "lr_scheduler_kwargs", "log_level", "run_name",
    "average_tokens_across_devices"})
#: keys only TRL's preference trainers (DPO, ORPO, CPO/SimPO, KTO) have
PREFERENCE_KEYS = ("beta", "max_prompt_length", "max_completion_length", "precompute_ref_log_probs", "rpo_alpha",
                   "ref_model_init_kwargs", "desirable_weight", "undesirable_weight", "cpo_alpha", "simpo_gamma")
#: SFTConfig's loss types -> the spec's loss
SFT_LOSSES = {"nll": "standard", "dft": "standard", "chunked_nll": "chunked_nll"}


def detect(data: dict[str, Any]) -> bool:
    return "model_name_or_path" in data and not {"stage", "finetuning_type", "cutoff_len"} & set(data)


def read(data: dict[str, Any], path: Path, overrides: Mapping[str, Any]) -> Imported:
    r = Reader("trl", data, path, NO_MEMORY, overrides)
    r.take("model_name_or_path", "model", str)
    objective = _objective(r)
    training_keys(r, batch="per_device_train_batch_size", packing="packing", schedule="lr_scheduler_type",
                  optim="optim")
    trainer_defaults(r, "TRL", batch=True, optim=True)
    _length(r, data)
    if r.has("max_prompt_length"):
        r.used["max_prompt_length"] = (f"{r.value('max_prompt_length')}: the prompt's share of max_length, which "
                                       "bounds the whole sequence planned")
    _dtype(r)
    if r.has("gradient_checkpointing"):
        r.set("gradient_checkpointing", "gradient_checkpointing", bool(r.value("gradient_checkpointing")))
    else:
        r.default("gradient_checkpointing", True, "base_config.py")
    r.ignore("gradient_checkpointing_kwargs.use_reentrant", "reentrant or not, checkpointing keeps each layer's "
                                                          "input: the same memory")
    if r.has("attn_implementation"):
        r.set("attn_implementation", "attn_implementation", str(r.value("attn_implementation")))
    _adapters(r)
    _loss(r, objective)
    if r.value("padding_free", False):
        r.set("padding_free", "padding", "packed", "one row of the batch's real lengths, no padding, no mask: planned "
                                                   "as full rows of max_length (an upper bound)")
    if r.value("activation_offloading", False):
        r.set("activation_offloading", "activation_offloading", True)
    if r.has("deepspeed"):
        deepspeed_strategy(r, "deepspeed")
    fsdp_strategy(r, "fsdp", "fsdp_config.offload_params")
    sharded_master(r)
    evaluation(r)
    return r.done()


def _objective(r: Reader) -> str:
    """SFT, or the preference objective the file's keys say (asked for by name when they do not say which)."""
    loss_type = r.value("loss_type")
    named = objective_named("trl", str(loss_type)) if loss_type is not None else None
    if named is not None:
        r.set("loss_type", "objective", named.name, f"loss_type {loss_type}: a {named.label} loss")
        _reference(r, named.name)
        return named.name
    held = [k for k in PREFERENCE_KEYS if r.has(k)]
    if not held:
        return "sft"
    if r.given("objective"):
        r.value(held[0])
        r.given_by_flag["objective"] = (f"--objective {r.overrides['objective']!r}: the file holds {', '.join(held)}, "
                                        "keys of TRL's preference trainers")
        _reference(r, str(r.overrides["objective"]))
        return str(r.overrides["objective"])
    r.need(held[0], "objective", f"holds {', '.join(held)}: keys of TRL's preference trainers (DPO, ORPO, CPO/SimPO, "
                                 "KTO); which one runs the file is the command's (trl dpo, run_orpo.py ...), not the "
                                 "file's: give it (dpo, orpo, simpo, kto)")
    return "sft"


def _reference(r: Reader, objective: str) -> None:
    if objective in ("orpo", "simpo"):
        return
    if r.value("precompute_ref_log_probs", False):
        r.set("precompute_ref_log_probs", "reference", "precomputed", "the reference's log-probabilities made before "
                                                                      "training: no reference held")
    elif not r.value("use_peft", False):  # a second copy, loaded like the model (create_model_from_path)
        name = str(r.value("dtype", r.value("torch_dtype", "float32")))
        if name in DTYPES:
            r.settings["reference_dtype"] = DTYPES[name]
            r.defaults["reference_dtype"] = (f"{DTYPES[name]!r} (TRL's: the reference copy is loaded like the model, "
                                             "with its dtype; dpo_trainer.py create_model_from_path)")


def _length(r: Reader, data: dict[str, Any]) -> None:
    """``max_length`` (``max_seq_length``, its name before TRL 0.20), TRL's 1,024 when absent."""
    key = "max_length" if "max_length" in data else "max_seq_length" if "max_seq_length" in data else "max_length"
    if r.has(key):
        r.set(key, "seq_len", r.number(key), "" if key == "max_length" else "max_seq_length: max_length's name before "
                                                                             "TRL 0.20")
    elif key in data:
        r.need(key, "seq_len", "is null: TRL then truncates nothing and the longest sequence is the data's")
    else:
        r.default("seq_len", 1024, "SFTConfig / DPOConfig max_length")


def _dtype(r: Reader) -> None:
    fp16 = bool(r.value("fp16", False))
    bf16 = bool(r.value("bf16", not fp16))  # TRL's configs: bf16 defaults to true when fp16 is not set
    compute = "fp16" if fp16 else "bf16" if bf16 else "fp32"
    key = "fp16" if fp16 else "bf16"
    dtype_key = "dtype" if r.has("dtype") else "torch_dtype"
    name = str(r.value(dtype_key, "float32"))
    if name == "auto":
        r.refuse_unless_given(dtype_key, "dtype auto: the checkpoint's dtype decides", "dtype")
        return
    if name not in DTYPES:
        raise r.refuse(dtype_key, f"{name!r}: give bfloat16, float16 or float32")
    loaded = DTYPES[name]
    if not r.has(dtype_key):
        r.defaults["precision"] = "the model loaded in float32 (TRL's ModelConfig / create_model_from_path default)"
    if compute == "fp32":
        r.set(key, "dtype", loaded, "no bf16/fp16: the model's dtype")
        return
    precision(r, compute, loaded if loaded != compute else None, key)
    if not r.has(key) and not r.has("fp16"):
        r.also(key, "; bf16 is TRL's default")


def _adapters(r: Reader) -> None:
    if not r.value("use_peft", False):
        for key in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "use_dora", "load_in_4bit",
                    "load_in_8bit", "lora_modules_to_save"):
            r.ignore(key, "use_peft is off: no adapters")
        r.set("use_peft", "mode", "full", "use_peft off: every parameter trained") if r.has("use_peft") else \
            r.default("mode", "full", "use_peft off: every parameter trained")
        return
    four_bit, eight_bit = bool(r.value("load_in_4bit", False)), bool(r.value("load_in_8bit", False))
    dora = bool(r.value("use_dora", False))
    if (four_bit or eight_bit) and dora:
        raise r.refuse("use_dora", "DoRA over a quantised base: the planner models one LoRA variant at a time")
    r.set("use_peft", "mode", "qlora" if four_bit else "lora_int8" if eight_bit else "dora" if dora else "lora")
    for key, dest, default, kind in (("lora_r", "lora_r", 16, int), ("lora_alpha", "lora_alpha", 32, int),
                                     ("lora_dropout", "lora_dropout", 0.05, float)):
        if r.has(key):
            r.set(key, dest, r.number(key, kind))
        else:
            r.default(dest, default, f"ModelConfig.{key}")
    if r.has("lora_target_modules"):
        r.set("lora_target_modules", "lora_targets", targets(r.value("lora_target_modules")))
    else:
        r.default("lora_targets", "q_proj,v_proj", "peft's default targets for Llama-family models (ModelConfig "
                                                   "lora_target_modules None)")
    if r.has("lora_modules_to_save"):
        r.set("lora_modules_to_save", "lora_modules_to_save", targets(r.value("lora_modules_to_save")))
    if four_bit or eight_bit:  # a quantised base has no fp32 master copy: the spec's dtype is its compute dtype
        r.settings["precision"] = "pure"
        r.settings["lora_dtype"] = "model"
        r.also("use_peft", "; lora_dtype = 'model' (TRL casts the adapters of a quantised model to its dtype: "
                               "sft_trainer.py, dpo_trainer.py)")
    if four_bit:
        r.set("load_in_4bit", "qlora_quant_type", str(r.value("bnb_4bit_quant_type", "nf4")))
        r.set("use_bnb_nested_quant", "qlora_double_quant", bool(r.value("use_bnb_nested_quant", False)))


def _loss(r: Reader, objective: str) -> None:
    """The SFT loss (``loss_type``, its default by TRL's version) and Liger's kernels."""
    liger = bool(r.value("use_liger_kernel", False))
    if liger:
        r.set("use_liger_kernel", "loss", "fused_linear", "Liger's fused linear cross-entropy (apply_liger_kernel)")
        r.not_modelled("use_liger_kernel", "Liger's RMSNorm and SwiGLU keep less than the eager layers planned "
                                           "(their input and one fp32 value a row; 2 I-wide tensors, not 3): the "
                                           "activations planned are an upper bound")
        if objective != "sft":
            r.also("use_liger_kernel", "; the preference loss fused too (LigerFusedLinearDPOLoss): planned as it")
        return
    if objective != "sft":
        return  # a preference loss over the logits (loss_type set the objective)
    name = r.value("loss_type")
    if name is None:
        r.default("loss", "chunked_nll", "SFTConfig.loss_type since TRL 1.7 (nll before: give --loss standard)")
    elif str(name) in SFT_LOSSES:
        r.set("loss_type", "loss", SFT_LOSSES[str(name)])
    else:
        r.refuse_unless_given("loss_type", f"{name!r} is not an SFT loss TRL knows (nll, dft, chunked_nll)", "loss")


FORMAT = Format("trl", detect, read, out_keys=("output_dir",))
