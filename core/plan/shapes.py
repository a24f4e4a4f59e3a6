"""Parameter shapes of Llama-family models straight from config.json: the planner's fast path.

Building a model on the meta device (:func:`core.plan.meta.build_meta_model`) is the reference for parameter shapes, and it
needs torch and transformers' modelling code: about 4 s of imports in a fresh process, for a plan that takes 0.2 s
once they are loaded (benchmarks/plan_speed.py). For the decoder-only families whose layout is fixed and small —
``llama``, ``mistral``, ``qwen2`` (embeddings; per layer q/k/v/o projections, gate/up/down MLP, two RMSNorms; a final
norm; the LM head unless tied) — this module writes the same summary from the config's numbers without importing
either, and :func:`core.plan.meta.meta_summary` uses it when :func:`fast_config` accepts the config.

It accepts only configs that state every number that decides a shape (no library default is guessed), carry no
quantization, and LoRA targets among those seven projections; anything else goes to the meta build. Equality with
the meta build (every count, dtype group, shape, adapter and parameter placement) is a test over the planner cases,
the embedded model and variants (tests/unit/test_shapes.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from core.dtypes import Dtype
from core.methods import method_of
from core.spec import ALL_LINEAR, Mode

#: Families and their bias rules: (q/k/v bias, o bias, MLP bias) from the config, or fixed.
FAMILIES = ("llama", "mistral", "qwen2")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
             "tie_word_embeddings")


@dataclass(frozen=True)
class FastConfig:
    """A config.json of a supported family, as read (``raw``), with the attributes the planner reads.

    Attributes mirror ``transformers.PretrainedConfig``'s names; :meth:`to_transformers` gives the library's config
    when a model must really be built (the traced plan, the probe).
    """

    raw: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        raw = object.__getattribute__(self, "raw")
        if name == "num_key_value_heads":
            return raw.get("num_key_value_heads") or raw["num_attention_heads"]
        if name == "head_dim":
            return raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
        if name == "_attn_implementation":
            return raw.get("_attn_implementation") or raw.get("attn_implementation")
        if name in raw:
            return raw[name]
        raise AttributeError(name)

    def to_json_string(self, use_diff: bool = False) -> str:
        return json.dumps(self.raw, sort_keys=True)

    def to_transformers(self) -> Any:
        """The same config as a ``transformers.PretrainedConfig`` (imports transformers)."""
        from transformers import AutoConfig

        values = dict(self.raw)
        return AutoConfig.for_model(values.pop("model_type"), **values)


def fast_config(raw: dict[str, Any]) -> FastConfig | None:
    """``raw`` as a :class:`FastConfig` when its shapes can be written without the library, else None."""
    if raw.get("model_type") not in FAMILIES or "quantization_config" in raw:
        return None
    if any(not isinstance(raw.get(k), (int, bool)) for k in _REQUIRED):
        return None
    if raw["model_type"] == "llama" and not all(isinstance(raw.get(k, False), bool)
                                                 for k in ("attention_bias", "mlp_bias")):
        return None
    return FastConfig(dict(raw))


def lora_supported(targets: tuple[str, ...]) -> bool:
    """LoRA on these targets can be summarised here (the seven projections, or peft's ``all-linear``: the seven
    projections, as peft resolves it for these families: every linear layer but the LM head)."""
    return targets == (ALL_LINEAR,) or (bool(targets) and all(t in PROJECTIONS for t in targets))


def parameters(config: FastConfig, mode: Mode, lora: Any, dtype: Dtype | None) -> list[dict[str, Any]]:
    """Every parameter of the model as it runs, in ``Module.named_modules()`` order (tied once), each as a dict:
    ``module`` (its module's short name), ``layer`` (index or None), ``shape``, ``dtype``, ``trainable``, ``kind``
    (``embedding`` | ``linear`` | ``lora`` | ``other``), and for a LoRA A matrix ``adapter_in`` (the adapted layer's
    input width). ``dtype`` is the base parameters' (default fp32); LoRA adapters are fp32 (peft's default)."""
    c = config
    h, i, L, V = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
    a, kv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    family = c.model_type
    qkv_bias = True if family == "qwen2" else bool(c.raw.get("attention_bias", False)) if family == "llama" else False
    o_bias = bool(c.raw.get("attention_bias", False)) if family == "llama" else False
    mlp_bias = bool(c.raw.get("mlp_bias", False)) if family == "llama" else False
    base = dtype or "fp32"
    method = method_of(mode)
    train_base = method.trains_base
    targets = (set(PROJECTIONS) if lora.targets == (ALL_LINEAR,) else set(lora.targets)) if method.adapters else set()
    out: list[dict[str, Any]] = []

    def param(module: str, layer: int | None, shape: tuple[int, ...], kind: str, trainable: bool,
              dt: str = base, **extra: Any) -> None:
        out.append(dict(module=module, layer=layer, shape=shape, dtype=dt, trainable=trainable, kind=kind, **extra))

    def linear(name: str, layer: int, fan_in: int, fan_out: int, bias: bool) -> None:
        param(name, layer, (fan_out, fan_in), "linear", train_base)
        if bias:
            param(name, layer, (fan_out,), "linear", train_base)
        if name in targets:
            adapter = "fp32" if getattr(lora, "dtype", "fp32") == "fp32" else base
            param(name, layer, (lora.r, fan_in), "adapter", True, adapter, adapter_in=fan_in)
            param(name, layer, (fan_out, lora.r), "adapter", True, adapter)

    param("embed_tokens", None, (V, h), "embedding", train_base)
    for layer in range(L):
        linear("q_proj", layer, h, a * hd, qkv_bias)
        linear("k_proj", layer, h, kv * hd, qkv_bias)
        linear("v_proj", layer, h, kv * hd, qkv_bias)
        linear("o_proj", layer, a * hd, h, o_bias)
        linear("gate_proj", layer, h, i, mlp_bias)
        linear("up_proj", layer, h, i, mlp_bias)
        linear("down_proj", layer, i, h, mlp_bias)
        param("input_layernorm", layer, (h,), "other", train_base)
        param("post_attention_layernorm", layer, (h,), "other", train_base)
    param("norm", None, (h,), "other", train_base)
    if not c.tie_word_embeddings:
        param("lm_head", None, (V, h), "linear", train_base)
    return out

