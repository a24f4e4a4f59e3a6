"""The analytic memory plan: bytes per device, per component and per phase of the step, before anything runs.

The model is built on the meta device from its config (no weights are read or allocated), so a 70B model plans in well
under a second on a laptop once torch and transformers are imported; a Llama-family config.json is summarised from its
numbers instead (core/plan/shapes.py, equal to the meta build in tests), with no import of either. Parameter counts and
shapes come from that meta model; everything else is a formula of the spec (batch ``b``, sequence ``s``, dtypes) and
the config (hidden ``h``, layers ``L``, heads ``a``, vocabulary ``V``). Every :class:`Line` carries the formula it
used, so a reader can check each number.

Accounting convention (also in :attr:`MemoryPlan.convention`, shown on screen and written to the record; docs/plan.md):

- precision (``spec.precision``): ``pure`` keeps the parameters in the dtype (a 16-bit model: weights, gradients and
  AdamW moments 2 B each; LoRA adapters fp32, as peft's ``autocast_adapter_dtype`` keeps them); ``amp`` keeps fp32
  parameters, gradients and optimizer states and runs forward and backward under autocast (Trainer's ``bf16=True`` on
  an fp32 model; 16 B per parameter with AdamW, as in ZeRO, arXiv 1910.02054);
- weights: every parameter (LM head included, tied weights once) in its dtype;
- gradients: trainable parameters x bytes of their own dtype; inference has none;
- optimizer states: in the dtype each optimizer creates them (:func:`_optimizer_states`; bitsandbytes' 8-bit AdamW:
  :mod:`core.plan.quant`);
- activations (saved for backward): op by op for the Llama family (:mod:`core.plan.activations`), Korthikanti et al. 2022
  (arXiv 2205.05198) otherwise; the loss's logits; under amp the 16-bit weight copies autocast keeps;
- temporaries: the loss's gradients at the start of backward, the optimizer step's buffers (:func:`_step_temporaries`);
  one layer's working set for inference;
- overhead: a line of its own (never hidden in another): the CUDA context and cuBLAS workspace on a CUDA device, the
  process's runtime (Python, torch, the libraries) on the CPU (:data:`OVERHEAD_NAMES`);
- kv_cache: inference only.

The total of a device is the peak of the step: the largest of its phases (:mod:`core.plan.phases`: forward, backward,
optimizer step), each holding the components alive at its own peak; a line is its component's largest value over the
phases.

Per device, by strategy (:func:`plan_memory`; the rule is appended to the convention of a plan made for it): single
(each device holds the whole run), ddp (full replica + gradient buckets; PyTorch DDP docs), zero1/zero2/zero3 (ZeRO,
arXiv 1910.02054; zero3 = FSDP full shard: model states ÷ N, activations not divided), device_map (whole layers in order,
as accelerate's ``infer_auto_device_map``), tp (Megatron-LM, arXiv 1909.08053: linear layers ÷ tp). Devices can be a
box you do not have (``8x80GiB``, ``24GiB,8GiB``): :func:`detect_devices` builds them without asking torch.

Nothing here imports torch, transformers or peft at module import; functions import them when called.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, cast

from core.dtypes import Dtype, dtype_bytes, dtype_name, torch_dtype_name
from core.errors import SpecError
from core.methods import method_of
from core.methods.lora import lora_config
from core.plan.activations import LLAMA_FAMILY, Adapter, Dims, Numerics, StepActivations, step_activations
from core.plan.devices import DeviceInfo
from core.plan.fit import fits_in
from core.plan.phases import Phase, StepTerms, inference_moments, peak, phases_of, training_moments
from core.plan.quant import (
    adamw_8bit_is_8bit,
    adamw_8bit_maps_bytes,
    adamw_8bit_state_bytes,
    adamw_8bit_step_temporaries,
    dequantised_bytes,
    quantised_4bit,
)
from core.spec import (
    EIGHT_BIT_OPTIMIZERS,
    TORCHRUN_STRATEGIES,
    LoraSettings,
    Mode,
    RunSpec,
    Strategy,
    check_strategy,
)

COMPONENTS = ("weights", "gradients", "optimizer_states", "activations", "temporaries", "overhead", "kv_cache")

#: Per-process, per-device CUDA context + cuBLAS workspace estimate (docs/architecture.md §3: 300-700 MB; lazy module loading).
CUDA_OVERHEAD_BYTES = 500 * 2**20
#: Per-process memory of a CPU run beyond its tensors: the Python, torch and transformers runtime and the allocator's free
#: memory, an estimate (measured here: the probe's peak RSS 0.44-0.59 GiB above its peak of live tensors on the embedded
#: model, LoRA and full fine-tuning, fp32 and bf16). The CPU fit counts it, as the probe's RSS does.
CPU_RUNTIME_BYTES = 640 * 2**20
#: Per-process, per-device NCCL communicator buffers, an estimate (not measured here): NCCL allocates NCCL_BUFFSIZE
#: (4 MiB by default) per channel, per peer and per protocol, so it grows with channels and peers; a few hundred MiB
#: per GPU is common. Added to the overhead line of every strategy that runs collectives on N >= 2 devices.
NCCL_BUFFER_BYTES = 256 * 2**20
#: PyTorch DDP's default bucket size (``bucket_cap_mb=25``), in bytes; quoted in the DDP bucket method text.
DDP_BUCKET_CAP_BYTES = 25 * 2**20
#: ZeRO-3 / FSDP: gathered (unsharded) units alive at once: the one computing and the next one, prefetched (FSDP's
#: default ``backward_prefetch=BACKWARD_PRE`` all-gathers the next unit before the current one's gradient is computed;
#: DeepSpeed ZeRO-3 prefetches by ``stage3_prefetch_bucket_size``). An estimate of the planner, stated in the method.
ZERO3_GATHERED_UNITS = 2
#: Bytes per logit element: transformers' causal-LM loss upcasts logits to fp32.
LOGITS_BYTES = 4
#: Korthikanti et al. 2022, eq. (1): bytes per token per hidden unit of one transformer layer in 16-bit, without the
#: attention-score term 5·a·s/h (which is kept only when the attention implementation materialises the scores).
KORTHIKANTI_SBH_BYTES_16BIT = 34
#: Of those 34, the MLP's (a plain 4h MLP with GeLU and dropout): its input 2, GeLU's input 8, the second linear's input
#: 8, the dropout mask 1; the rest is attention (11) and the two layer norms (4).
KORTHIKANTI_MLP_UNITS = 19

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


# ---------------------------------------------------------------------------------------------------------- data types
#: What the ``overhead`` line is on each kind of device, for people: (short, words). The record's key stays
#: ``overhead`` on both: on CUDA the CUDA context and cuBLAS workspace; on the CPU no CUDA context, the process's
#: runtime (Python, torch and the libraries, the allocator's free memory).
OVERHEAD_NAMES: dict[str, tuple[str, str]] = {"cuda": ("CTX", "CUDA context"), "cpu": ("RT", "process runtime")}


def overhead_name(kind: str) -> tuple[str, str]:
    """(short, words) for the ``overhead`` line on a device of ``kind`` (``cpu`` or ``cuda``)."""
    return OVERHEAD_NAMES.get(kind, OVERHEAD_NAMES["cuda"])


def component_label(name: str, kind: str = "cuda") -> str:
    """A component's name for a table row on a device of ``kind``: its record key, but the ``overhead`` line named
    for what it is there: ``CUDA context`` on CUDA, ``runtime overhead`` on the CPU (never "CUDA context")."""
    if name == "overhead":
        return "CUDA context" if kind == "cuda" else "runtime overhead"
    return name


@dataclass(frozen=True)
class Line:
    """One component of a device plan.

    Attributes:
        component: one of :data:`COMPONENTS`.
        bytes: the estimate, in bytes (0 where the component does not apply).
        method: one line saying how it was estimated (the formula with its numbers), or why it is 0.
    """

    component: str
    bytes: int
    method: str


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
class DevicePlan:
    """What one device must hold: a :class:`Line` for every name in :data:`COMPONENTS` (each component's largest value
    over the phases) and the phases of the step (:mod:`core.plan.phases`)."""

    device: DeviceInfo
    lines: dict[str, Line]
    phases: dict[str, Phase] = field(default_factory=dict)
    #: bytes of this plan a traced step cannot see: the overhead line and DDP's gradient buckets
    untraced_bytes: int = 0

    @property
    def peak_phase(self) -> Phase | None:
        """The phase with the most bytes alive (None for a plan made without phases)."""
        return peak(self.phases) if self.phases else None

    @property
    def total_bytes(self) -> int:
        """The peak of the step, in bytes: the largest phase (components alive together), never the sum of each
        component's own maximum, which no moment holds; a plan without phases sums its lines."""
        p = self.peak_phase
        return p.total_bytes if p is not None else self.sum_of_lines

    @property
    def sum_of_lines(self) -> int:
        """The sum of every component's largest value: an upper bound of this plan's phases, reached by none."""
        return sum(line.bytes for line in self.lines.values())

    @property
    def fits(self) -> bool | None:
        """``total_bytes <= capacity_bytes`` on this device alone (:func:`core.plan.fit.fits_in`); ``None`` when the
        capacity is unknown.

        Fit is judged per device: memory of other devices never counts (case P5). The traced plan can raise the bytes
        the fit is judged by (:func:`core.plan.fit.fit_verdicts`).
        """
        return fits_in(self.total_bytes, self.device.capacity_bytes)


@dataclass(frozen=True)
class QuantisedBase:
    """QLoRA's weights, part by part (bytes; :mod:`core.plan.quant` for each layout and its source).

    Attributes:
        quant_type: ``nf4`` or ``fp4``; double_quant: whether the absmax constants are quantised too.
        layers: the linear layers stored in 4 bits (every decoder linear; not the embeddings, norms or LM head).
        quantised_parameters: their elements.
        packed_bytes: the packed 4-bit weights, 0.5 B per element.
        constants_bytes: their per-block absmax constants and code tables.
        unquantised_bytes: every other base parameter (embeddings, norms, LM head, biases) in its dtype.
        adapter_bytes: the LoRA adapters (fp32).
        dequantised_bytes: the largest layer's weight dequantised to the compute dtype as it runs (a temporary).
    """

    quant_type: str
    double_quant: bool
    layers: int
    quantised_parameters: int
    packed_bytes: int
    constants_bytes: int
    unquantised_bytes: int
    adapter_bytes: int
    dequantised_bytes: int

    @property
    def quantised_bytes(self) -> int:
        """The 4-bit weights as stored: packed weights and their constants."""
        return self.packed_bytes + self.constants_bytes

    @property
    def weights_bytes(self) -> int:
        """Every weight the model holds: the 4-bit ones, the rest in their dtype, and the adapters."""
        return self.quantised_bytes + self.unquantised_bytes + self.adapter_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """The analytic plan of a run.

    Attributes:
        parameters: parameter counts of the model as it runs.
        devices: one plan per device.
        strategy: how the run is spread over devices (:data:`core.spec.STRATEGIES`); ``"single"``: each device holds
            the whole run; ``ddp``, ``zero1``/``zero2``/``zero3``, ``device_map``, ``tp``: see :func:`plan_memory`.
        convention: one paragraph stating the accounting convention (with the strategy's rule appended).
        activation_model: ``"op-by-op"`` (the Llama family, :mod:`core.plan.activations`) or ``"korthikanti"`` (an
            approximation for other layers; the traced plan checks it).
    """

    parameters: ParameterCount
    devices: list[DevicePlan]
    strategy: Strategy
    convention: str
    activation_model: str = "op-by-op"
    #: QLoRA: the 4-bit base's parts (:class:`QuantisedBase`); None for every other mode
    quantised: QuantisedBase | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready mapping (bytes as ints) for ``gpuaccept plan --json`` and the record."""
        return {
            "parameters": {"total": self.parameters.total, "trainable": self.parameters.trainable},
            "strategy": self.strategy,
            "convention": self.convention,
            "activation_model": self.activation_model,
            **({"quantised": dataclasses.asdict(self.quantised)} if self.quantised is not None else {}),
            "devices": [
                {
                    "name": dp.device.name,
                    "label": dp.device.label,
                    "capacity_bytes": dp.device.capacity_bytes,
                    "capacity_source": dp.device.capacity_source,
                    "components": {name: int(dp.lines[name].bytes) for name in COMPONENTS},
                    "methods": {name: dp.lines[name].method for name in COMPONENTS},
                    "phases": {p.name: {"at": p.at, "components": {k: int(v) for k, v in p.components.items()}}
                               for p in dp.phases.values()},
                    "peak_phase": dp.peak_phase.name if dp.peak_phase else "",
                    "sum_of_components_bytes": int(dp.sum_of_lines),
                    "untraced_bytes": int(dp.untraced_bytes),
                    "total_bytes": int(dp.total_bytes),
                    "fits": dp.fits,
                }
                for dp in self.devices
            ],
        }


CONVENTION = (
    "Bytes per device, each device planned on its own (strategy 'single': every device holds the whole run); the "
    "total is the peak of the step: the largest of its phases (forward, backward, optimizer step), each holding the "
    "components alive at its own peak, not the sum of each component's maximum (shown beside it, reached by no "
    "moment). {precision}; LoRA adapters are fp32 (peft's autocast_adapter_dtype). Gradients are in each "
    "parameter's dtype; optimizer states in the dtype the optimizer makes them: AdamW 2 moments x T in the "
    "parameter's dtype, SGD with momentum one buffer, Adafactor factored fp32 row + column statistics; the "
    "optimizer step's buffers are temporaries (foreach AdamW on CUDA: one more state). Activations are op by op from "
    "the model's code for the Llama family (RMSNorm's fp32 copies, the gated MLP, the attention kernel's saved "
    "tensors, autocast's 16-bit copies), Korthikanti et al. 2022 otherwise; a frozen linear layer saves no input; "
    "the loss keeps fp32 logits and log_softmax. Inference holds weights and the KV cache, with the logits at the end of "
    "the forward or one layer's working set before it, whichever is larger. The overhead line is a separate estimate: "
    "on a CUDA device the CUDA context and cuBLAS workspace; on the CPU, which has no CUDA context, the process's "
    "runtime (Python, torch and the libraries)."
)

_SINGLE_RULE = "(strategy 'single': every device holds the whole run)"

#: The per-device rule of each strategy, appended to :data:`CONVENTION` in a plan made for that strategy.
STRATEGY_CONVENTIONS = {
    "ddp": "Strategy ddp (PyTorch DistributedDataParallel): every device holds a full replica (weights, gradients, "
           "optimizer states, activations of its own micro-batch) plus DDP's gradient bucket buffers, which cover "
           "every gradient (25 MiB buckets; gradient_as_bucket_view=False is the default and Trainer keeps it), under "
           "temporaries; NCCL buffers are added to the overhead line (estimate).",
    "zero1": "Strategy zero1 (ZeRO stage 1, Rajbhandari et al., arXiv 1910.02054): optimizer states and the optimizer "
             "step's temporaries / N per device; weights, gradients and activations are not divided; NCCL buffers in "
             "overhead (estimate).",
    "zero2": "Strategy zero2 (ZeRO stage 2, arXiv 1910.02054): optimizer states, gradients and the optimizer step's "
             "temporaries / N per device; weights and activations are not divided; NCCL buffers in overhead "
             "(estimate).",
    "zero3": "Strategy zero3 (ZeRO stage 3 = FSDP FULL_SHARD, arXiv 1910.02054; PyTorch FSDP docs): weights, gradients, "
             "optimizer states and the step's temporaries / N per device (rounded up), plus the largest gathered unit "
             "(the largest decoder layer's unsharded weights) x 2 (one computing, one prefetched) under temporaries; "
             "activations are NOT divided: each device runs its own micro-batch through every layer; NCCL buffers in "
             "overhead (estimate).",
    "device_map": "Strategy device_map (one process, layers placed in order as accelerate's infer_auto_device_map does, "
                  "decoder layers never split): embeddings on the first device, final norm + LM head (and the logits) "
                  "on the last; each device's share of the weights is proportional to its capacity (a capacity-weighted "
                  "'balanced' map; accelerate's own 'balanced' gives equal shares and 'sequential' fills device 0 "
                  "first); tied LM-head weights stay with the embedding; each device holds its layers' weights, "
                  "gradients, optimizer states, activations and KV cache. No NCCL: activations are copied between "
                  "devices.",
    "tp": "Strategy tp (Megatron-LM tensor parallel, Shoeybi et al., arXiv 1909.08053): attention projections and MLP "
          "linear layers (weights and biases) / tp; token embeddings and the LM head are vocab-parallel / tp; norms, "
          "position embeddings and LoRA adapters are replicated; activations per layer s·b·h·(10 + 24/t) (Korthikanti "
          "et al. 2022 eq. 2, no sequence parallelism; the 5·a·s/(h·t) score term only with eager attention); logits "
          "/ tp (vocab-parallel cross-entropy); KV cache / tp; devices beyond tp are data-parallel replicas holding "
          "the same; NCCL buffers in overhead (estimate).",
}


# ------------------------------------------------------------------------------------------------------- meta model
def build_meta_model(config: Any, mode: Mode, lora: LoraSettings | None, dtype: Dtype | None = None,
                     attn_implementation: str | None = None) -> Any:
    """Build the model on the meta device: shapes and dtypes only, no memory, no weights read.

    Args:
        config: a ``transformers.PretrainedConfig`` (it is copied, never changed).
        mode: ``inference`` | ``full`` | ``lora``; ``lora`` wraps the model with peft (also on the meta device).
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

                model = get_peft_model(model, lora_config(lora))
    return model


#: Meta-model summaries already made in this process, by (config JSON, mode, LoRA settings, parameter dtype): the
#: wizard re-plans on every batch or sequence change and the summary does not depend on either (benchmarks/plan_speed.py).
_SUMMARIES: dict[tuple[Any, ...], _Summary] = {}
_LINEAR_NAMES: dict[str, frozenset[str]] = {}
_CACHE_SIZE = 16


def _config_key(config: Any) -> str:
    return cast(str, config.to_json_string(use_diff=False))  # a transformers PretrainedConfig


def meta_summary(config: Any, mode: Mode, lora: LoraSettings | None, dtype: Dtype | None = None) -> _Summary:
    """What the plan needs from the meta model (counts, dtypes, shapes, adapters), built once per process for each
    (config, mode, LoRA settings, parameter dtype); see :func:`build_meta_model` for the arguments."""
    from core.plan.shapes import FastConfig, lora_supported

    adapters = method_of(mode).adapters
    key = (_config_key(config), mode, lora if adapters else None, dtype)
    summary = _SUMMARIES.get(key)
    if summary is None:
        if isinstance(config, FastConfig) and (not adapters or (lora is not None and lora_supported(lora.targets))):
            summary = _summary_from_shapes(config, mode, lora, dtype)  # no torch, no transformers (core/plan/shapes.py)
        else:
            summary = _summarise(build_meta_model(config, mode, lora, dtype), mode)
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


@dataclass(frozen=True)
class _Adapter:
    """One LoRA-wrapped module: its input width, rank, adapter bytes per element, the layer it is in and its short
    name (``q_proj`` ...)."""

    in_features: int
    r: int
    element_bytes: int
    layer: str | None
    module: str = ""


@dataclass(frozen=True)
class _Param:
    """One parameter (tied ones once) and where it lives, for the strategies that split the model.

    Attributes:
        unit: ``"embeddings"`` (token/position embeddings), ``"layer"`` (inside decoder layer ``layer``) or ``"head"``
            (everything else: the final norm, the LM head).
        layer: the decoder layer index, or ``None`` outside the layers.
        numel: elements.
        dtype: dtype name (``fp32``, ``bf16`` ...).
        trainable: receives a gradient.
        shape: its shape.
        kind: ``"linear"`` (a weight or bias of ``nn.Linear`` / GPT-2 ``Conv1D``), ``"embedding"``, ``"lora"`` (a LoRA
            adapter) or ``"other"`` (norms ...).
    """

    unit: str
    layer: int | None
    numel: int
    dtype: str
    trainable: bool
    shape: tuple[int, ...]
    kind: str


@dataclass(frozen=True)
class _Summary:
    """What the plan needs from the meta model."""

    count: ParameterCount
    weight_groups: dict[str, int]  # dtype name -> number of parameters
    grad_groups: dict[str, int]  # dtype name -> number of trainable parameters
    trainable_shapes: tuple[tuple[int, ...], ...]
    adapters: tuple[_Adapter, ...]
    params: tuple[_Param, ...] = ()


def _summarise(model: Any, mode: Mode) -> _Summary:
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
    adapters: list[_Adapter] = []
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
                    _Adapter(
                        in_features=int(weight.shape[1]),
                        r=int(weight.shape[0]),
                        element_bytes=weight.element_size(),
                        layer=match.group(1) if match else None,
                        module=name.rsplit(".", 1)[-1],
                    )
                )
    return _Summary(ParameterCount(total, trainable), weight_groups, grad_groups, tuple(shapes), tuple(adapters),
                    _params(model, mode))


def _summary_from_shapes(config: Any, mode: Mode, lora: LoraSettings | None, dtype: Dtype | None) -> _Summary:
    """The :class:`_Summary` :func:`_summarise` makes from the meta model, written from :func:`core.plan.shapes.parameters`
    (Llama family; equal to the meta build's, tests/unit/test_shapes.py)."""
    from core.plan.shapes import parameters

    weight_groups: dict[str, int] = {}
    grad_groups: dict[str, int] = {}
    shapes: list[tuple[int, ...]] = []
    adapters: list[_Adapter] = []
    params: list[_Param] = []
    total = 0
    trains = method_of(mode).trains
    for p in parameters(config, mode, lora, dtype):
        n = _numel(p["shape"])
        total += n
        weight_groups[p["dtype"]] = weight_groups.get(p["dtype"], 0) + n
        trainable = trains and p["trainable"]
        if trainable:
            grad_groups[p["dtype"]] = grad_groups.get(p["dtype"], 0) + n
            shapes.append(p["shape"])
        if "adapter_in" in p:
            adapters.append(_Adapter(p["adapter_in"], p["shape"][0], dtype_bytes(p["dtype"]),
                                     None if p["layer"] is None else str(p["layer"]), p["module"]))
        layer = p["layer"]
        unit = "layer" if layer is not None else ("embeddings" if p["kind"] == "embedding" else "head")
        params.append(_Param(unit, layer, n, p["dtype"], trainable, p["shape"], p["kind"]))
    return _Summary(ParameterCount(total, sum(grad_groups.values())), weight_groups, grad_groups, tuple(shapes),
                    tuple(adapters), tuple(params))


def _params(model: Any, mode: Mode) -> tuple[_Param, ...]:
    """Every parameter once (the first module that registers a tied one owns it), in module order, with its place."""
    trains = method_of(mode).trains
    import torch

    seen: set[int] = set()
    out: list[_Param] = []
    for module_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            full = f"{module_name}.{pname}"
            match = _LAYER_INDEX.search(full)
            if "lora_" in module_name:
                kind = "lora"
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
            out.append(_Param(unit, layer, param.numel(), dtype_name(param.dtype),
                              trains and bool(param.requires_grad), tuple(param.shape), kind))
    return tuple(out)


# ------------------------------------------------------------------------------------------------------------- plan
def plan_memory(
    spec: RunSpec, config: Any, devices: list[DeviceInfo], parameters: ParameterCount | None = None
) -> MemoryPlan:
    """Plan the memory of ``spec`` on each device, by ``spec.strategy`` (docs/architecture.md §3), phase by phase.

    Each device's plan holds the phases of the step (:mod:`core.plan.phases`: forward, backward, optimizer step; inference:
    forward) with the bytes of every component alive at each phase's peak, a :class:`Line` per component (its largest
    value over the phases, with its formula) and its total: the peak of the step, the largest phase (never the sum of
    each component's maximum, which no moment holds). Bytes per device (N = number of devices):

    - ``single``: every device is planned as if it held the whole run.
    - ``ddp`` (PyTorch DDP docs): a full replica on every device (activations of its own micro-batch), plus DDP's
      gradient bucket buffers = the gradient bytes in every phase (the reducer's flat 25 MiB buckets, allocated when
      the model is wrapped, cover every gradient while ``gradient_as_bucket_view=False``, DDP's default, kept by
      Trainer).
    - ``zero1`` / ``zero2`` / ``zero3`` (ZeRO, arXiv 1910.02054; ``zero3`` = FSDP full shard): optimizer states (and the
      optimizer step's temporaries) ÷ N; ``zero2`` also gradients ÷ N; ``zero3`` also weights ÷ N plus, in forward and
      backward, the gathered units (the largest decoder layer's unsharded weights x 2 for prefetch, and the root unit).
      Division rounds up (shards are padded to equal size). Activations are never divided (case P4).
    - ``device_map``: whole decoder layers placed in order on the devices (see :func:`_device_map`); each device holds
      its layers' weights, gradients, optimizer states, activations and KV cache; the loss on the last device.
    - ``tp`` (Megatron-LM, arXiv 1909.08053): linear layers of attention and MLP ÷ tp, embeddings and LM head
      vocab-parallel ÷ tp, the rest replicated; activations per Korthikanti et al. 2022 eq. 2; logits and KV cache ÷ tp.

    Activations: for the Llama family (:data:`core.plan.activations.LLAMA_FAMILY`) op by op from the model's own code
    (:mod:`core.plan.activations`, equal to the traced plan on its layers); for other models Korthikanti et al. 2022 eq. 1,
    an approximation for GPT-style layers, said so in the method.

    Overhead: the CUDA context line on every CUDA device; strategies that run collectives on N >= 2 devices (ddp,
    zero*, tp) add :data:`NCCL_BUFFER_BYTES` (estimate) to it; device_map runs in one process and uses none.

    Args:
        spec: the run; ``batch_size`` is the micro-batch per device (per tensor-parallel group for ``tp``).
        config: the model's ``transformers.PretrainedConfig``.
        devices: from :func:`detect_devices` (or made by hand).
        parameters: counts already computed by :func:`count_parameters` for this spec, to report as they are (by
            default the counts of the meta model built here, in the parameter dtype, once per process).

    Returns:
        a :class:`MemoryPlan` whose device plans hold a :class:`Line` for every name in :data:`COMPONENTS` and the
        phases of the step.

    Raises:
        SpecError: the strategy does not suit the number of devices (e.g. ``devices = "auto"`` found one), or ``tp``
            does not divide the model's attention or KV heads.
    """
    strategy = spec.strategy
    # N: the ranks sharing the work (every node's, for several nodes); the devices planned are this node's
    n = spec.world_size(len(devices)) if strategy in TORCHRUN_STRATEGIES else len(devices)
    check_strategy(strategy, spec.tp, n, spec.devices)
    shape = _Shape.of(config, spec.attn_implementation)
    shape = dataclasses.replace(shape, gated=bool(linear_module_names(config) & GATED_MLP_NAMES))
    if strategy == "tp":
        _check_tp_heads(spec.tp, shape)
    # precision: pure keeps the parameters in the dtype (LoRA adapters fp32), amp keeps fp32 master weights
    summary = meta_summary(config, spec.base_mode, spec.lora if spec.adapters else None, spec.param_dtype)
    counts = parameters if parameters is not None else summary.count
    quantised = quantised_base(spec, shape, summary) if spec.method.takes("quant") else None
    steps = _strategy_steps(spec, shape, summary, devices, n)
    source = _quantised_source_bytes(spec, config, quantised)
    plans = [_device_plan(device, step, tag, _overhead(device, strategy, n, first=i == 0, quantised_source=source))
             for i, (device, (step, tag)) in enumerate(zip(devices, steps))]
    model = "op-by-op" if shape.family in LLAMA_FAMILY and strategy != "tp" else "korthikanti"
    if strategy == "single":
        return MemoryPlan(counts, plans, "single", _convention(spec), model, quantised)
    convention = _convention(spec).replace(_SINGLE_RULE, f"(strategy {strategy}: see its rule at the end)")
    return MemoryPlan(counts, plans, strategy, f"{convention} {STRATEGY_CONVENTIONS[strategy]}", model, quantised)


#: the families whose decoder layers are all ``nn.Linear`` (what transformers' bitsandbytes integration quantises):
#: QLoRA is planned for these
QLORA_FAMILIES = LLAMA_FAMILY


def _is_quantised(p: _Param) -> bool:
    """A weight transformers stores in 4 bits under ``load_in_4bit``: a decoder layer's linear weight (its bias, the
    embeddings, norms and the LM head are kept: ``get_keys_to_not_convert`` keeps the output embedding)."""
    return p.kind == "linear" and p.unit == "layer" and len(p.shape) == 2


def quantised_base(spec: RunSpec, shape: _Shape, summary: _Summary) -> QuantisedBase:
    """QLoRA's weights part by part (:class:`QuantisedBase`), from each parameter of the model as it runs.

    Raises:
        SpecError: the model is not of a family whose layers this plan knows to be ``nn.Linear``.
    """
    if shape.family not in QLORA_FAMILIES:
        raise SpecError("mode", f"qlora is planned for the {', '.join(QLORA_FAMILIES)} families in this version, "
                                f"not {shape.family or 'this model'}: use mode lora, or a model of those families")
    dq = spec.qlora.double_quant
    packed = constants = unquantised = adapters = dequantised = layers = numel = 0
    for p in summary.params:
        if p.kind == "lora":
            adapters += p.numel * dtype_bytes(p.dtype)
        elif _is_quantised(p):
            q = quantised_4bit(p.numel, dq)
            packed, constants, layers, numel = packed + q.packed_bytes, constants + q.constants_bytes, layers + 1, \
                numel + p.numel
            dequantised = max(dequantised, dequantised_bytes(p.numel, spec.dtype_bytes, dq))
        else:
            unquantised += p.numel * dtype_bytes(p.dtype)
    return QuantisedBase(spec.qlora.quant_type, dq, layers, numel, packed, constants, unquantised, adapters,
                         dequantised)


def _qlora_weights(q: QuantisedBase) -> Line:
    """QLoRA's weights line: the 4-bit layers (packed and constants), the rest of the base, the adapters."""
    constants = ("uint8 absmax per block of 64 + fp32 absmax per 256 blocks + 1,024 B map + 4 B offset + 64 B code "
                 "table per layer (double quantisation)" if q.double_quant else
                 "fp32 absmax per block of 64 + 64 B code table per layer")
    return Line("weights", q.weights_bytes,
                f"QLoRA (a variant: the base stored in 4 bits): {q.layers:,} decoder linear layers in "
                f"{q.quant_type.upper()}, {q.quantised_parameters:,} parameters x 0.5 B = {q.packed_bytes:,} B packed "
                f"+ {q.constants_bytes:,} B constants ({constants}); embeddings, norms and LM head not quantised, fp32 "
                f"after peft's prepare_model_for_kbit_training {q.unquantised_bytes:,} B; LoRA adapters fp32 "
                f"{q.adapter_bytes:,} B")


def _strategy_steps(spec: RunSpec, shape: _Shape, summary: _Summary, devices: list[DeviceInfo],
                    n: int) -> list[tuple[_Step, str]]:
    """Each device's step by ``spec.strategy`` (see :func:`plan_memory`) with its tag for the device's methods; ``n``:
    the ranks sharing the work."""
    strategy = spec.strategy
    wholes: dict[str, _Step] = {}  # the whole run per device kind: CPU and CUDA differ (optimizer foreach, dropout)

    def whole(kind: str) -> _Step:
        if kind not in wholes:
            wholes[kind] = _whole_step(spec, shape, summary, kind)
        return wholes[kind]

    if strategy == "single":
        return [(whole(d.kind), "") for d in devices]
    if strategy == "ddp":
        return [(_ddp_step(spec, whole(d.kind), n), f"ddp (full replica per device, N={n})") for d in devices]
    if strategy in ("zero1", "zero2", "zero3"):
        return [_zero_step(spec, summary, whole(d.kind), strategy, n) for d in devices]
    if strategy == "device_map":
        return _device_map_steps(spec, shape, summary, devices)
    return [_tp_step(spec, shape, summary, spec.tp, len(devices), d.kind) for d in devices]


@dataclass(frozen=True)
class _Step:
    """One device's step before it is a :class:`DevicePlan`: the terms of its phases (training) or its inference
    parts, and the formula of each component (``methods``)."""

    methods: dict[str, str]
    terms: StepTerms | None = None  # training
    inference: dict[str, int] | None = None  # weights, activations, temporaries, kv_cache


def _device_plan(device: DeviceInfo, step: _Step, tag: str, overhead: Line) -> DevicePlan:
    """Phases from the step's terms (each at its own peak moment), each component's line its largest value over every
    moment of the step."""
    if step.terms is not None:
        moments = training_moments(dataclasses.replace(step.terms, overhead=overhead.bytes))
        untraced = overhead.bytes + step.terms.every_phase
    else:
        assert step.inference is not None  # a step has training terms or inference terms
        moments = inference_moments(overhead=overhead.bytes, **step.inference)
        untraced = overhead.bytes
    phases = phases_of(moments)
    lines = {}
    for name in COMPONENTS:
        if name == "overhead":
            lines[name] = overhead
            continue
        largest = max(moments, key=lambda p: p.components[name])
        method = step.methods[name]
        if len(moments) > 1 and largest.components[name] and name not in ("weights", "optimizer_states", "kv_cache"):
            method += f" (largest at {largest.at})"
        lines[name] = Line(name, largest.components[name], f"{tag}: {method}" if tag else method)
    return DevicePlan(device, lines, phases, untraced)


def _whole_step(spec: RunSpec, shape: _Shape, summary: _Summary, kind: str) -> _Step:
    """The whole run on one device of ``kind`` (cpu | cuda): every layer, the embedding and the loss."""
    return _part_step(spec, shape, summary, summary, kind, shape.layers, first=True, head=True)


def _temporaries_text(act: StepActivations, step_text: str, grads: dict[str, int],
                      quantised: QuantisedBase | None = None) -> str:
    """The temporaries line's formula: the loss's gradients, the optimizer step's buffers, a tied embedding's parts,
    QLoRA's dequantised weight."""
    parts = [f"start of backward: fp32 gradients of log_softmax and of the logits 2 x b·s·V x 4 B = "
             f"{act.logits_backward:,} B", f"optimizer step: {step_text}"]
    if quantised is not None:
        parts.append(f"4-bit layers: the largest one's weight dequantised to the compute dtype as it runs (forward, "
                     f"and backward for its input's gradient){' with its fp32 absmax' if quantised.double_quant else ''}"
                     f" {quantised.dequantised_bytes:,} B")
    if grads.get("tied_buffer"):
        parts.append(f"tied embedding: the LM head's part of its gradient {grads['tied_buffer']:,} B held from the "
                     "head's backward to the embedding's, where the two parts and their sum are alive at once")
    return "; ".join(parts)


def _gradient_terms(spec: RunSpec, shape: _Shape, summary: _Summary) -> dict[str, int]:
    """The gradient terms of the backward's moments: the LM head's weight gradient (an untied head trained), its
    16-bit transient under amp, a tied embedding's buffer, and the first layer's and embedding's gradients."""
    head = tied = first = 0
    vocab_matrix = shape.vocab * shape.hidden
    for p in summary.params:
        if not p.trainable:
            continue
        nbytes = p.numel * dtype_bytes(p.dtype)
        if p.unit == "embeddings":
            first += nbytes
            if shape.tied and p.numel == vocab_matrix:
                tied = nbytes
        elif p.layer == 0:
            first += nbytes
        elif p.unit == "head" and p.kind == "linear" and p.numel == vocab_matrix:
            head = nbytes
    cast = spec.param_dtype != spec.dtype and spec.autocast and (head or tied)
    return {"head_gradient": head, "head_gradient_transient": vocab_matrix * spec.dtype_bytes if cast else 0,
            "tied_buffer": tied, "first_gradients": first}


def _convention(spec: RunSpec) -> str:
    """:data:`CONVENTION` with the precision of this spec."""
    if spec.method.takes("quant"):
        precision = (f"QLoRA (a variant of LoRA): the decoder's linear weights stored in 4 bits "
                     f"({spec.qlora.quant_type}) and dequantised to the compute dtype {spec.dtype} layer by layer as "
                     f"they run; every other parameter, the adapters, their gradients and optimizer states in fp32"
                     + (f", forward and backward under autocast to {spec.dtype}" if spec.autocast else ""))
    elif spec.dtype == "fp32":
        precision = ("fp32: weights, gradients and optimizer states in fp32, no autocast (the precision, pure or amp, is "
                     "moot in fp32)")
    elif spec.param_dtype == spec.dtype:
        precision = (f"precision pure: the model is loaded in {spec.dtype}, its gradients and optimizer states are in "
                     f"{spec.dtype} (torch's AdamW keeps its moments in each parameter's dtype)")
    else:
        precision = (f"precision amp: fp32 weights, gradients and optimizer states (the master copy), forward and "
                     f"backward under autocast to {spec.dtype}; autocast keeps a {spec.dtype} copy of each linear "
                     "weight for the step (counted with the activations)")
    return CONVENTION.format(precision=precision)


# ------------------------------------------------------------------------------------------------------- strategies
def _ceil_div(value: int, n: int) -> int:
    return -(-value // n)


def _ddp_step(spec: RunSpec, whole: _Step, n: int) -> _Step:
    """DDP: a full replica per device plus the gradient bucket buffers (PyTorch DDP docs, ``gradient_as_bucket_view``:
    with the default ``False`` the reducer's buckets are a second copy of every gradient, allocated when the model is
    wrapped and kept; ``True`` saves exactly the gradient size). Buckets hold at most ``bucket_cap_mb`` = 25 MiB each
    (the first one 1 MiB); their sum is the gradient bytes. Inference has no backward pass and no buckets."""
    if whole.terms is None:
        return whole
    buckets = whole.terms.gradients
    methods = dict(whole.methods)
    methods["temporaries"] += (f"; + DDP gradient buckets (estimate) {buckets:,} B in every phase = the gradient "
                               f"bytes: the reducer copies every gradient into flat buckets of bucket_cap_mb = "
                               f"{DDP_BUCKET_CAP_BYTES // 2**20} MiB (gradient_as_bucket_view=False, DDP's default, "
                               "kept by Trainer; True would save these bytes)")
    return _Step(methods, dataclasses.replace(whole.terms, every_phase=buckets))


def _zero_step(spec: RunSpec, summary: _Summary, whole: _Step, strategy: Strategy, n: int) -> tuple[_Step, str]:
    """ZeRO stage 1/2/3 (Rajbhandari et al. 2020, arXiv 1910.02054, Fig. 1: P_os, P_os+g, P_os+g+p; ``zero3`` is
    PyTorch FSDP's FULL_SHARD). Stage 1: optimizer states ÷ N; stage 2: + gradients ÷ N; stage 3: + weights ÷ N and,
    in forward and backward, the largest gathered unit x :data:`ZERO3_GATHERED_UNITS` and the root unit. The optimizer
    step runs on each device's shard, so its temporaries are ÷ N too; the activations and the logits are per
    micro-batch and are not divided."""
    stage = strategy[-1]
    label = f"{strategy} (ZeRO stage {stage}" + (" = FSDP full shard" if stage == "3" else "") + ", arXiv 1910.02054)"
    divided = {"1": ("optimizer_states",), "2": ("optimizer_states", "gradients"),
               "3": ("optimizer_states", "gradients", "weights")}[stage]
    methods = {}
    for name, method in whole.methods.items():
        if name in divided:
            methods[name] = f"÷ N={n} (rounded up) of the whole-model figure, {method}"
        elif name == "activations":
            methods[name] = f"not divided: each device runs its own micro-batch through every layer (case P4); {method}"
        elif name == "temporaries":
            methods[name] = f"the optimizer step on this device's shard, ÷ N={n}; {method}"
        else:
            methods[name] = f"not divided: {method}"
    t = whole.terms
    if t is None:
        return _Step(methods, inference=whole.inference), label
    changes: dict[str, int] = {"step_temporaries": _ceil_div(t.step_temporaries, n)}
    if "optimizer_states" in divided:
        changes["optimizer_states"] = _ceil_div(t.optimizer_states, n)
    if "gradients" in divided:
        for key in ("gradients", "accumulated_gradients", "first_gradients", "head_gradient"):
            changes[key] = _ceil_div(getattr(t, key), n)
    if "weights" in divided:
        changes["weights"] = _ceil_div(t.weights, n)
        layers = _layer_weight_bytes(summary)
        largest = max(layers.values(), default=0)
        # the root unit (embeddings, final norm, LM head: what no decoder layer holds) stays gathered through the step
        root = max(0, t.weights - sum(layers.values()))
        changes["gathered"] = ZERO3_GATHERED_UNITS * largest + root
        methods["temporaries"] += (
            f"; + in forward and backward the largest gathered unit x {ZERO3_GATHERED_UNITS} (the one computing and "
            f"the one prefetched): the largest decoder layer's unsharded weights {largest:,} B x "
            f"{ZERO3_GATHERED_UNITS}; + the root unit unsharded, {root:,} B (embeddings, final norm, LM head: FSDP does "
            "not reshard the root after forward, so it is gathered from the first forward to the end of backward)")
    return _Step(methods, dataclasses.replace(t, **changes)), label


def _layer_weight_bytes(summary: _Summary) -> dict[int, int]:
    """Weight bytes of each decoder layer (its parameters in their dtype; LoRA adapters included)."""
    out: dict[int, int] = {}
    for p in summary.params:
        if p.layer is not None:
            out[p.layer] = out.get(p.layer, 0) + p.numel * dtype_bytes(p.dtype)
    return out


def _share(summary: _Summary, params: list[tuple[_Param, int, tuple[int, ...]]], adapters: tuple[_Adapter, ...]) -> _Summary:
    """A :class:`_Summary` of the part of the model one device holds: ``(param, local elements, local shape)``."""
    weight_groups: dict[str, int] = {}
    grad_groups: dict[str, int] = {}
    shapes: list[tuple[int, ...]] = []
    local: list[_Param] = []
    total = trainable = 0
    for p, numel, local_shape in params:
        total += numel
        weight_groups[p.dtype] = weight_groups.get(p.dtype, 0) + numel
        if p.trainable:
            trainable += numel
            grad_groups[p.dtype] = grad_groups.get(p.dtype, 0) + numel
            shapes.append(local_shape)
        local.append(dataclasses.replace(p, numel=numel, shape=local_shape))
    return _Summary(ParameterCount(total, trainable), weight_groups, grad_groups, tuple(shapes), adapters,
                    tuple(local))


def _device_map(summary: _Summary, devices: list[DeviceInfo]) -> dict[str, int]:
    """Place the model's units on the devices in order, like accelerate's ``infer_auto_device_map``.

    Units, in order: ``"embeddings"``, each decoder layer ``"layer i"`` (a no-split module: never divided), ``"head"``
    (final norm + LM head). Each device's share of the weight bytes is proportional to its capacity (equal shares when
    a capacity is unknown): a unit goes to the first device whose cumulative share reaches the middle of the unit
    (so a device is filled up to its share, give or take half a layer). The embeddings always go on the first device
    and the head on the last, as accelerate's maps for causal LMs do. Sizes are weights only, as accelerate's are.

    Returns:
        unit name -> device index.
    """
    sizes: dict[str, int] = {"embeddings": 0}
    for layer in sorted({p.layer for p in summary.params if p.layer is not None}):
        sizes[f"layer {layer}"] = 0
    sizes["head"] = 0
    for p in summary.params:
        key = f"layer {p.layer}" if p.layer is not None else p.unit
        sizes[key] += p.numel * dtype_bytes(p.dtype)
    n = len(devices)
    caps = [d.capacity_bytes for d in devices]
    weights = [float(c or 0) for c in caps] if all(c for c in caps) else [1.0] * n
    total = sum(sizes.values())
    bounds, acc = [], 0.0
    for w in weights:
        acc += w
        bounds.append(total * acc / sum(weights))
    placement: dict[str, int] = {}
    start, device = 0, 0
    for unit, size in sizes.items():
        middle = start + size / 2
        while device < n - 1 and middle > bounds[device]:
            device += 1
        placement[unit] = device
        start += size
    placement["embeddings"] = 0
    placement["head"] = n - 1
    return placement


def _layer_range(layers: list[int]) -> str:
    if not layers:
        return "no decoder layers"
    return f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]} ({len(layers)})"


def _device_map_steps(spec: RunSpec, shape: _Shape, summary: _Summary,
                      devices: list[DeviceInfo]) -> list[tuple[_Step, str]]:
    """device_map: each device holds the units :func:`_device_map` places on it, and what they need in the run (its
    layers' activations; the loss on the last device)."""
    placement = _device_map(summary, devices)
    n = len(devices)
    out = []
    for index, device in enumerate(devices):
        layers = sorted(int(u.split()[1]) for u, d in placement.items() if d == index and u.startswith("layer "))
        held = [u for u in ("embeddings", "head") if placement[u] == index]
        last = index == n - 1
        where = ", ".join([*(["embeddings"] if "embeddings" in held else []), _layer_range(layers),
                           *(["final norm + LM head + logits"] if "head" in held else [])])
        tag = f"device_map (device {index + 1} of {n}: {where})"
        mine = [(p, p.numel, p.shape) for p in summary.params
                if placement[f"layer {p.layer}" if p.layer is not None else p.unit] == index]
        adapters = tuple(a for a in summary.adapters
                         if (a.layer is not None and int(a.layer) in layers) or (a.layer is None and last))
        local = _share(summary, mine, adapters)
        out.append((_part_step(spec, shape, summary, local, device.kind, len(layers), first=0 in layers, head=last,
                               scope="the parameters of the units on this device, tied weights with the embedding"),
                    tag))
    return out


def _part_step(spec: RunSpec, shape: _Shape, summary: _Summary, local: _Summary, kind: str, n_layers: int, *,
               first: bool, head: bool, scope: str | None = None, tp: int = 1) -> _Step:
    """The step of a device holding ``n_layers`` decoder layers of the model and the parameters in ``local``
    (device_map: its own layers; tp: every layer's shards; the whole model: ``local`` is ``summary``, no ``scope``),
    with the first layer when ``first`` and the loss when ``head``."""
    quantised = quantised_base(spec, shape, local) if spec.method.takes("quant") else None
    weights = _qlora_weights(quantised) if quantised is not None else _weights(local, scope)
    if not spec.training:
        activations = _inference_activations(spec, shape, tp) if head else Line(
            "activations", 0, "inference: no logits on this device (no activations are saved)")
        temporaries = _inference_temporaries(spec, shape, tp) if n_layers else Line(
            "temporaries", 0, "inference: no decoder layer here, no layer working set")
        kv = _kv_cache(spec, shape, n_layers, tp)
        return _Step(
            methods={"weights": weights.method, "gradients": "inference: no backward pass, no gradients",
                     "optimizer_states": "inference: no optimizer", "activations": activations.method,
                     "temporaries": temporaries.method, "kv_cache": kv.method},
            inference={"weights": weights.bytes, "activations": activations.bytes,
                       "temporaries": temporaries.bytes, "kv_cache": kv.bytes})
    gradients, states = _gradients(spec, local), _optimizer_states(spec, local, kind)
    step_bytes, step_text = _step_temporaries(spec, local, kind)
    act, act_text = _activation_terms(spec, shape, summary, kind, tp)
    per_layer = act.layer_input if act.recompute else act.layer
    layers = n_layers * per_layer + (act.first - act.layer if first and not act.recompute and n_layers else 0)
    loss = {"head": act.head, "logits_forward": act.logits_forward, "logits_saved": act.logits_saved,
            "logits_backward": act.logits_backward, "logits_grad": act.logits_grad} if head else {}
    grads = _gradient_terms(spec, shape, local) if head or first else {}
    values: dict[str, int] = dict(
        weights=weights.bytes, gradients=gradients.bytes, optimizer_states=states.bytes, step_temporaries=step_bytes,
        accumulated_gradients=gradients.bytes if spec.grad_accum > 1 else 0, layers=layers,
        first_layer=(act.layer_input + act.recompute if act.recompute else (act.first if first else act.layer))
        if n_layers else 0,
        logits_forward=0, logits_saved=0, logits_backward=0, logits_grad=0, head=0,
        hidden_grad=act.hidden_grad, recompute=act.recompute if n_layers else 0,
        forward_cache=act.forward_cache * n_layers // max(shape.layers, 1),
        dequantised=quantised.dequantised_bytes if quantised is not None and n_layers else 0)
    values.update(loss)
    values.update(grads)
    terms = StepTerms(**values)
    where = "" if scope is None else f"{_n_layers(n_layers)} here" + ("" if head else "; no logits here") + ": "
    return _Step(methods={"weights": weights.method, "gradients": gradients.method, "optimizer_states": states.method,
                          "activations": f"{where}{act_text}",
                          "temporaries": _temporaries_text(act, step_text, grads, quantised) if head
                          else f"optimizer step (this device's parameters): {step_text}",
                          "kv_cache": "training: use_cache off, no KV cache"}, terms=terms)


def _check_tp_heads(tp: int, shape: _Shape) -> None:
    """Megatron-LM splits attention by heads: ``tp`` must divide the attention heads and the KV heads.

    Raises:
        SpecError: naming ``tp`` and the degrees that would work.
    """
    if shape.heads % tp or shape.kv_heads % tp:
        good = [t for t in range(2, shape.kv_heads + 1) if shape.heads % t == 0 and shape.kv_heads % t == 0]
        raise SpecError(
            "tp",
            f"tp = {tp} does not divide the model's {shape.heads} attention heads and {shape.kv_heads} KV heads; "
            "tensor parallelism splits attention by heads: choose tp among "
            + (", ".join(map(str, good)) if good else "none (this model cannot be split by heads; use another strategy)"),
        )


def _tp_step(spec: RunSpec, shape: _Shape, summary: _Summary, tp: int, n: int, kind: str) -> tuple[_Step, str]:
    """tp (Megatron-LM, Shoeybi et al. 2019, arXiv 1909.08053): every ``nn.Linear`` / ``Conv1D`` inside the decoder
    layers (attention q/k/v/o, MLP) is split ÷ tp (column- and row-parallel; biases with their weights, though Megatron
    replicates the row-parallel bias: hidden elements per layer), the token embedding and the LM head are
    vocab-parallel ÷ tp; norms, position embeddings and LoRA adapters are replicated. Adafactor shapes: the first
    dimension ÷ tp. Elements per device round up. Activations per layer: Korthikanti et al. 2022 eq. 2."""
    tag = f"tp (tensor parallel, tp={tp}, arXiv 1909.08053" + (f"; {n // tp} data-parallel replicas" if n > tp else "") + ")"
    mine = []
    split_numel = 0
    for p in summary.params:
        split = (p.kind == "linear" and p.unit == "layer") or (
            p.kind in ("embedding", "linear") and p.unit != "layer" and bool(p.shape) and p.shape[0] == shape.vocab)
        if split:
            split_numel += p.numel
            mine.append((p, -(-p.numel // tp), (-(-p.shape[0] // tp), *p.shape[1:])))
        else:
            mine.append((p, p.numel, p.shape))
    local = _share(summary, mine, summary.adapters)
    rule = (f"linear layers of attention and MLP + vocab-parallel embeddings/LM head ÷ {tp}, the rest replicated "
            f"(split part of the model: {split_numel:,} parameters)")
    step = _part_step(spec, shape, summary, local, kind, shape.layers, first=True, head=True,
                      scope="this device's shards + the replicated parameters", tp=tp)
    methods = {k: (f"{rule}; {v}" if k in ("weights", "gradients", "optimizer_states") else v)
               for k, v in step.methods.items()}
    return _Step(methods, step.terms, step.inference), tag


@dataclass(frozen=True)
class _Shape:
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
    def of(cls, config: Any, attention: str = "sdpa") -> _Shape:
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


def _groups(groups: dict[str, int]) -> str:
    """``"70,553,706,496 x 2 B (bf16)"``, or a sum of such terms when dtypes are mixed (LoRA adapters in fp32)."""
    if not groups:
        return "0 parameters"
    return " + ".join(f"{n:,} x {dtype_bytes(d)} B ({d})" for d, n in sorted(groups.items(), key=lambda kv: -kv[1]))


def _group_bytes(groups: dict[str, int]) -> int:
    return sum(n * dtype_bytes(d) for d, n in groups.items())


def _weights(summary: _Summary, scope: str | None = None) -> Line:
    """weights = P x bytes of each parameter's dtype (the parameter dtype; LoRA adapters fp32). ``scope``: what part of
    the model ``summary`` is, for a device holding part of it (device_map, tp)."""
    if scope is not None:
        return Line("weights", _group_bytes(summary.weight_groups),
                    f"P here x bytes: {_groups(summary.weight_groups)}; {scope}")
    return Line(
        "weights",
        _group_bytes(summary.weight_groups),
        f"P x bytes: {_groups(summary.weight_groups)}; every parameter incl. LM head, tied weights once",
    )


def _gradients(spec: RunSpec, summary: _Summary) -> Line:
    """gradients = T x bytes of each trainable parameter's dtype; none for inference."""
    if not spec.training:
        return Line("gradients", 0, "inference: no backward pass, no gradients")
    text = f"T x bytes (each parameter's dtype): {_groups(summary.grad_groups)}"
    if spec.grad_accum > 1:
        text += "; gradient accumulation keeps them from the second micro-batch's forward on"
    return Line("gradients", _group_bytes(summary.grad_groups), text)


def _trainable(summary: _Summary) -> list[_Param]:
    return [p for p in summary.params if p.trainable]


def _optimizer_states(spec: RunSpec, summary: _Summary, kind: str = "cuda") -> Line:
    """Optimizer states in the steady state, each in the dtype the optimizer creates it in (read from the libraries):

    - AdamW (torch): ``exp_avg`` and ``exp_avg_sq`` are ``torch.zeros_like(param)``, so 2 x T x each parameter's
      bytes (bf16 moments for a bf16 model); plus a 4 B fp32 step counter per trainable tensor, a CPU tensor (not on
      a CUDA device) unless fused or capturable;
    - SGD with momentum (torch): ``momentum_buffer = clone(grad)``: T x the parameter's bytes;
    - Adafactor (transformers, no first moment; Shazeer & Stern 2018, arXiv 1804.04235): the gradient is upcast to fp32
      before its statistics are made, so (rows + cols) x 4 B per matrix and n x 4 B per vector, whatever the dtype.
    """
    if not spec.training:
        return Line("optimizer_states", 0, "inference: no optimizer")
    trainable = _trainable(summary)
    if spec.optimizer in EIGHT_BIT_OPTIMIZERS:
        return _adamw_8bit_states(spec, trainable)
    if spec.optimizer == "adamw":
        moments = 2 * _group_bytes(summary.grad_groups)
        steps = 4 * len(trainable) if kind == "cpu" else 0
        text = f"AdamW: 2 moments x T in each parameter's dtype (zeros_like(param)) = 2 x ({_groups(summary.grad_groups)})"
        text += (f" + a 4 B fp32 step counter per trainable tensor ({len(trainable):,})" if kind == "cpu"
                 else "; its step counters are CPU tensors, not on the device")
        return Line("optimizer_states", moments + steps, text)
    if spec.optimizer == "sgd":
        return Line("optimizer_states", _group_bytes(summary.grad_groups),
                    f"SGD with momentum: 1 buffer x T in each parameter's dtype (clone of the gradient) = "
                    f"{_groups(summary.grad_groups)} (0 without momentum)")
    elements = 0
    for shape in summary.trainable_shapes:
        if len(shape) >= 2:
            leading = 1
            for d in shape[:-2]:
                leading *= d
            elements += leading * (shape[-2] + shape[-1])
        else:
            elements += _numel(shape)
    return Line(
        "optimizer_states",
        elements * 4,
        f"Adafactor factored second moment in fp32 (the gradient is upcast first): (rows + cols) x 4 B per matrix, "
        f"n x 4 B per vector = {elements:,} x 4 B",
    )


def _adamw_8bit_states(spec: RunSpec, trainable: list[_Param]) -> Line:
    """bitsandbytes' AdamW8bit states (core/plan/quant.py): uint8 moments with an fp32 absmax per 256 elements, fp32
    moments for a tensor under 4,096 elements and for an embedding (Trainer gives every ``nn.Embedding`` 32-bit
    states), and the two dynamic maps once."""
    eight: list[_Param] = []
    full: list[_Param] = []
    for p in trainable:
        (eight if adamw_8bit_is_8bit(p.numel, p.kind == "embedding") else full).append(p)
    states = sum(adamw_8bit_state_bytes(p.numel, p.kind == "embedding") for p in trainable)
    maps = adamw_8bit_maps_bytes(bool(eight))
    n8, n32 = sum(p.numel for p in eight), sum(p.numel for p in full)
    paged = ("; paged: tensors of 100k elements or more are allocated in CUDA unified memory, which the driver may page "
             "to the host under pressure (planned on the device)") if spec.optimizer == "paged_adamw_8bit" else ""
    return Line("optimizer_states", states + maps,
                f"bitsandbytes AdamW8bit (a variant): uint8 moments + an fp32 absmax per 256 elements for {len(eight):,} "
                f"tensors of {n8:,} elements (2 B + 8 B per 256); fp32 moments (8 B) for {len(full):,} tensors of "
                f"{n32:,} elements (under 4,096 elements, or an embedding: Trainer keeps those 32-bit); 2 dynamic maps "
                f"{maps:,} B{paged}")


def _step_temporaries(spec: RunSpec, summary: _Summary, kind: str) -> tuple[int, str]:
    """The optimizer step's transient buffers (bytes, formula), read from the optimizers' code and checked against the
    traced plan:

    - AdamW with ``foreach`` (torch's default on CUDA): ``torch._foreach_sqrt(exp_avg_sqs)`` makes one more state's
      worth, T x the parameters' bytes; per tensor (the CPU default): ``exp_avg_sq.sqrt() / bias_correction`` makes
      two copies of a tensor, 2 x the largest trainable tensor;
    - SGD with momentum: in place, none;
    - Adafactor: ``grad ** 2 + eps`` and the update, 2 fp32 copies of the largest trainable tensor, and for a 16-bit
      parameter its fp32 gradient and fp32 weight as well (4 copies).
    """
    trainable = _trainable(summary)
    if spec.optimizer in EIGHT_BIT_OPTIMIZERS:
        return adamw_8bit_step_temporaries(
            [(p.numel, dtype_bytes(p.dtype), p.kind == "embedding") for p in trainable], kind)
    largest = max(trainable, key=lambda p: p.numel * dtype_bytes(p.dtype), default=None)
    if spec.optimizer == "sgd" or largest is None:
        return 0, "SGD step: in-place updates, no temporaries"
    if spec.optimizer == "adafactor":
        copies = 2 if dtype_bytes(largest.dtype) == 4 else 4
        return copies * largest.numel * 4, (f"Adafactor step: {copies} fp32 copies of the largest trainable tensor = "
                                            f"{copies} x {largest.numel:,} x 4 B")
    if kind == "cuda":
        return (_group_bytes(summary.grad_groups),
                f"foreach AdamW (torch's default on CUDA): _foreach_sqrt makes one more state, T x bytes = "
                f"{_groups(summary.grad_groups)}")
    nbytes = dtype_bytes(largest.dtype)
    return (2 * largest.numel * nbytes,
            f"per-tensor AdamW (torch's default on the CPU): sqrt and the division of the largest trainable tensor, "
            f"2 x {largest.numel:,} x {nbytes} B")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


#: Module names of the first (up / gate) and second (down) MLP linear layers across common architectures.
_MLP_IN_NAMES = frozenset({"gate_proj", "up_proj", "c_fc", "fc_in", "fc1", "w1", "w3", "dense_h_to_4h"})
_MLP_OUT_NAMES = frozenset({"down_proj", "c_proj", "fc_out", "fc2", "w2", "dense_4h_to_h"})


def _numerics(spec: RunSpec) -> Numerics:
    param = dtype_bytes(spec.param_dtype)
    return Numerics(param_bytes=param, compute_bytes=spec.dtype_bytes if spec.autocast else param,
                    autocast=spec.autocast, quantised_base=spec.method.takes("quant"))


def _activation_terms(spec: RunSpec, shape: _Shape, summary: _Summary, kind: str,
                      tp: int = 1) -> tuple[StepActivations, str]:
    """The activation terms of one micro-batch (see :class:`core.plan.activations.StepActivations`) and their formula.

    The Llama family, without tensor parallelism: op by op (:func:`core.plan.activations.step_activations`). Others:
    Korthikanti et al. 2022 (eq. 1; eq. 2 under tp) for the layers, an approximation stated in the method."""
    num = _numerics(spec)
    c = num.compute_bytes
    b, s, h, V = spec.batch_size, spec.seq_len, shape.hidden, shape.vocab
    mask = 1 if kind == "cuda" else 4
    adapters = {a.module: Adapter(a.r, spec.lora.dropout > 0, mask) for a in summary.adapters}
    if shape.family in LLAMA_FAMILY and tp == 1:
        dims = Dims(b, s, h, shape.inter, shape.heads, shape.kv_heads, shape.head_dim, V, shape.layers, shape.tied)
        act = step_activations(dims, num, full=spec.method.trains_base, adapters=adapters, attention=shape.attention,
                               checkpointing=spec.gradient_checkpointing, biases=shape.biases,
                               masked=spec.padding == "padded")
        top = sorted(act.breakdown.items(), key=lambda kv: -kv[1])
        parts = ", ".join(f"{why} {n:,}" for why, n in top)
        text = (f"op by op from the {shape.family} decoder's code (core/plan/activations.py): one layer saves "
                f"{act.layer:,} B ({parts})")
        if spec.gradient_checkpointing:
            text += (f"; checkpointing: each of L={shape.layers} layers keeps its input {act.layer_input:,} B, one "
                     f"layer recomputed in backward")
        else:
            text += f"; L={shape.layers} layers" + (f" (the first {act.first:,} B)" if act.first != act.layer else "")
        text += (f"; + final norm, LM head and RoPE {act.head:,} B; + the loss at the end of the forward: logits b·s·V "
                 f"x ({c if c != 4 else ''}{' + 4' if c != 4 else '4'} + 4) B (compute dtype, fp32 copy, "
                 f"log_softmax), V={V:,}")
        if act.forward_cache:
            text += f"; + autocast's cached {spec.dtype} weight copies {act.forward_cache:,} B to the forward's end"
        return act, text
    return _korthikanti_terms(spec, shape, summary, num, adapters, tp)


def _korthikanti_terms(spec: RunSpec, shape: _Shape, summary: _Summary, num: Numerics, adapters: dict[str, Adapter],
                       tp: int) -> tuple[StepActivations, str]:
    """Activation terms for layers this planner has no op-by-op model of (or under tensor parallelism)."""
    c = num.compute_bytes
    s, b, h, V = spec.seq_len, spec.batch_size, shape.hidden, shape.vocab
    per_layer, layer_text = _layer_activation_bytes(spec, shape, tp, c)
    lora_extra = _adapter_activation_bytes(spec, summary.adapters, c)
    cast = 0
    if num.cast_weights:  # amp: each linear weight's 16-bit copy is kept for the backward of its input
        cast = sum(p.numel for p in summary.params if p.kind == "linear" and p.unit == "layer") * c // max(tp, 1)
    per_layer_all = per_layer + (lora_extra + cast) // max(shape.layers, 1)
    layer_input = b * s * h * num.residual_bytes
    logits = -(-b * s * V // tp)
    if spec.gradient_checkpointing:
        layers, recompute, cache = shape.layers * layer_input, per_layer_all, cast
    else:
        layers, recompute, cache = shape.layers * per_layer_all, 0, 0
    act = StepActivations(
        layer=per_layer_all, first=per_layer_all, layer_input=layer_input, layers=layers,
        head=b * s * h * (4 + c), logits_forward=logits * (c + (4 if c != 4 else 0) + 4), logits_saved=logits * 4,
        logits_backward=2 * logits * 4, logits_grad=logits * c, hidden_grad=b * s * h * c, recompute=recompute,
        forward_cache=cache, breakdown={})
    text = (f"Korthikanti et al. 2022 (an approximation for {shape.family or 'this'} layers): L={shape.layers} x "
            f"{layer_text}, h={h}, s={s}, b={b}")
    if lora_extra:
        text += f"; + LoRA adapters' inputs {lora_extra:,} B"
    if cast:
        text += f"; + the {spec.dtype} copies of the linear weights under amp {cast:,} B"
    if spec.gradient_checkpointing:
        text += f"; checkpointing: each layer keeps its input {layer_input:,} B, one layer recomputed in backward"
    split = f"/{tp} (vocab-parallel)" if tp > 1 else ""
    text += f"; + the loss: logits b·s·V{split} (compute dtype, fp32 copy, fp32 log_softmax), V={V:,}"
    return act, text


#: Short names of the gate projection of a gated MLP (SwiGLU, GeGLU): the MLP keeps four I-wide tensors, not two.
GATED_MLP_NAMES = frozenset({"gate_proj", "gate_up_proj", "w1", "w3", "wi_0", "fc_gate"})
#: Activations transformers writes as Python arithmetic (transformers/activations.py), each of whose ops keeps its own
#: I-wide tensor for backward, by how many more than a fused activation (which keeps its input only):
#: NewGELUActivation ``0.5 * x * (1 + tanh(c * (x + 0.044715 * x**3)))`` keeps tanh's output, 1 + it and 0.5 * x;
#: FastGELUActivation also the inner factor; QuickGELUActivation ``x * sigmoid(1.702 * x)`` the sigmoid's output.
PYTHON_ACTIVATION_TENSORS = {"gelu_new": 3, "gelu_fast": 4, "quick_gelu": 1}


def _mlp_units(spec: RunSpec, shape: _Shape) -> tuple[float, str]:
    """Korthikanti's MLP share of a layer (16-bit s·b·h units), generalised to the MLP width I and to gating: the first
    linear's input (2), then I-wide tensors of 2 B each: a plain MLP keeps the activation's input and the second
    linear's input (2 x 2·I/h) and a 1 B dropout mask (Korthikanti's 19 at I = 4h); a gated one keeps the gate, the
    activation's output, up and their product (4 x 2·I/h); an activation written as Python arithmetic keeps more
    (:data:`PYTHON_ACTIVATION_TENSORS`). LoRA on frozen MLP linears drops the inputs of those it does not adapt (a
    frozen linear needs no weight gradient)."""
    ratio = shape.inter / shape.hidden
    inner = 8 * ratio if shape.gated else 4 * ratio + 1
    inner += 2 * ratio * PYTHON_ACTIVATION_TENSORS.get(shape.activation, 0)
    first, second = 2.0, 2 * ratio
    if spec.adapters and not spec.all_linear:
        targets = set(spec.lora.targets)
        first = first if targets & _MLP_IN_NAMES else 0.0
        if not targets & _MLP_OUT_NAMES:
            inner -= second  # the second linear's input is the product (gated) or the activation's output
    units = first + inner
    kind = "gated" if shape.gated else "plain"
    extra = PYTHON_ACTIVATION_TENSORS.get(shape.activation, 0)
    act = f", {shape.activation} keeps {extra} more I-wide tensors" if extra else ""
    return units, f"{kind} MLP {units:.1f} (I/h = {ratio:.2f}{act})"


def _layer_activation_bytes(spec: RunSpec, shape: _Shape, tp: int = 1, nbytes: int | None = None) -> tuple[int, str]:
    """One layer's saved activations, Korthikanti et al. 2022 eq. (1): ``s·b·h·(34 + 5·a·s/h)`` bytes in 16-bit, scaled by
    compute bytes / 2, its MLP share generalised to the MLP's width and gating (:func:`_mlp_units`); the ``5·a·s/h``
    score term only with eager attention. With tensor parallelism ``tp`` = t > 1, eq. (2) (no sequence parallelism):
    ``s·b·h·(10 + 24/t + 5·a·s/(h·t))``. Returns (bytes, formula text)."""
    s, b, h, a = spec.seq_len, spec.batch_size, shape.hidden, shape.heads
    nbytes = nbytes if nbytes is not None else spec.dtype_bytes
    if tp == 1:
        mlp, mlp_text = _mlp_units(spec, shape)
        units = KORTHIKANTI_SBH_BYTES_16BIT - KORTHIKANTI_MLP_UNITS + mlp
        per_layer = int(s * b * h * units * nbytes / 2)
        body = f"s·b·h·({KORTHIKANTI_SBH_BYTES_16BIT - KORTHIKANTI_MLP_UNITS} + {mlp_text}"
        if shape.materialises_scores:
            per_layer += 5 * a * s * s * b * nbytes // 2
            text = f"{body} + 5·a·s/h) x {nbytes} B / 2 (eager attention keeps the a·s·s scores)"
        else:
            text = f"{body}) x {nbytes} B / 2 ({shape.attention} attention: fused, no saved scores)"
        return per_layer, text
    per_layer = s * b * h * (10 * tp + 24) * nbytes // (2 * tp)
    if shape.materialises_scores:
        per_layer += 5 * a * s * s * b * nbytes // (2 * tp)
        text = (f"s·b·h·(10 + 24/t + 5·a·s/(h·t)) x {nbytes} B / 2, t={tp} (Korthikanti eq. 2; eager attention keeps "
                "the scores of its heads)")
    else:
        text = (f"s·b·h·(10 + 24/t) x {nbytes} B / 2, t={tp} (Korthikanti eq. 2, no sequence parallelism; "
                f"{shape.attention} attention: fused)")
    return per_layer, text


def _adapter_activation_bytes(spec: RunSpec, adapters: tuple[_Adapter, ...], c: int) -> int:
    """Per adapter: its input b·s·in (cast to the compute dtype) and its rank-r intermediate b·s·r, plus a dropout mask
    b·s·in x 1 B when dropout > 0."""
    s, b = spec.seq_len, spec.batch_size
    mask = 1 if spec.lora.dropout > 0 else 0
    return sum(b * s * (ad.in_features + ad.r) * c + b * s * ad.in_features * mask for ad in adapters)


def _inference_activations(spec: RunSpec, shape: _Shape, tp: int = 1) -> Line:
    """Inference at the loss (the probe and the held-out evaluation pass labels): the logits in the dtype, plus
    transformers' fp32 copy for the loss when the dtype is 16-bit, plus the fp32 log-softmax of the cross entropy
    (an fp32 model's ``.float()`` is the same tensor), and the last hidden state the LM head read (b·s·h); equal to the
    traced forward within its rounding."""
    nbytes = spec.dtype_bytes
    elements = -(-spec.batch_size * spec.seq_len * shape.vocab // tp)
    copies = nbytes + (LOGITS_BYTES if nbytes != LOGITS_BYTES else 0) + LOGITS_BYTES
    parts = f"{nbytes} B" + (f" + fp32 copy {LOGITS_BYTES} B" if nbytes != LOGITS_BYTES else "") + \
        f" + fp32 log-softmax {LOGITS_BYTES} B"
    split = f"/{tp} (vocab-parallel)" if tp > 1 else ""
    hidden = spec.batch_size * spec.seq_len * shape.hidden * nbytes
    return Line("activations", elements * copies + hidden,
                f"inference: logits of a full forward pass and the loss over them, b·s·V{split} x ({parts}) = "
                f"{spec.batch_size}·{spec.seq_len}·{shape.vocab:,}{split} x {copies} B, + the last hidden state b·s·h "
                f"x {nbytes} B (no activations are saved; a layer's working set is freed before the loss)")


def _inference_temporaries(spec: RunSpec, shape: _Shape, tp: int = 1) -> Line:
    """Inference: one layer's working set (one layer of Korthikanti activations), an estimate; it counts when it is
    above the loss's bytes (it is freed before the loss)."""
    per_layer, layer_text = _layer_activation_bytes(spec, shape, tp)
    return Line("temporaries", per_layer, f"inference: one layer's working set (estimate), {layer_text}")


def _n_layers(n: int) -> str:
    return f"{n} layer" if n == 1 else f"{n} layers"


def _kv_cache(spec: RunSpec, shape: _Shape, layers: int | None = None, tp: int = 1) -> Line:
    """Inference: 2 (K, V) x layers x kv_heads x head_dim x b x s x dtype bytes (grouped-query attention: kv_heads =
    ``num_key_value_heads``; head_dim = ``head_dim`` or hidden / heads), for ``layers`` decoder layers (default all)
    with the KV heads ÷ ``tp``. Training runs with ``use_cache`` off."""
    if spec.training:
        return Line("kv_cache", 0, "training: use_cache off, no KV cache")
    nbytes = spec.dtype_bytes
    layers = shape.layers if layers is None else layers
    kv_heads = shape.kv_heads // tp
    size = 2 * layers * kv_heads * shape.head_dim * spec.batch_size * spec.seq_len * nbytes
    heads = f"kv_heads/{tp}" if tp > 1 else "kv_heads"
    where = "L" if layers == shape.layers else "layers here"
    return Line(
        "kv_cache",
        size,
        f"2 (K,V) x {where} x {heads} x head_dim x b x s x {nbytes} B = 2 x {layers} x {kv_heads} x "
        f"{shape.head_dim} x {spec.batch_size} x {spec.seq_len} x {nbytes} B",
    )
def _quantised_source_bytes(spec: RunSpec, config: Any, quantised: QuantisedBase | None) -> tuple[int, str]:
    """QLoRA on the CPU: the checkpoint's pages of the layers quantised as they load (their elements x the bytes of
    the dtype config.json says the checkpoint holds, else the spec's), and that dtype's name; (0, "") otherwise."""
    if quantised is None:
        return 0, ""
    raw = getattr(config, "raw", None)
    stated = (raw.get("dtype") or raw.get("torch_dtype")) if isinstance(raw, dict) else (
        getattr(config, "dtype", None) or getattr(config, "torch_dtype", None))
    name = dtype_name(stated) if stated else spec.dtype
    try:
        nbytes = dtype_bytes(name)
    except ValueError:
        name, nbytes = spec.dtype, spec.dtype_bytes
    return quantised.quantised_parameters * nbytes, name


def _overhead(device: DeviceInfo, strategy: Strategy = "single", n: int = 1, first: bool = True,
              quantised_source: tuple[int, str] = (0, "")) -> Line:
    """CUDA: CUDA context + cuBLAS workspace, 500 MiB per process per device (estimate), plus NCCL communicator
    buffers (:data:`NCCL_BUFFER_BYTES`, estimate) for strategies that run collectives on N >= 2 devices (ddp, zero*,
    tp; not device_map, which is one process). CPU: the process's runtime, :data:`CPU_RUNTIME_BYTES` (estimate): on the
    CPU the probe's fit is judged by the larger of its tensor peak and its RSS, which holds it."""
    if device.kind == "cuda":
        text = "CUDA context + cuBLAS workspace (estimate; 300-700 MB per process per device): 500 MiB"
        if strategy in ("single", "device_map") or n < 2:
            if strategy == "device_map":
                text += " (device_map: one process, a context on each device it uses; no NCCL)"
            return Line("overhead", CUDA_OVERHEAD_BYTES, text)
        return Line(
            "overhead",
            CUDA_OVERHEAD_BYTES + NCCL_BUFFER_BYTES,
            f"{text}; + NCCL communicator buffers for {strategy} over N={n} devices (estimate, not measured here): "
            f"{NCCL_BUFFER_BYTES // 2**20} MiB (NCCL_BUFFSIZE 4 MiB per channel, peer and protocol)",
        )
    if strategy == "device_map" and not first:
        return Line("overhead", 0, "device_map runs in one process: its runtime is counted on the first device")
    text = (f"no CUDA context on the CPU; the process's Python, torch and transformers runtime and the allocator's "
            f"free memory (estimate; the probe's peak RSS was 0.44-0.59 GiB above its tensor peak on the embedded "
            f"model): {CPU_RUNTIME_BYTES // 2**20} MiB")
    source, name = quantised_source
    if source:
        text += (f"; + QLoRA's load: the checkpoint's pages of the layers quantised as they load, read and kept "
                 f"resident in the process ({name} in the checkpoint as config.json states it; measured here: the "
                 f"process's RSS after the 4-bit load of the embedded model 0.44 GiB above LoRA's load) {source:,} B")
    return Line("overhead", CPU_RUNTIME_BYTES + source, text)
