"""The placement strategies: each device's step by ``spec.strategy`` (docs/architecture.md §3, docs/plan.md).

:func:`strategy_steps` gives each device a :class:`DeviceStep`: the terms of its phases (training) or its inference
parts, and the formula of each component, made from the component lines (:mod:`core.plan.lines`) over the part of the
model the device holds:

- ``single``: every device holds the whole run;
- ``ddp`` (PyTorch DDP docs): a full replica plus the gradient bucket buffers;
- ``zero1`` / ``zero2`` / ``zero3`` (ZeRO, arXiv 1910.02054; ``zero3`` = FSDP full shard): model states ÷ N, the
  gathered units under ``zero3``; activations never divided;
- ``device_map``: whole decoder layers placed in order, as accelerate's ``infer_auto_device_map``;
- ``tp`` (Megatron-LM, arXiv 1909.08053): linear layers ÷ tp, embeddings and LM head vocab-parallel, the rest replicated
  (:func:`check_tp_heads`: tp must divide the heads).

:mod:`core.plan.memory` turns each step into a :class:`core.plan.memory.DevicePlan`. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from core.devicespec import Strategy
from core.dtypes import dtype_bytes
from core.errors import SpecError
from core.plan.devices import DeviceInfo
from core.plan.lines import (
    Line,
    activation_terms,
    gradient_terms,
    gradients_line,
    in_backward,
    inference_activations_line,
    inference_temporaries_line,
    kv_cache_line,
    offloaded_activations,
    optimizer_states_line,
    paged_states_line,
    qlora_weights_line,
    reference_forward,
    reference_weights,
    step_temporaries,
    temporaries_text,
    weights_line,
)
from core.plan.meta import AdapterInfo, ModelShape, ModelSummary, ParameterCount, ParamInfo
from core.plan.phases import StepTerms
from core.plan.quant import quantised_base
from core.spec import RunSpec

#: PyTorch DDP's default bucket size (``bucket_cap_mb=25``), in bytes; quoted in the DDP bucket method text.
DDP_BUCKET_CAP_BYTES = 25 * 2**20
#: ZeRO-3 / FSDP: gathered (unsharded) units alive at once: the one computing and the next one, prefetched (FSDP's
#: default ``backward_prefetch=BACKWARD_PRE`` all-gathers the next unit before the current one's gradient is computed;
#: DeepSpeed ZeRO-3 prefetches by ``stage3_prefetch_bucket_size``). An estimate of the planner, stated in the method.
ZERO3_GATHERED_UNITS = 2


@dataclass(frozen=True)
class DeviceStep:
    """One device's step before it is a :class:`core.plan.memory.DevicePlan`: the terms of its phases (training) or
    its inference parts, and the formula of each component (``methods``)."""

    methods: dict[str, str]
    terms: StepTerms | None = None  # training
    inference: dict[str, int] | None = None  # weights, activations, temporaries, kv_cache
    host: tuple[Line, ...] = ()  # host memory the device's process holds for it (offloads), not device memory


def strategy_steps(spec: RunSpec, shape: ModelShape, summary: ModelSummary, devices: list[DeviceInfo],
                   n: int, config: Any = None) -> list[tuple[DeviceStep, str]]:
    """Each device's step by ``spec.strategy`` (see :func:`core.plan.memory.plan_memory`) with its tag for the
    device's methods; ``n``: the ranks sharing the work; ``config``: the model's (a compiled layer is measured on it)."""
    strategy = spec.strategy
    wholes: dict[str, DeviceStep] = {}  # the whole run per device kind: CPU and CUDA differ (optimizer foreach, dropout)

    def whole(kind: str) -> DeviceStep:
        if kind not in wholes:
            wholes[kind] = _whole_step(spec, shape, summary, kind, config)
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


def check_tp_heads(tp: int, shape: ModelShape) -> None:
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


def _part_step(spec: RunSpec, shape: ModelShape, summary: ModelSummary, local: ModelSummary, kind: str,
               n_layers: int, *, first: bool, head: bool, scope: str | None = None, tp: int = 1,
               config: Any = None) -> DeviceStep:
    """The step of a device holding ``n_layers`` decoder layers of the model and the parameters in ``local``
    (device_map: its own layers; tp: every layer's shards; the whole model: ``local`` is ``summary``, no ``scope``),
    with the first layer when ``first`` and the loss when ``head``."""
    quantised = quantised_base(spec, shape, local) if spec.method.quantised else None
    weights = qlora_weights_line(quantised) if quantised is not None else weights_line(local, scope)
    if not spec.training:
        activations = inference_activations_line(spec, shape, tp) if head else Line(
            "activations", 0, "inference: no logits on this device (no activations are saved)")
        temporaries = inference_temporaries_line(spec, shape, tp) if n_layers else Line(
            "temporaries", 0, "inference: no decoder layer here, no layer working set")
        kv = kv_cache_line(spec, shape, n_layers, tp)
        return DeviceStep(
            methods={"weights": weights.method, "gradients": "inference: no backward pass, no gradients",
                     "optimizer_states": "inference: no optimizer", "activations": activations.method,
                     "temporaries": temporaries.method, "kv_cache": kv.method},
            inference={"weights": weights.bytes, "activations": activations.bytes,
                       "temporaries": temporaries.bytes, "kv_cache": kv.bytes})
    gradients, states = gradients_line(spec, local), optimizer_states_line(spec, local, kind)
    step_bytes, step_text = step_temporaries(spec, local, kind)
    act, act_text = activation_terms(spec, shape, summary, kind, tp, config)
    per_layer = act.layer_input if act.recompute else act.layer
    layers = n_layers * per_layer + (act.first - act.layer if first and not act.recompute and n_layers else 0)
    paged = paged_states_line(spec, local, kind)
    host: list[Line] = [paged] if paged is not None else []
    if spec.activation_offloading and n_layers:
        layers, pinned, offload_text = offloaded_activations(spec, act, n_layers)
        act_text += f"; {offload_text}"
        host.append(Line("activations", pinned, offload_text))
    ref_bytes, ref_text = reference_weights(spec, local)
    weights = Line(weights.component, weights.bytes + ref_bytes, weights.method + ref_text)
    ref_forward, held, forward_text = reference_forward(spec, shape, local) if head else (0, 0, "")
    act_text += forward_text
    grad_bytes = gradients.bytes
    if spec.optimizer_in_backward:
        grad_bytes, step_bytes, in_text = in_backward(spec, local, kind)
        gradients = Line("gradients", grad_bytes, in_text)
        step_text = in_text
    loss = {"head": act.head, "logits_forward": act.logits_forward, "logits_saved": act.logits_saved,
            "logits_backward": act.logits_backward, "logits_grad": act.logits_grad} if head else {}
    grads = gradient_terms(spec, shape, local) if head or first else {}
    values: dict[str, int] = dict(
        weights=weights.bytes, gradients=grad_bytes, optimizer_states=states.bytes, step_temporaries=step_bytes,
        accumulated_gradients=grad_bytes if spec.grad_accum > 1 else 0, layers=layers,
        reference_forward=ref_forward, logits_held=held,
        first_layer=(act.layer_input + act.recompute if act.recompute else (act.first if first else act.layer))
        if n_layers else 0,
        logits_forward=0, logits_saved=0, logits_backward=0, logits_grad=0, head=0,
        hidden_grad=act.hidden_grad, recompute=act.recompute if n_layers else 0,
        forward_cache=act.forward_cache * n_layers // max(shape.layers, 1),
        dequantised=quantised.dequantised_bytes if quantised is not None and n_layers else 0,
        forward_working=act.working if n_layers else 0)
    values.update(loss)
    values.update(grads)
    if spec.optimizer_in_backward:  # no gradient outlives its parameter's step
        values.update(first_gradients=0, head_gradient=min(values.get("head_gradient", 0), grad_bytes))
    terms = StepTerms(**values)
    where = "" if scope is None else f"{_n_layers(n_layers)} here" + ("" if head else "; no logits here") + ": "
    return DeviceStep(methods={"weights": weights.method, "gradients": gradients.method,
                               "optimizer_states": states.method, "activations": f"{where}{act_text}",
                               "temporaries": temporaries_text(act, step_text, grads, quantised) if head
                               else f"optimizer step (this device's parameters): {step_text}",
                               "kv_cache": "training: use_cache off, no KV cache"}, terms=terms, host=tuple(host))


def _n_layers(n: int) -> str:
    return f"{n} layer" if n == 1 else f"{n} layers"


def _whole_step(spec: RunSpec, shape: ModelShape, summary: ModelSummary, kind: str, config: Any = None) -> DeviceStep:
    """The whole run on one device of ``kind`` (cpu | cuda): every layer, the embedding and the loss."""
    return _part_step(spec, shape, summary, summary, kind, shape.layers, first=True, head=True, config=config)


def _ceil_div(value: int, n: int) -> int:
    return -(-value // n)


def _ddp_step(spec: RunSpec, whole: DeviceStep, n: int) -> DeviceStep:
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
    return DeviceStep(methods, dataclasses.replace(whole.terms, every_phase=buckets))


def _zero_step(spec: RunSpec, summary: ModelSummary, whole: DeviceStep, strategy: Strategy,
               n: int) -> tuple[DeviceStep, str]:
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
        return DeviceStep(methods, inference=whole.inference), label
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
    return DeviceStep(methods, dataclasses.replace(t, **changes)), label


def _layer_weight_bytes(summary: ModelSummary) -> dict[int, int]:
    """Weight bytes of each decoder layer (its parameters in their dtype; LoRA adapters included)."""
    out: dict[int, int] = {}
    for p in summary.params:
        if p.layer is not None:
            out[p.layer] = out.get(p.layer, 0) + p.numel * dtype_bytes(p.dtype)
    return out


def _share(summary: ModelSummary, params: list[tuple[ParamInfo, int, tuple[int, ...]]],
           adapters: tuple[AdapterInfo, ...]) -> ModelSummary:
    """A :class:`ModelSummary` of the part of the model one device holds: ``(param, local elements, local shape)``."""
    weight_groups: dict[str, int] = {}
    grad_groups: dict[str, int] = {}
    shapes: list[tuple[int, ...]] = []
    local: list[ParamInfo] = []
    total = trainable = 0
    for p, numel, local_shape in params:
        total += numel
        weight_groups[p.dtype] = weight_groups.get(p.dtype, 0) + numel
        if p.trainable:
            trainable += numel
            grad_groups[p.dtype] = grad_groups.get(p.dtype, 0) + numel
            shapes.append(local_shape)
        local.append(dataclasses.replace(p, numel=numel, shape=local_shape))
    return ModelSummary(ParameterCount(total, trainable), weight_groups, grad_groups, tuple(shapes), adapters,
                        tuple(local))


def _device_map(summary: ModelSummary, devices: list[DeviceInfo]) -> dict[str, int]:
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


def _device_map_steps(spec: RunSpec, shape: ModelShape, summary: ModelSummary,
                      devices: list[DeviceInfo]) -> list[tuple[DeviceStep, str]]:
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


def _tp_step(spec: RunSpec, shape: ModelShape, summary: ModelSummary, tp: int, n: int,
             kind: str) -> tuple[DeviceStep, str]:
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
    return DeviceStep(methods, step.terms, step.inference), tag
