"""The analytic memory plan: bytes per device, per component and per phase of the step, before anything runs.

The model is built on the meta device from its config (no weights are read or allocated; :mod:`core.plan.meta`), so
a 70B model plans in well under a second on a laptop once torch and transformers are imported; a Llama-family
config.json is summarised from its numbers instead (core/plan/shapes.py, equal to the meta build in tests), with no
import of either. Parameter counts and shapes come from that meta model; everything else is a formula of the spec
(batch ``b``, sequence ``s``, dtypes) and the config (hidden ``h``, layers ``L``, heads ``a``, vocabulary ``V``). Every
:class:`core.plan.lines.Line` carries the formula it used, so a reader can check each number.

This module holds the plan's types (:class:`MemoryPlan`, :class:`DevicePlan`, :data:`COMPONENTS`), its convention and
:func:`plan_memory`, which puts the parts together: the meta model (:mod:`core.plan.meta`), each component's line
(:mod:`core.plan.lines`), each device's step by strategy (:mod:`core.plan.strategies`), QLoRA's 4-bit base
(:mod:`core.plan.quant`) and the phases (:mod:`core.plan.phases`). They import nothing of this module (an import
contract in pyproject.toml).

Accounting convention (also in :attr:`MemoryPlan.convention`, shown on screen and written to the record; docs/plan.md):

- precision (``spec.precision``): ``pure`` keeps the parameters in the dtype (a 16-bit model: weights, gradients and
  AdamW moments 2 B each; LoRA adapters fp32, as peft's ``autocast_adapter_dtype`` keeps them); ``amp`` keeps fp32
  parameters, gradients and optimizer states and runs forward and backward under autocast (Trainer's ``bf16=True`` on
  an fp32 model; 16 B per parameter with AdamW, as in ZeRO, arXiv 1910.02054);
- weights: every parameter (LM head included, tied weights once) in its dtype;
- gradients: trainable parameters x bytes of their own dtype; inference has none;
- optimizer states: in the dtype each optimizer creates them (:func:`core.plan.lines.optimizer_states_line`;
  bitsandbytes' 8-bit AdamW: :mod:`core.plan.quant`);
- activations (saved for backward): op by op for the Llama family (:mod:`core.plan.activations`), Korthikanti et al. 2022
  (arXiv 2205.05198) otherwise; the loss's logits; under amp the 16-bit weight copies autocast keeps;
- temporaries: the loss's gradients at the start of backward, the optimizer step's buffers
  (:func:`core.plan.lines.step_temporaries`); one layer's working set for inference;
- overhead: a line of its own (never hidden in another): what lies outside torch's allocator on a CUDA device (the
  CUDA context, NCCL's buffers, other processes' memory; cuBLAS's and cuDNN's workspaces are inside it), the
  process's runtime (Python, torch, the libraries) on the CPU (:data:`OVERHEAD_NAMES`);
- kv_cache: inference only.

The total of a device is the peak of the step: the largest of its phases (:mod:`core.plan.phases`: forward, backward,
optimizer step), each holding the components alive at its own peak; a line is its component's largest value over the
phases.

Per device, by strategy (:func:`plan_memory`; the rule is appended to the convention of a plan made for it): single
(each device holds the whole run), ddp (full replica + gradient buckets; PyTorch DDP docs), zero1/zero2/zero3 (ZeRO,
arXiv 1910.02054; zero3 = FSDP full shard: model states ÷ N, activations not divided), device_map (whole layers in order,
as accelerate's ``infer_auto_device_map``), tp (Megatron-LM, arXiv 1909.08053: linear layers ÷ tp). Devices can be a
box you do not have (``8x80GiB``, ``24GiB,8GiB``): :func:`core.plan.devices.detect_devices` builds them without
asking torch.

Nothing here imports torch, transformers or peft at module import; functions import them when called.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from core.devicespec import Strategy, check_strategy
from core.plan.activations import LLAMA_FAMILY
from core.plan.devices import DeviceInfo
from core.plan.fit import fits_in
from core.plan.lines import Line, overhead_line
from core.plan.meta import ParameterCount, meta_summary, model_shape
from core.plan.phases import Phase, inference_moments, peak, phases_of, training_moments
from core.plan.quant import QuantisedBase, quantised_base, quantised_source_bytes
from core.plan.strategies import DeviceStep, check_tp_heads, strategy_steps
from core.spec import RunSpec
from core.spectables import TORCHRUN_STRATEGIES

#: The components of every device plan, in order: the record's keys (core/plan/phases.py keeps this order).
COMPONENTS = ("weights", "gradients", "optimizer_states", "activations", "temporaries", "overhead", "kv_cache")


#: What the ``overhead`` line is on each kind of device, for people: (short, words). The record's key stays
#: ``overhead`` on both: on CUDA the CUDA context (with NCCL's buffers and other processes' memory); on the CPU no CUDA
#: context, the process's
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
class DevicePlan:
    """What one device must hold: a :class:`core.plan.lines.Line` for every name in :data:`COMPONENTS` (each
    component's largest value over the phases) and the phases of the step (:mod:`core.plan.phases`)."""

    device: DeviceInfo
    lines: dict[str, Line]
    phases: dict[str, Phase] = field(default_factory=dict)
    #: bytes of this plan a traced step cannot see: the overhead line and DDP's gradient buckets
    untraced_bytes: int = 0
    #: host memory this device's process holds for it (offloaded activations, optimizer states, parameters), each a
    #: line of its own: never counted in the device's total
    host: tuple[Line, ...] = ()

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
class MemoryPlan:
    """The analytic plan of a run.

    Attributes:
        parameters: parameter counts of the model as it runs.
        devices: one plan per device.
        strategy: how the run is spread over devices (:data:`core.devicespec.STRATEGIES`); ``"single"``: each device holds
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
    #: QLoRA: the 4-bit base's parts (:class:`core.plan.quant.QuantisedBase`); None for every other mode
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
                    **({"host": {line.component: {"bytes": int(line.bytes), "method": line.method}
                                 for line in dp.host}} if dp.host else {}),
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
    "on a CUDA device what lies outside torch's allocator (the CUDA context, NCCL's buffers, other processes); on the "
    "CPU, which has no CUDA context, the process's "
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


def plan_memory(
    spec: RunSpec, config: Any, devices: list[DeviceInfo], parameters: ParameterCount | None = None
) -> MemoryPlan:
    """Plan the memory of ``spec`` on each device, by ``spec.strategy`` (docs/architecture.md §3), phase by phase.

    Each device's plan holds the phases of the step (:mod:`core.plan.phases`: forward, backward, optimizer step; inference:
    forward) with the bytes of every component alive at each phase's peak, a :class:`core.plan.lines.Line` per
    component (its largest
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
    - ``device_map``: whole decoder layers placed in order on the devices (:mod:`core.plan.strategies`); each device holds
      its layers' weights, gradients, optimizer states, activations and KV cache; the loss on the last device.
    - ``tp`` (Megatron-LM, arXiv 1909.08053): linear layers of attention and MLP ÷ tp, embeddings and LM head
      vocab-parallel ÷ tp, the rest replicated; activations per Korthikanti et al. 2022 eq. 2; logits and KV cache ÷ tp.

    Activations: for the Llama family (:data:`core.plan.activations.LLAMA_FAMILY`) op by op from the model's own code
    (:mod:`core.plan.activations`, equal to the traced plan on its layers); for other models Korthikanti et al. 2022 eq. 1,
    an approximation for GPT-style layers, said so in the method.

    Overhead: the CUDA context line on every CUDA device (:func:`core.plan.context.cuda_context`: by the GPU's SMs and
    the mode); strategies that run collectives on N >= 2 devices (ddp,
    zero*, tp) add :func:`core.plan.context.nccl_buffers` (estimate) to it; device_map runs in one process and uses
    none.

    Args:
        spec: the run; ``batch_size`` is the micro-batch per device (per tensor-parallel group for ``tp``).
        config: the model's ``transformers.PretrainedConfig``.
        devices: from :func:`core.plan.devices.detect_devices` (or made by hand).
        parameters: counts already computed by :func:`core.plan.meta.count_parameters` for this spec, to report as
            they are (by default the counts of the meta model built here, in the parameter dtype, once per process).

    Returns:
        a :class:`MemoryPlan` whose device plans hold a :class:`core.plan.lines.Line` for every name in
        :data:`COMPONENTS` and the phases of the step.

    Raises:
        SpecError: the strategy does not suit the number of devices (e.g. ``devices = "auto"`` found one), or ``tp``
            does not divide the model's attention or KV heads.
    """
    strategy = spec.strategy
    # N: the ranks sharing the work (every node's, for several nodes); the devices planned are this node's
    n = spec.world_size(len(devices)) if strategy in TORCHRUN_STRATEGIES else len(devices)
    check_strategy(strategy, spec.tp, n, spec.devices)
    shape = model_shape(config, spec.attn_implementation)
    if strategy == "tp":
        check_tp_heads(spec.tp, shape)
    # precision: pure keeps the parameters in the dtype (LoRA adapters fp32), amp keeps fp32 master weights
    summary = meta_summary(config, spec.mode, spec.lora if spec.adapters else None, spec.param_dtype)
    counts = parameters if parameters is not None else summary.count
    quantised = quantised_base(spec, shape, summary) if spec.method.quantised else None
    steps = strategy_steps(spec, shape, summary, devices, n, config)
    source = quantised_source_bytes(spec, config, quantised)
    plans = [_device_plan(device, step, tag, overhead_line(device, strategy, n, first=i == 0, quantised_source=source,
                                                            training=spec.training))
             for i, (device, (step, tag)) in enumerate(zip(devices, steps))]
    model = "op-by-op" if shape.family in LLAMA_FAMILY and strategy != "tp" else "korthikanti"
    if strategy == "single":
        return MemoryPlan(counts, plans, "single", _convention(spec), model, quantised)
    convention = _convention(spec).replace(_SINGLE_RULE, f"(strategy {strategy}: see its rule at the end)")
    return MemoryPlan(counts, plans, strategy, f"{convention} {STRATEGY_CONVENTIONS[strategy]}", model, quantised)


def _device_plan(device: DeviceInfo, step: DeviceStep, tag: str, overhead: Line) -> DevicePlan:
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
    return DevicePlan(device, lines, phases, untraced, step.host)


def _convention(spec: RunSpec) -> str:
    """:data:`CONVENTION` with the precision of this spec."""
    if spec.method.quantised == "int8":
        precision = (f"LoRA over an 8-bit base (a variant of LoRA, LLM.int8): the decoder's linear weights stored as "
                     f"int8 with an fp32 scale per row, each dequantised to {spec.dtype} for its input's gradient; "
                     f"every other parameter in the model's dtype, the adapters fp32")
    elif spec.method.quantised:
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
