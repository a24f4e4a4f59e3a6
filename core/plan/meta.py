"""The meta model and what the plan reads from it: parameter counts, dtypes, shapes and the LoRA adapters.

The model is built on the meta device from its config (:func:`build_meta_model`: shapes and dtypes only, no weights read
or allocated); a Llama-family config.json is summarised from its numbers instead (core/plan/shapes.py, equal to the meta
build in tests), with no import of torch or transformers. :func:`meta_summary` makes a :class:`ModelSummary` once per
process for each config, mode, LoRA settings and parameter dtype: the counts (:class:`ParameterCount`), each parameter
and where it lives (:class:`ParamInfo`), each LoRA-wrapped module (:class:`AdapterInfo`). :class:`ModelShape` holds the
config's sizes the formulas use (:func:`model_shape`).

The plan (:mod:`core.plan.memory`) reads these; so do the component lines (:mod:`core.plan.lines`), the strategies that
place the model (:mod:`core.plan.strategies`) and QLoRA's 4-bit base (:mod:`core.plan.quant`). Nothing here imports
torch, transformers or peft at module import; functions import them when called.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import warnings
from dataclasses import dataclass
from typing import Any, cast

from core.dtypes import Dtype, dtype_bytes, dtype_name, torch_dtype_name
from core.errors import SpecError
from core.methods import method_of
from core.methods.lora import lora_config
from core.spec import Mode
from core.spectables import LoraSettings

#: Short names of the gate projection of a gated MLP (SwiGLU, GeGLU): the MLP keeps four I-wide tensors, not two.
GATED_MLP_NAMES = frozenset({"gate_proj", "gate_up_proj", "w1", "w3", "wi_0", "fc_gate"})
#: A decoder layer's index in a parameter's or module's dotted name (``model.layers.3.mlp``)
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class ParameterCount:
    """Parameter counts of the model as it runs.

    Attributes:
        total: every parameter, LM head included, tied weights counted once, LoRA adapters included.
        trainable: parameters that receive gradients (all for full fine-tuning, the adapters for LoRA, 0 for inference).
    """

    total: int
    trainable: int


@dataclass(frozen=True)
class ModelShape:
    """Config sizes the formulas use: hidden h, layers L, heads a, KV heads, head_dim, vocabulary V, MLP width, tied
    embeddings, the attention implementation, the model family and the linear layers with a bias."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    attention: str  # the spec's attention implementation (sdpa, eager, flash_attention_2)
    inter: int = 0
    tied: bool = False
    family: str = ""
    biases: frozenset[str] = frozenset()
    gated: bool = False  # a gated MLP (gate_proj ...), known from the model's linear modules
    activation: str = ""  # the config's hidden_act / activation_function

    @classmethod
    def of(cls, config: Any, attention: str = "sdpa") -> ModelShape:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        hidden = int(text.hidden_size)
        heads = int(text.num_attention_heads)
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or hidden // heads
        family = str(getattr(text, "model_type", "") or "")
        biases: set[str] = set()
        if family == "qwen2":
            biases |= {"q_proj", "k_proj", "v_proj"}
        if getattr(text, "attention_bias", False) is True:
            biases |= {"q_proj", "k_proj", "v_proj", "o_proj"}
        if getattr(text, "mlp_bias", False) is True:
            biases |= {"gate_proj", "up_proj", "down_proj"}
        activation = getattr(text, "hidden_act", None) or getattr(text, "activation_function", None) or ""
        return cls(hidden, int(text.num_hidden_layers), heads, int(kv_heads), int(head_dim), int(text.vocab_size),
                   attention, int(getattr(text, "intermediate_size", None) or 4 * hidden),
                   bool(getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False))),
                   family, frozenset(biases), activation=str(activation))

    @property
    def materialises_scores(self) -> bool:
        """True when attention keeps the a·s·s score matrices (eager); SDPA/flash kernels do not."""
        return self.attention == "eager"


@dataclass(frozen=True)
class AdapterInfo:
    """One LoRA-wrapped module: its input width, rank, adapter bytes per element, the layer it is in and its short
    name (``q_proj`` ...)."""

    in_features: int
    r: int
    element_bytes: int
    layer: str | None
    module: str = ""


@dataclass(frozen=True)
class ParamInfo:
    """One parameter (tied ones once) and where it lives, for the strategies that split the model.

    Attributes:
        unit: ``"embeddings"`` (token/position embeddings), ``"layer"`` (inside decoder layer ``layer``) or ``"head"``
            (everything else: the final norm, the LM head).
        layer: the decoder layer index, or ``None`` outside the layers.
        numel: elements.
        dtype: dtype name (``fp32``, ``bf16`` ...).
        trainable: receives a gradient.
        shape: its shape.
        kind: ``"linear"`` (a weight or bias of ``nn.Linear`` / GPT-2 ``Conv1D``), ``"embedding"``, ``"adapter"`` (a LoRA
            adapter) or ``"other"`` (norms ...).
    """

    unit: str
    layer: int | None
    numel: int
    dtype: str
    trainable: bool
    shape: tuple[int, ...]
    kind: str
    module: str = ""  # its module's short name (q_proj, embed_tokens ...), "" when not known


@dataclass(frozen=True)
class ModelSummary:
    """What the plan needs from the meta model."""

    count: ParameterCount
    weight_groups: dict[str, int]  # dtype name -> number of parameters
    grad_groups: dict[str, int]  # dtype name -> number of trainable parameters
    trainable_shapes: tuple[tuple[int, ...], ...]
    adapters: tuple[AdapterInfo, ...]
    params: tuple[ParamInfo, ...] = ()


def build_meta_model(config: Any, mode: Mode, lora: LoraSettings | None, dtype: Dtype | None = None,
                     attn_implementation: str | None = None) -> Any:
    """Build the model on the meta device: shapes and dtypes only, no memory, no weights read.

    Args:
        config: a ``transformers.PretrainedConfig`` (it is copied, never changed).
        mode: the method's name (core/methods/): one that trains adapters (``lora`` and its variants) wraps the model
            with peft (also on the meta device), with the variant's ``peft_options`` (DoRA's magnitude vectors).
        lora: LoRA settings; required for ``lora``, ignored otherwise. Targets ``("all-linear",)`` are passed to peft
            as its keyword (every linear layer but the output layer).
        dtype: ``fp32`` | ``bf16`` | ``fp16`` for the base parameters (default: the config's own default, fp32).
        attn_implementation: passed to ``from_config`` (``sdpa``, ``eager``); None: the library's choice.

    Returns:
        ``AutoModelForCausalLM.from_config(config)`` built under ``torch.device("meta")``; for ``lora`` the peft model
        (adapters fp32, as peft's ``autocast_adapter_dtype`` default makes them).

    Raises:
        SpecError: the config is not a causal language model, or ``lora`` is missing in LoRA mode.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from core.plan.shapes import FastConfig

    if isinstance(config, FastConfig):
        config = config.to_transformers()
    config = copy.deepcopy(config)  # from_config writes _attn_implementation into the config
    kwargs: dict[str, Any] = {}
    if dtype is not None:
        kwargs["dtype"] = getattr(torch, torch_dtype_name(dtype))
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation chatter from transformers/peft internals
        with torch.device("meta"):
            try:
                model = AutoModelForCausalLM.from_config(config, **kwargs)
            except ValueError as exc:
                model_type = getattr(config, "model_type", "?")
                raise SpecError("model", f"{model_type!r} is not a causal language model; gpuaccept plans causal LMs ({exc})") from None
            if method_of(mode).adapters:
                if lora is None:
                    raise SpecError("lora", "LoRA mode needs LoRA settings (r, alpha, dropout, targets)")
                from peft import get_peft_model

                in_model = getattr(lora, "dtype", "fp32") == "model"
                model = get_peft_model(model, lora_config(lora, method_of(mode).peft_options),
                                       autocast_adapter_dtype=not in_model)
                if in_model and dtype is not None:  # the adapters in the base's dtype (torchtune's, LitGPT's)
                    for name, param in model.named_parameters():
                        if "lora_" in name:
                            param.data = param.data.to(getattr(torch, torch_dtype_name(dtype)))
    return model


#: Meta-model summaries already made in this process, by (config JSON, mode, LoRA settings, parameter dtype): the
#: wizard re-plans on every batch or sequence change and the summary does not depend on either (benchmarks/plan_speed.py).
_SUMMARIES: dict[tuple[Any, ...], ModelSummary] = {}
_LINEAR_NAMES: dict[str, frozenset[str]] = {}
_CACHE_SIZE = 16


def _config_key(config: Any) -> str:
    return cast(str, config.to_json_string(use_diff=False))  # a transformers PretrainedConfig


def untied(config: Any) -> Any:
    """``config`` with the LM head apart from the embedding (``tie_word_embeddings`` false): what LitGPT builds from a
    checkpoint whose model ties them (its conversion copies the embedding into the head)."""
    from core.plan.shapes import FastConfig

    if isinstance(config, FastConfig):
        return FastConfig({**config.raw, "tie_word_embeddings": False})
    config = copy.deepcopy(config)
    config.tie_word_embeddings = False
    if hasattr(config, "get_text_config") and config.get_text_config() is not config:
        config.get_text_config().tie_word_embeddings = False
    return config


def meta_summary(config: Any, mode: Mode, lora: LoraSettings | None, dtype: Dtype | None = None) -> ModelSummary:
    """What the plan needs from the meta model (counts, dtypes, shapes, adapters), built once per process for each
    (config, mode, LoRA settings, parameter dtype); see :func:`build_meta_model` for the arguments."""
    from core.plan.shapes import FastConfig, lora_supported

    method = method_of(mode)
    adapters = method.adapters
    key = (_config_key(config), mode, lora if adapters else None, dtype)
    summary = _SUMMARIES.get(key)
    if summary is None:
        # the fast path writes LoRA's parameters; a variant with peft options of its own (DoRA) is built by peft
        fast = not adapters or (lora is not None and lora_supported(lora.targets) and not method.peft_options
                                and not lora.modules_to_save)
        built = "full" if method.trained_block else mode  # BAdam: the full model, then one block trained
        if isinstance(config, FastConfig) and fast:
            summary = summary_from_shapes(config, built, lora, dtype)  # no torch, no transformers (core/plan/shapes.py)
        else:
            summary = summarise_model(build_meta_model(config, built, lora, dtype), built)
        if method.trained_block:
            summary = one_block(summary)
        if len(_SUMMARIES) >= _CACHE_SIZE:
            _SUMMARIES.pop(next(iter(_SUMMARIES)))
        _SUMMARIES[key] = summary
    return summary


def count_parameters(config: Any, mode: Mode, lora: LoraSettings | None) -> ParameterCount:
    """Parameter counts from the meta model (see :class:`ParameterCount`).

    ``total`` counts each parameter once (``Module.parameters()`` skips tied duplicates), LM head included; for LoRA it
    includes the adapters and ``trainable`` is peft's own ``get_nb_trainable_parameters()``.
    """
    return meta_summary(config, mode, lora).count


def linear_module_names(config: Any) -> set[str]:
    """Short names (``q_proj``, ``down_proj``, ``lm_head`` ...) of the modules LoRA can target.

    These are ``torch.nn.Linear`` modules and transformers' GPT-2-style ``Conv1D`` (peft adapts both).
    """
    from core.plan.shapes import PROJECTIONS, FastConfig

    if isinstance(config, FastConfig):
        return {*PROJECTIONS, "lm_head"}  # the LM head is a Linear even when tied
    key = _config_key(config)
    if key not in _LINEAR_NAMES:
        model = build_meta_model(config, "full", None)
        _LINEAR_NAMES[key] = frozenset(
            name.rsplit(".", 1)[-1] for name, module in model.named_modules() if name and _is_linear(module))
    return set(_LINEAR_NAMES[key])


def _is_linear(module: Any) -> bool:
    import torch

    if isinstance(module, torch.nn.Linear):
        return True
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers")


def model_shape(config: Any, attention: str = "sdpa") -> ModelShape:
    """The config's sizes (:meth:`ModelShape.of`), with a gated MLP known from the model's linear modules
    (:data:`GATED_MLP_NAMES`, :func:`linear_module_names`)."""
    shape = ModelShape.of(config, attention)
    return dataclasses.replace(shape, gated=bool(linear_module_names(config) & GATED_MLP_NAMES))


def summarise_model(model: Any, mode: Mode) -> ModelSummary:
    """The :class:`ModelSummary` of a model built by :func:`build_meta_model` for ``mode`` (each parameter once)."""
    trains = method_of(mode).trains
    weight_groups: dict[str, int] = {}
    grad_groups: dict[str, int] = {}
    shapes: list[tuple[int, ...]] = []
    total = 0
    for param in model.parameters():  # tied parameters appear once
        n = param.numel()
        total += n
        name = dtype_name(param.dtype)
        weight_groups[name] = weight_groups.get(name, 0) + n
        if trains and param.requires_grad:
            grad_groups[name] = grad_groups.get(name, 0) + n
            shapes.append(tuple(param.shape))
    trainable = sum(grad_groups.values())
    adapters: list[AdapterInfo] = []
    if method_of(mode).adapters:
        trainable = int(model.get_nb_trainable_parameters()[0])
        for name, module in model.named_modules():
            lora_a = getattr(module, "lora_A", None)
            if lora_a is None or not hasattr(lora_a, "items") or not len(lora_a):
                continue
            for adapter in lora_a.values():
                weight = adapter.weight  # (r, in_features)
                match = _LAYER_INDEX.search(name)
                adapters.append(
                    AdapterInfo(
                        in_features=int(weight.shape[1]),
                        r=int(weight.shape[0]),
                        element_bytes=weight.element_size(),
                        layer=match.group(1) if match else None,
                        module=name.rsplit(".", 1)[-1],
                    )
                )
    return ModelSummary(ParameterCount(total, trainable), weight_groups, grad_groups, tuple(shapes), tuple(adapters),
                        _params(model, mode))


def one_block(summary: ModelSummary) -> ModelSummary:
    """BAdam's model (``BlockOptimizer``, layer mode: one block per decoder layer; the embeddings, the final norm and
    the LM head in none): every parameter frozen but one decoder layer's, the largest, and an fp32 copy of that layer
    (BAdam's ``param_hp``, which the base optimizer steps) as the trained tensors: their gradients and states are
    fp32. The count is the model's; its trainable parameters the active layer's."""
    sizes: dict[int, int] = {}
    for p in summary.params:
        if p.layer is not None:
            sizes[p.layer] = sizes.get(p.layer, 0) + p.numel
    active = max(sizes, key=lambda layer: sizes[layer], default=None)
    frozen = tuple(dataclasses.replace(p, trainable=False) for p in summary.params)
    copies = tuple(dataclasses.replace(p, dtype="fp32", trainable=True) for p in summary.params if p.layer == active)
    weight_groups = dict(summary.weight_groups)
    grad_groups = {"fp32": sum(p.numel for p in copies)}
    weight_groups["fp32"] = weight_groups.get("fp32", 0) + grad_groups["fp32"]
    count = ParameterCount(summary.count.total, grad_groups["fp32"])
    return ModelSummary(count, weight_groups, grad_groups, tuple(p.shape for p in copies), (), frozen + copies)


def summary_from_shapes(config: Any, mode: Mode, lora: LoraSettings | None, dtype: Dtype | None) -> ModelSummary:
    """The :class:`ModelSummary` :func:`summarise_model` makes from the meta model, written from
    :func:`core.plan.shapes.parameters` (Llama family; equal to the meta build's, tests/unit/test_shapes.py)."""
    from core.plan.shapes import parameters

    weight_groups: dict[str, int] = {}
    grad_groups: dict[str, int] = {}
    shapes: list[tuple[int, ...]] = []
    adapters: list[AdapterInfo] = []
    params: list[ParamInfo] = []
    total = 0
    trains = method_of(mode).trains
    for p in parameters(config, mode, lora, dtype):
        n = math.prod(p["shape"])
        total += n
        weight_groups[p["dtype"]] = weight_groups.get(p["dtype"], 0) + n
        trainable = trains and p["trainable"]
        if trainable:
            grad_groups[p["dtype"]] = grad_groups.get(p["dtype"], 0) + n
            shapes.append(p["shape"])
        if "adapter_in" in p:
            adapters.append(AdapterInfo(p["adapter_in"], p["shape"][0], dtype_bytes(p["dtype"]),
                                        None if p["layer"] is None else str(p["layer"]), p["module"]))
        layer = p["layer"]
        unit = "layer" if layer is not None else ("embeddings" if p["kind"] == "embedding" else "head")
        params.append(ParamInfo(unit, layer, n, p["dtype"], trainable, p["shape"], p["kind"], p["module"]))
    return ModelSummary(ParameterCount(total, sum(grad_groups.values())), weight_groups, grad_groups, tuple(shapes),
                        tuple(adapters), tuple(params))


def _params(model: Any, mode: Mode) -> tuple[ParamInfo, ...]:
    """Every parameter once (the first module that registers a tied one owns it), in module order, with its place."""
    trains = method_of(mode).trains
    import torch

    seen: set[int] = set()
    out: list[ParamInfo] = []
    for module_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            full = f"{module_name}.{pname}"
            match = _LAYER_INDEX.search(full)
            if "lora_" in module_name:
                kind = "adapter"
            elif isinstance(module, torch.nn.Embedding):
                kind = "embedding"
            elif _is_linear(module):
                kind = "linear"
            else:
                kind = "other"
            if match:
                unit, layer = "layer", int(match.group(1))
            else:
                unit, layer = ("embeddings" if kind == "embedding" else "head"), None
            short = next((part for part in reversed(module_name.split("."))
                          if part and not part.isdigit() and part not in ("default", "lora_A", "lora_B", "base_layer",
                                                                          "modules_to_save", "original_module")),
                         module_name)
            out.append(ParamInfo(unit, layer, param.numel(), dtype_name(param.dtype),
                                 trains and bool(param.requires_grad), tuple(param.shape), kind, short))
    return tuple(out)
