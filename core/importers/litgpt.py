"""LitGPT's ``litgpt finetune_full --config their.yaml`` and ``litgpt finetune_lora --config their.yaml``: the
arguments of ``setup()`` in ``litgpt/finetune/full.py`` and ``litgpt/finetune/lora.py`` (read in LitGPT 0.5.13), as
its ``config_hub/finetune/*/*.yaml`` files hold them: ``checkpoint_dir``, ``precision``, ``quantize``, ``devices``,
``num_nodes``, ``lora_r`` / ``lora_alpha`` / ``lora_dropout`` and the ``lora_query`` ... ``lora_head`` switches, a
``train`` table (``TrainArgs``: ``micro_batch_size``, ``global_batch_size``, ``max_seq_length`` ...) and an
``optimizer`` (a name such as ``AdamW`` or a ``class_path`` with ``init_args``).

What LitGPT does with them, read in its source:

- ``precision`` None is ``get_default_supported_precision(training=True)``: ``bf16-mixed`` (even on the CPU);
  ``bf16-true`` / ``16-true`` keep the weights in 16 bits (precision pure), ``*-mixed`` autocasts fp32 weights (amp);
- ``quantize: bnb.nf4`` / ``bnb.nf4-dq`` / ``bnb.fp4`` / ``bnb.fp4-dq`` load the base in 4 bits (QLoRA, double
  quantisation for ``-dq``); ``bnb.int8-training`` is refused (an 8-bit base);
- accumulation is ``global_batch_size / (devices x num_nodes) / micro_batch_size`` (``TrainArgs.gradient_accumulation_iters``);
- a batch is padded to its longest sample (``get_sft_collate_fn``): padded, up to ``train.max_seq_length``;
- more than one device: ``finetune_full`` runs FSDP (``FSDPStrategy``, full shard) with activation checkpointing of
  every ``Block``, ``finetune_lora`` a data-parallel ``ModelParallelStrategy`` whose ``parallelize_fn`` shards the
  model and checkpoints activations: both planned as ZeRO-3 with gradient checkpointing;
- the method: a config with LoRA keys (``lora_r`` ...) is ``finetune_lora``'s (``finetune_full`` refuses them), else
  every parameter is trained.

LitGPT's modules are its own (a fused ``qkv`` linear; LoRA on parts of it by ``lora_query`` / ``lora_key`` /
``lora_value``): the plan is made for the checkpoint's transformers model with the same shapes and adapters on the same
projections, and says so (an estimate of LitGPT's activations).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core.importers.base import Format, Imported, Reader
from core.optim import known_names, named

#: ``precision`` -> (the spec's dtype, precision)
PRECISIONS = {"32-true": ("fp32", "pure"), "bf16-true": ("bf16", "pure"), "16-true": ("fp16", "pure"),
              "bf16-mixed": ("bf16", "amp"), "16-mixed": ("fp16", "amp")}
DEFAULT_PRECISION = "bf16-mixed"
#: ``quantize`` -> (quant type, double quantisation)
QUANTIZE = {"bnb.nf4": ("nf4", False), "bnb.nf4-dq": ("nf4", True), "bnb.fp4": ("fp4", False),
            "bnb.fp4-dq": ("fp4", True)}
#: LitGPT's LoRA switches -> the transformers (Llama) modules with the same adapter shapes
LORA_TARGETS = {"lora_query": ("q_proj",), "lora_key": ("k_proj",), "lora_value": ("v_proj",),
                "lora_projection": ("o_proj",), "lora_mlp": ("gate_proj", "up_proj", "down_proj")}
#: the same switches for the transformers families whose modules are named otherwise (``model_type`` of the model's
#: config.json): a fused query-key-value projection gets one adapter over all of it (LitGPT's adapts only the parts
#: switched on: an upper bound of its adapter), Phi's ``dense`` / ``fc1`` / ``fc2``, Phi-3's fused ``qkv_proj`` and
#: ``gate_up_proj``
FAMILY_TARGETS = {
    "falcon": {"lora_query": ("query_key_value",), "lora_key": ("query_key_value",),
               "lora_value": ("query_key_value",), "lora_projection": ("dense",),
               "lora_mlp": ("dense_h_to_4h", "dense_4h_to_h")},
    "phi": {**LORA_TARGETS, "lora_projection": ("dense",), "lora_mlp": ("fc1", "fc2")},
    "phi3": {"lora_query": ("qkv_proj",), "lora_key": ("qkv_proj",), "lora_value": ("qkv_proj",),
             "lora_projection": ("o_proj",), "lora_mlp": ("gate_up_proj", "down_proj")},
}
FAMILY_TARGETS["gpt_neox"] = FAMILY_TARGETS["falcon"]
#: the switches of parts of LitGPT's one fused ``qkv`` linear
FUSED = ("lora_query", "lora_key", "lora_value")
#: ``finetune_lora``'s defaults (its ``setup()`` signature)
LORA_DEFAULTS = {"lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.05, "lora_query": True, "lora_key": False,
                 "lora_value": True, "lora_projection": False, "lora_mlp": False, "lora_head": False}
NO_MEMORY = frozenset({"out_dir", "resume", "data", "logger_name", "log", "access_token", "seed",
                       "train.save_interval", "train.log_interval", "train.max_norm", "train.min_lr",
                       "train.beta1", "train.beta2", "train.weight_decay",
                       "train.tie_embeddings"})


def detect(data: dict[str, Any]) -> bool:
    train = data.get("train")
    return isinstance(train, dict) and bool({"micro_batch_size", "global_batch_size"} & set(train))


def read(data: dict[str, Any], path: Path, overrides: Mapping[str, Any]) -> Imported:
    r = Reader("litgpt", data, path, NO_MEMORY, overrides)
    if not r.has("checkpoint_dir"):
        raise r.refuse("checkpoint_dir", "no checkpoint folder: the planner reads the model's shapes from its "
                                         "config.json; give checkpoint_dir (LitGPT's positional argument)")
    _model(r)
    _shape(r)
    _precision(r)
    if any(r.has(k) for k in LORA_DEFAULTS):
        _adapters(r)
    else:
        r.settings["mode"] = "full"
        r.also("checkpoint_dir", "; no lora_* key: finetune_full, every parameter trained")
    if "optimizer" not in r.settings:
        _optimizer(r)
    else:
        r.ignore("optimizer.class_path", "replaced by PagedAdamW under quantize")
        r.take("optimizer.init_args.lr", "learning_rate", float)
        for leaf in [k for k in r.leaves if k.startswith("optimizer.init_args.") and k != "optimizer.init_args.lr"]:
            r.ignore(leaf, "an optimizer argument: moves no memory")
    _placement(r)
    for key in [k for k in r.leaves if k.startswith("eval.")]:
        r.ignore(key, "the periodic validation's and sample generation's (a KV cache of max_new_tokens): forward "
                      "only, below the training step's peak")
    r.settings["loss"] = "litgpt_chunked"
    r.defaults["loss"] = ("'litgpt_chunked' (LitGPT's finetune loop: lm_head_chunk_size=128 and chunked_cross_entropy, "
                          "the logits held by the loop)")
    r.run_length("train.max_steps", "train.epochs", "train.max_tokens", "train.max_time", "train.lr_warmup_steps",
                 "train.lr_warmup_fraction")
    return r.done()


def _model(r: Reader) -> None:
    """``checkpoint_dir``: a LitGPT checkpoint folder here (its config.json, as ``litgpt download`` keeps it), else the
    Hub model it was downloaded from (``litgpt download <org>/<name>`` writes ``checkpoints/<org>/<name>``), from the
    local Hub cache. LitGPT's GPT never ties its LM head to the embedding (the conversion copies it): planned untied."""
    folder = str(r.value("checkpoint_dir")).rstrip("/")
    parts = Path(folder).parts
    if (Path(folder) / "config.json").is_file() or len(parts) < 2:
        model, how = folder, "the checkpoint's transformers model stands for LitGPT's GPT of the same shapes"
    else:
        model = "/".join(parts[-2:])
        how = (f"{folder} is not here: the Hub model it is downloaded from (litgpt download {model}), from the Hub "
               "cache; its transformers model stands for LitGPT's GPT of the same shapes")
    r.set("checkpoint_dir", "model", model, how)
    r.settings["untie_embeddings"] = True
    r.settings["embedding_fp32_states"] = False  # only transformers' Trainer registers embeddings for 32-bit states
    r.also("checkpoint_dir", "; untie_embeddings = True (LitGPT's GPT keeps the LM head apart from the embedding)")


def _shape(r: Reader) -> None:
    micro = r.number("train.micro_batch_size") if r.has("train.micro_batch_size") else 1
    r.set("train.micro_batch_size", "batch_size", micro, "" if r.has("train.micro_batch_size") else "LitGPT's default")
    ranks = _ranks(r)
    if r.has("train.global_batch_size"):
        total = r.number("train.global_batch_size")
        per_rank = total // ranks
        if per_rank < micro or per_rank % micro:
            raise r.refuse("train.global_batch_size", f"{total} over {ranks} rank(s) is not a whole number of "
                                                      f"micro-batches of {micro}; make it a multiple of "
                                                      f"{micro * ranks}")
        r.set("train.global_batch_size", "grad_accum", per_rank // micro,
              f"{total} / {ranks} rank(s) / micro-batch {micro}")
    r.settings["padding"] = "padded"
    if not r.has("train.max_seq_length"):
        r.need("train.max_seq_length", "seq_len", "is not given: LitGPT then trains up to the longest sample, which "
                                                  "the plan cannot know")
        return
    r.set("train.max_seq_length", "seq_len", r.number("train.max_seq_length"))
    r.also("train.max_seq_length", " (LitGPT pads each batch to its longest sample: planned at the most)")


def _ranks(r: Reader) -> int:
    devices = r.value("devices", 1)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise r.refuse("devices", f"{devices!r}: give the number of devices (an integer), e.g. 1")
    return devices * int(r.number("num_nodes") if r.has("num_nodes") else 1)


def _precision(r: Reader) -> None:
    name = str(r.value("precision", DEFAULT_PRECISION))
    if name not in PRECISIONS:
        raise r.refuse("precision", f"{name!r}: give one of {', '.join(PRECISIONS)}")
    dtype, precision = PRECISIONS[name]
    how = "" if r.has("precision") else f"LitGPT's default for training ({DEFAULT_PRECISION})"
    r.set("precision", "dtype", dtype, how)
    r.set("precision", "precision", precision, "weights kept in fp32, autocast" if precision == "amp" else
          "weights kept in the compute dtype")


def model_type(model: str) -> str:
    """The ``model_type`` of ``model``'s config.json (a folder here, or a Hub id in the local cache), "" when it
    cannot be read (the plan then names what is missing)."""
    import json

    path = Path(model) / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(model, "config.json")
        except Exception:  # not a Hub id: the plan says the model is not found
            return ""
        if not isinstance(found, str):
            return ""
        path = Path(found)
    try:
        return str(json.loads(path.read_text(encoding="utf-8")).get("model_type", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def _adapters(r: Reader) -> None:
    values = {k: r.value(k, default) for k, default in LORA_DEFAULTS.items()}
    family = FAMILY_TARGETS.get(model_type(str(r.settings.get("model", ""))), LORA_TARGETS)
    targets = list(dict.fromkeys(m for k, modules in family.items() if values[k] for m in modules))
    if all(values[k] for k in LORA_TARGETS):  # every linear of the blocks: whatever the family names them
        targets = ["all-linear"]
    if values["lora_head"]:
        targets.append("lm_head")
    if not targets:
        raise r.refuse("lora_query", "every lora_query ... lora_mlp switch is off: no layer would get an adapter")
    quantize = r.value("quantize")
    if quantize is not None and quantize not in QUANTIZE:
        raise r.refuse("quantize", f"{quantize!r}: the planner models 4-bit bases (bnb.nf4, bnb.nf4-dq, bnb.fp4, "
                                   "bnb.fp4-dq) only")
    r.settings["mode"] = "qlora" if quantize else "lora"
    r.settings["lora_dtype"] = "model"  # LitGPT's LoRA parameters are in the model's dtype (bf16-true: bf16)
    for key, dest in (("lora_r", "lora_r"), ("lora_alpha", "lora_alpha"), ("lora_dropout", "lora_dropout")):
        r.set(key, dest, (float if key == "lora_dropout" else int)(values[key]),
              "" if r.has(key) else "finetune_lora's default")
    r.settings["lora_targets"] = ",".join(targets)
    for key, modules in family.items():
        if r.has(key):
            fused = len(modules) == 1 and modules[0] not in ("q_proj", "k_proj", "v_proj")
            r.used[key] = f"on: lora_targets gets {', '.join(modules)}" + (
                "" if key not in FUSED else " (its part of LitGPT's fused qkv linear: one adapter over the whole fused "
                "projection here, an upper bound)" if fused else " (a part of LitGPT's fused qkv linear: the same "
                "adapter shapes)") if values[key] else "off"
    if r.has("lora_head"):
        r.used["lora_head"] = "on: lora_targets gets lm_head (an adapter on the output head)" if values["lora_head"] \
            else "off"
    if quantize:
        kind, double = QUANTIZE[str(quantize)]
        r.set("quantize", "qlora_quant_type", kind)
        r.set("quantize", "qlora_double_quant", double)
        r.settings["precision"] = "pure"  # a 4-bit base has no fp32 master copy (and LitGPT refuses *-mixed with it)
        r.settings["optimizer"] = "paged_adamw_32bit"  # instantiate_bnb_optimizer: whatever the config names
        r.also("quantize", "; optimizer = 'paged_adamw_32bit' (LitGPT replaces the optimizer by bitsandbytes' "
                               "PagedAdamW with a quantised base: utils.py instantiate_bnb_optimizer)")


def _optimizer(r: Reader) -> None:
    name = r.value("optimizer.class_path", r.value("optimizer", "AdamW"))
    found = named("litgpt", name) if isinstance(name, str) else None
    if found is None:
        r.refuse_unless_given("optimizer", f"{name!r} is not one the planner models; use one of "
                                           f"{', '.join(known_names('litgpt'))}", "optimizer")
        return
    key = "optimizer.class_path" if r.has("optimizer.class_path") else "optimizer"
    r.set(key, "optimizer", found.name, name if r.has(key) else "LitGPT's default AdamW")
    r.take("optimizer.init_args.lr", "learning_rate", float)
    r.take("train.learning_rate", "learning_rate", float)
    for leaf in [k for k in r.leaves if k.startswith("optimizer.init_args.") and k != "optimizer.init_args.lr"]:
        r.ignore(leaf, "an optimizer argument: moves no memory")


def _placement(r: Reader) -> None:
    ranks = _ranks(r)
    r.settings["attn_implementation"] = "sdpa"  # LitGPT's CausalSelfAttention calls scaled_dot_product_attention
    if r.has("num_nodes"):
        r.used["num_nodes"] = f"{r.value('num_nodes')} node(s): {ranks} rank(s) in all"
    if ranks == 1:
        r.settings["gradient_checkpointing"] = False
        if r.has("devices"):
            r.used["devices"] = "gradient_checkpointing = False (one device: no activation checkpointing)"
        return
    if r.value("quantize"):
        raise r.refuse("quantize", "LitGPT refuses quantization on more than one device; set devices: 1")
    r.set("devices", "strategy", "zero3", f"{ranks} ranks: LitGPT shards the model (FSDP)")
    r.set("devices", "gradient_checkpointing", True, "LitGPT checkpoints every Block's activations when sharded")


FORMAT = Format("litgpt", detect, read, positional="checkpoint_dir", out_keys=("out_dir",))
