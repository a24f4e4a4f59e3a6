"""axolotl's YAML config (its config reference and ``src/axolotl/utils/schemas/``, read at axolotl 067b021c:
``base_model``, ``micro_batch_size``, ``sequence_len``, ``adapter: lora | qlora``, ``load_in_8bit`` / ``load_in_4bit``,
``lora_*``, ``lora_modules_to_save``, ``peft_use_dora``, ``bf16``, ``sample_packing``, ``pad_to_sequence_len``,
``flash_attention``, ``deepspeed``, ``fsdp``, ``rl``, the Liger and Cut Cross-Entropy plugins' keys ...).

What axolotl does with them (docs/trainers.md):

- the model is loaded in the dtype it trains in (``bf16: auto`` is bf16 where the GPU has it; ``load_in_8bit``
  without bf16 loads fp16): precision pure; ``sequence_len`` defaults to 512, ``micro_batch_size`` to 1,
  ``gradient_checkpointing`` to off, ``optimizer`` to ``adamw_torch_fused``;
- ``sample_packing`` fills each micro-batch with ``micro_batch_size x sequence_len`` tokens of packed samples (one row
  under flash attention): planned packed; ``pad_to_sequence_len`` pads every batch to ``sequence_len`` (the plan's
  length is then exact; without it batches are padded to their longest sample, and the plan at ``sequence_len`` is an
  upper bound);
- ``rl: dpo | ipo | orpo | kto | simpo``: TRL's preference trainers; with an adapter the reference is the base with
  the adapters disabled unless ``rl_adapter_ref_model`` asks for a copy;
- ``deepspeed: path`` is read relative to the working directory (``normalize_config``: ``os.path.exists``);
- ``lora_target_linear`` adapts every linear layer but the LM head.
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

NO_MEMORY = NO_MEMORY_TRAINER | frozenset({
    "datasets", "dataset_prepared_path", "num_epochs", "saves_per_epoch", "wandb_project", "wandb_entity",
    "wandb_name", "wandb_log_model", "wandb_watch", "strict", "special_tokens", "tokenizer_type", "model_type",
    "base_model_config", "is_llama_derived_model", "chat_template", "train_on_inputs", "group_by_length",
    "early_stopping_patience", "debug", "loss_watchdog_patience", "loss_watchdog_threshold",
    "kto_desirable_weight", "kto_undesirable_weight", "lora_model_dir", "eval_table_size",
    "lora_fan_in_fan_out", "plugins", "tokens", "hub_model_id", "trust_remote_code", "test_datasets"})

#: axolotl's ``adapter`` values the planner models, and the one that loads the base in 4 bits
ADAPTERS = ("lora", "qlora")
FOUR_BIT_ADAPTER = ADAPTERS[1]
#: axolotl's Liger keys (integrations/liger/args.py) that shrink the layers' saved tensors: not modelled
LIGER_LAYER_KEYS = ("liger_rms_norm", "liger_glu_activation", "liger_swiglu", "liger_rope", "liger_layer_norm")


def detect(data: dict[str, Any]) -> bool:
    return "base_model" in data


def read(data: dict[str, Any], path: Path, overrides: Mapping[str, Any]) -> Imported:
    r = Reader("axolotl", data, path, NO_MEMORY, overrides)
    r.take("base_model", "model", str)
    training_keys(r, batch="micro_batch_size", packing="sample_packing", schedule="lr_scheduler", optim="optimizer")
    if "batch_size" not in r.settings:
        r.default("batch_size", 1, "micro_batch_size (schemas/training.py)")
    trainer_defaults(r, "axolotl", batch=False, optim=True)
    if r.has("sequence_len"):
        r.set("sequence_len", "seq_len", r.number("sequence_len"))
    else:
        r.default("seq_len", 512, "sequence_len (schemas/config.py)")
    _padding(r)
    _dtype(r)
    if r.has("gradient_checkpointing"):
        r.set("gradient_checkpointing", "gradient_checkpointing", bool(r.value("gradient_checkpointing")))
    else:
        r.default("gradient_checkpointing", False, "gradient_checkpointing")
    r.ignore("gradient_checkpointing_kwargs.use_reentrant", "reentrant or not, checkpointing keeps each layer's "
                                                          "input: the same memory")
    _attention(r)
    _adapter(r)
    _objective(r)
    _kernels(r)
    if r.value("activation_offloading"):
        r.set("activation_offloading", "activation_offloading", True,
              "saved activations to pinned host memory" + (" (legacy: torchtune's hooks)"
                                                          if r.value("activation_offloading") == "legacy" else ""))
    if r.has("deepspeed"):
        deepspeed_strategy(r, "deepspeed")
    fsdp_strategy(r, "fsdp", "fsdp_config.fsdp_offload_params")
    _fsdp_config(r)
    r.ignore("min_sample_len", "a filter of the data (shorter samples dropped): the sequence planned is sequence_len")
    if r.has("sequence_parallel_degree") and r.number("sequence_parallel_degree") > 1:
        r.not_modelled("sequence_parallel_degree", f"sequence parallelism over {r.value('sequence_parallel_degree')} "
                                                   "ranks splits each sequence's activations among them: the plan "
                                                   "holds every token on each device (an upper bound)")
    if r.value("tiled_mlp"):
        r.not_modelled("tiled_mlp", "the MLP computed in tiles of the sequence keeps less than the whole-sequence "
                                    "MLP planned (an upper bound)")
    sharded_master(r)
    evaluation(r)
    return r.done()


#: axolotl's ``fsdp_config`` keys, with what each does to the plan
FSDP_CONFIG = {
    "fsdp_config.fsdp_offload_params": "the parameters, gradients and optimizer states to the CPU when sharded "
                                       "(offload = 'all')",
    "fsdp_config.fsdp_sharding_strategy": "FULL_SHARD: zero3 when sharded (SHARD_GRAD_OP: zero2)",
    "fsdp_config.fsdp_transformer_layer_cls_to_wrap": "a decoder layer is the unit gathered at a time, as planned",
    "fsdp_config.fsdp_auto_wrap_policy": "each decoder layer wrapped: the unit gathered at a time, as planned",
    "fsdp_config.fsdp_cpu_ram_efficient_loading": "host memory while loading: not the device's, not the step's",
    "fsdp_config.fsdp_limit_all_gathers": "rate-limits all-gathers: at most the two gathered units planned",
    "fsdp_config.fsdp_backward_prefetch": "BACKWARD_PRE: the next unit gathered during backward, as planned",
    "fsdp_config.fsdp_sync_module_states": "broadcasts rank 0's weights at load: moves no memory in the step",
    "fsdp_config.fsdp_use_orig_params": "the flat parameters' views: moves no memory the plan models",
    "fsdp_config.fsdp_state_dict_type": "how checkpoints are saved: moves no memory in the step"}


def _fsdp_config(r: Reader) -> None:
    for key in [k for k in r.leaves if k.startswith("fsdp_config.")]:
        if key in FSDP_CONFIG and key not in r.used:
            r._seen.add(key)
            r.used[key] = FSDP_CONFIG[key]
        elif key not in r.used:
            r.not_modelled(key, "an FSDP setting the plan does not read: it plans FSDP full shard with two units "
                                "gathered at a time")


def _padding(r: Reader) -> None:
    if r.value("sample_packing", False):
        r.used["sample_packing"] = ("padding = 'packed' (each micro-batch filled with micro_batch_size x sequence_len "
                                    "tokens of packed samples: planned as that many full rows, no padding mask)")
    if r.has("pad_to_sequence_len"):
        padded = bool(r.value("pad_to_sequence_len"))
        r.used["pad_to_sequence_len"] = ("every batch padded to sequence_len: the plan's length is exact" if padded else
                                         "batches padded to their longest sample (a multiple of 64): the plan at "
                                         "sequence_len is an upper bound")


def _dtype(r: Reader) -> None:
    bf16, fp16 = r.value("bf16", "auto"), bool(r.value("fp16", False))
    eight = bool(r.value("load_in_8bit", False))
    if fp16 or (eight and bf16 is False):
        precision(r, "fp16", None, "fp16" if r.has("fp16") else "load_in_8bit")
    elif bf16:
        precision(r, "bf16", None, "bf16") if r.has("bf16") else r.default("dtype", "bf16", "bf16: auto")
        if bf16 == "auto" and r.has("bf16"):
            r.used["bf16"] = "dtype = 'bf16' (auto: bf16 where the GPU has it)"
        r.settings["precision"] = "pure"
    else:
        r.set("bf16", "dtype", "fp32", "neither bf16 nor fp16")


def _attention(r: Reader) -> None:
    if r.has("attn_implementation"):
        name = str(r.value("attn_implementation"))
        r.set("attn_implementation", "attn_implementation", {"flash_attention_2": "flash_attention_2",
                                                             "sdpa": "sdpa", "eager": "eager"}.get(name, "sdpa"),
              "" if name in ("flash_attention_2", "sdpa", "eager") else f"{name}: planned as sdpa's fused kernel")
    elif r.value("flash_attention", False):
        r.set("flash_attention", "attn_implementation", "flash_attention_2")
    elif r.value("sdp_attention", False):
        r.set("sdp_attention", "attn_implementation", "sdpa")
    if r.value("xformers_attention", False):
        r.refuse_unless_given("xformers_attention", "xformers attention is not one the planner models; use "
                                                    "flash_attention or sdp_attention", "attn_implementation")


def _adapter(r: Reader) -> None:
    adapter = r.value("adapter")
    eight, four = bool(r.value("load_in_8bit", False)), bool(r.value("load_in_4bit", False))
    if adapter in (None, ""):
        if eight or four:
            raise r.refuse("load_in_8bit" if eight else "load_in_4bit", "a quantised base without an adapter trains "
                                                                        "nothing: add adapter: lora")
        r.default("mode", "full", "no adapter: every parameter trained")
        return
    if adapter not in ADAPTERS:
        r.refuse_unless_given("adapter", f"adapter {adapter!r}: the planner models {' and '.join(ADAPTERS)}", "mode")
        return
    four = four or adapter == FOUR_BIT_ADAPTER
    dora = bool(r.value("peft_use_dora", False))
    if (four or eight) and dora:
        raise r.refuse("peft_use_dora", "DoRA over a quantised base: the planner models one LoRA variant at a time")
    mode = "qlora" if four else "lora_int8" if eight else "dora" if dora else "lora"
    r.set("adapter", "mode", mode, {"qlora": "QLoRA: the base in 4 bits", "lora_int8": "load_in_8bit: LoRA over an "
                                    "8-bit base (LLM.int8)"}.get(mode, ""))
    if four:
        r.settings["precision"] = "pure"  # a 4-bit base keeps no fp32 master copy
    r.take("lora_r", "lora_r", int)
    r.take("lora_alpha", "lora_alpha", int)
    r.take("lora_dropout", "lora_dropout", float)
    if r.value("lora_target_linear", False):
        r.set("lora_target_linear", "lora_targets", "all-linear")
        r.ignore("lora_target_modules", "lora_target_linear names every linear layer")
    else:
        r.take("lora_target_modules", "lora_targets", targets)
    if r.has("lora_modules_to_save"):
        r.set("lora_modules_to_save", "lora_modules_to_save", targets(r.value("lora_modules_to_save")),
              "trained in full beside the adapters (peft's modules_to_save: a trained copy of each)")


def _objective(r: Reader) -> None:
    rl = r.value("rl")
    if rl in (None, ""):
        return
    found = objective_named("axolotl", str(rl))
    if found is None:
        r.refuse_unless_given("rl", f"rl {rl!r}: the planner models dpo, ipo, orpo, kto and simpo", "objective")
        return
    r.set("rl", "objective", found.name, found.label)
    if found.reference and r.settings.get("mode") not in (None, "full") and r.value("rl_adapter_ref_model", False):
        r.set("rl_adapter_ref_model", "reference", "copy", "a second copy of the base as the reference")


def _kernels(r: Reader) -> None:
    plugins = " ".join(str(p) for p in r.value("plugins", []) or [])
    if r.value("liger_fused_linear_cross_entropy", False):
        r.set("liger_fused_linear_cross_entropy", "loss", "fused_linear")
    elif r.value("liger_cross_entropy", False):
        r.not_modelled("liger_cross_entropy", "Liger's cross-entropy writes the gradient into its fp32 input and "
                                              "keeps no log_softmax: the standard loss planned is an upper bound")
    elif r.value("cut_cross_entropy", False) or "CutCrossEntropyPlugin" in plugins:
        r.set("cut_cross_entropy" if r.has("cut_cross_entropy") else "plugins", "loss", "cut",
              "Cut Cross-Entropy: no logits")
    elif r.value("chunked_cross_entropy", False):
        r.set("chunked_cross_entropy", "loss", "chunked")
        r.take("chunked_cross_entropy_num_chunks", "loss_chunks", int)
    for key in LIGER_LAYER_KEYS:
        if r.value(key, False):
            r.not_modelled(key, "Liger's kernel keeps less than the eager layer planned (RMSNorm: its input and one "
                                "fp32 value a row; SwiGLU: 2 I-wide tensors, not 3): an upper bound")


FORMAT = Format("axolotl", detect, read, out_keys=("output_dir",))
