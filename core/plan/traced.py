"""The traced plan: one steady-state step of the run on fake CPU tensors, measured by torch's ``MemTracker``.

The analytic plan (:mod:`core.plan.memory`) is a sum of formulas; the traced plan runs the model's own code. The model is built
on the meta device exactly as the analytic plan builds it (LoRA wrapped there by peft), its parameters and buffers are
swapped for fake CPU tensors (``torch._subclasses.fake_tensor.FakeTensorMode``: shapes, dtypes and storages, no data, no
compute), and one step is run under ``torch.distributed._tools.mem_tracker.MemTracker``, which categorises every storage
alive at each op (docs/architecture.md §3, §6). A warm-up step first creates the optimizer states, so the traced step is the steady
state the run repeats: weights, optimizer states, the forward's activations, the backward's gradients and temporaries,
then the optimizer step.

What the step does is what the worker's Trainer step does: the loss from ``labels`` inside the model (transformers
upcasts the logits to fp32), bf16/fp16 training as mixed precision (fp32 parameters, ``torch.autocast`` over the step),
gradient checkpointing non-reentrant, ``grad_accum`` >= 2 traced as two micro-batches (the second backward adds into
gradients that already exist), then the optimizer step and ``zero_grad(set_to_none=True)``. The optimizer is torch's
AdamW / SGD with momentum 0.9, or transformers' Adafactor, with ``foreach`` as torch picks it on the target device
(``True`` on CUDA, ``False`` on CPU). Inference runs one forward under ``torch.no_grad`` with the config's KV cache.

MemTracker's categories map to the plan's components: PARAM -> weights, GRAD -> gradients, OPT -> optimizer states,
ACT -> activations, TEMP + BUFFER + OTH -> temporaries (buffers are the rotary tables and the like); for inference
the KV cache is moved out of the activations by the bytes of the cache the forward returned. The CUDA context is not a
tensor: the traced plan has no overhead line (the comparison says so).

Limits, stated on screen and in the record: the trace runs the CPU kernels' shapes (on CUDA, fused attention kernels
save slightly different tensors, e.g. a log-sum-exp per row); it does not model the caching allocator's rounding, so it
estimates peak *allocated*, not reserved.

Two modes (docs/architecture.md §6: MemTracker's per-module statistics cost ~10x on deep models): ``fast=True`` (default) keeps only
the overall peak and its category breakdown; ``fast=False`` keeps MemTracker's per-module snapshots as well.
``real=True`` runs the same step on real CPU tensors (random values) instead of fake ones — used to check that the two
give identical category totals (benchmarks/plan_speed.py and the tests).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from core.allocconf import AllocConf
from core.plan.allocator import PoolState, Window, replay
from core.plan.phases import PHASES
from core.spec import RunSpec

#: The tensor components the trace measures (the plan's COMPONENTS without ``overhead``).
TRACED_COMPONENTS = ("weights", "gradients", "optimizer_states", "activations", "temporaries", "kv_cache")


@dataclass(frozen=True)
class TracedPlan:
    """The memory of one traced steady-state step, at its peak.

    Attributes:
        components: bytes per component (:data:`TRACED_COMPONENTS`) in the snapshot taken at the overall peak.
        peak_bytes: the overall peak of tensor bytes (the sum of ``components``).
        categories: MemTracker's own categories at the peak (``PARAM``, ``BUFFER``, ``GRAD``, ``ACT``, ``TEMP``,
            ``OPT``, ``OTH``), bytes, before mapping.
        method: one paragraph saying how the trace was made (fake or real tensors, target device, optimizer, limits).
        seconds: wall time of the trace (build, warm-up step, traced step), seconds.
        tensors: ``"fake"`` or ``"real"``.
        modules: per-module peaks (module name -> bytes) when traced with ``fast=False``; empty otherwise.
        phases: the peak of each phase of the step (:data:`core.plan.phases.PHASES`: every micro-batch's forward with its
            loss, every micro-batch's backward, the optimizer step with ``zero_grad``; inference: ``forward`` only),
            each as bytes per component at that phase's own peak; the overall peak is the largest of them. The
            optimizer step's buffers, which MemTracker files as optimizer states, are counted as temporaries.
    """

    components: dict[str, int]
    peak_bytes: int
    categories: dict[str, int]
    method: str
    seconds: float
    tensors: str
    modules: dict[str, int] = field(default_factory=dict)
    phases: dict[str, dict[str, int]] = field(default_factory=dict)
    reserved: ReservedPrediction | None = None

    @property
    def maxima(self) -> dict[str, int]:
        """Each component's largest value over the phases (the analytic plan's lines are the same kind of number)."""
        if not self.phases:
            return dict(self.components)
        return {name: max(p.get(name, 0) for p in self.phases.values()) for name in TRACED_COMPONENTS}

    @property
    def peak_phase(self) -> str | None:
        """The phase whose peak is the overall peak (the first of :data:`PHASES` on a tie), or None without phases."""
        if not self.phases:
            return None
        return max(self.phases, key=lambda p: (sum(self.phases[p].values()), -PHASES.index(p)))

    def to_json(self) -> dict[str, Any]:
        """JSON-ready (ints and strings) for ``gpuaccept plan --json`` and the record."""
        return {
            "status": "estimated",
            "method": self.method,
            "tensors": self.tensors,
            "components": {k: int(v) for k, v in self.components.items()},
            "peak_bytes": int(self.peak_bytes),
            "peak_phase": self.peak_phase or "",
            "phases": {p: {k: int(v) for k, v in c.items()} for p, c in self.phases.items()},
            "categories": {k: int(v) for k, v in self.categories.items()},
            "seconds": round(self.seconds, 3),
            **({"reserved": self.reserved.to_json()} if self.reserved is not None else {}),
        }


@dataclass(frozen=True)
class ReservedPrediction:
    """What PyTorch's CUDA caching allocator reserves for the traced steps (:mod:`core.plan.allocator`): the
    allocations and frees of the weights, the batch, the first step (where the optimizer states appear) and the second
    (the steady state) replayed through its rules.

    Attributes:
        conf: the ``PYTORCH_CUDA_ALLOC_CONF`` planned under ("": PyTorch's defaults).
        steps: per step (``"step 1"``, ``"step 2"``): peak allocated (whole blocks), peak reserved, the slack at the
            reserved peak (bytes).
        expandable: the same replay with ``expandable_segments:True`` (a what-if; None when ``conf`` sets it already).
        allocations: allocations replayed.
        workspace_bytes: the libraries' workspaces among them (cuBLAS's; cuDNN attention's backward), in bytes, sized
            as ``workspace_method`` says.
    """

    conf: str
    steps: tuple[Window, ...]
    expandable: tuple[Window, ...] | None
    allocations: int
    workspace_bytes: int = 0
    workspace_method: str = ""

    @property
    def conf_expandable(self) -> bool:
        """Whether the configuration planned under sets ``expandable_segments:True``."""
        return AllocConf.parse(self.conf).expandable_segments

    @property
    def steady(self) -> Window:
        """The last step's window: the steady state every later step repeats."""
        return self.steps[-1]

    @property
    def peak_reserved(self) -> int:
        """The largest reserved over the steps (bytes): reserved never shrinks in a step's replay."""
        return max(w.peak_reserved for w in self.steps)

    @property
    def expandable_peak_reserved(self) -> int | None:
        """The largest reserved over the steps with ``expandable_segments:True`` (None: not planned)."""
        return None if self.expandable is None else max(w.peak_reserved for w in self.expandable)

    def expandable_saving(self) -> int | None:
        """Bytes ``expandable_segments:True`` would save at the peak reserved (None: not planned)."""
        grown = self.expandable_peak_reserved
        return None if grown is None else self.peak_reserved - grown

    def to_json(self) -> dict[str, Any]:
        def windows(ws: tuple[Window, ...]) -> list[dict[str, Any]]:
            return [{"name": w.name, "peak_allocated_bytes": w.peak_allocated, "peak_reserved_bytes": w.peak_reserved,
                     "slack_bytes": w.slack_at_peak, "peak_requested_bytes": w.peak_requested,
                     "fragmentation": round(w.fragmentation, 4),
                     **({"at_peak": {f"{k}_bytes" if not k.endswith("_segments") else k: v
                                     for k, v in dataclasses.asdict(w.at_peak).items()}}
                        if w.at_peak is not None else {})} for w in ws]

        out: dict[str, Any] = {
            "status": "estimated",
            "method": "the traced steps' allocations and frees (in order, one per tensor storage) replayed through "
                      "PyTorch's CUDA caching allocator's rules (core/plan/allocator.py, docs/allocator.md)",
            "alloc_conf": self.conf, "allocations": self.allocations, "steps": windows(self.steps),
            "workspace_bytes": self.workspace_bytes, "workspace_method": self.workspace_method}
        if self.expandable is not None:
            out["expandable_segments"] = {"steps": windows(self.expandable),
                                          "peak_reserved_bytes": self.expandable_peak_reserved}
        return out


def reserved_from_json(data: dict[str, Any] | None) -> ReservedPrediction | None:
    """The inverse of :meth:`ReservedPrediction.to_json` (None for None)."""
    if not data:
        return None

    def windows(rows: list[dict[str, Any]]) -> tuple[Window, ...]:
        return tuple(Window(str(r["name"]), int(r["peak_allocated_bytes"]), int(r["peak_reserved_bytes"]),
                            int(r["slack_bytes"]), int(r.get("peak_requested_bytes", 0)),
                            PoolState(**{k.removesuffix("_bytes"): int(v) for k, v in r["at_peak"].items()})
                            if "at_peak" in r else None) for r in rows)

    grown = data.get("expandable_segments")
    return ReservedPrediction(str(data["alloc_conf"]), windows(data["steps"]),
                              windows(grown["steps"]) if grown else None, int(data["allocations"]),
                              int(data.get("workspace_bytes", 0)), str(data.get("workspace_method", "")))


def predict_reserved(events: list[tuple[str, Any, int]], conf_text: str, workspace_bytes: int = 0,
                     workspace_method: str = "") -> ReservedPrediction:
    """Replay the recorded ``events`` under ``conf_text`` (and, unless it sets them, expandable segments).

    Raises:
        SpecError: ``conf_text`` is not an allocator configuration PyTorch accepts."""
    conf = AllocConf.parse(conf_text)
    allocations = sum(1 for e in events if e[0] == "alloc")
    steps = replay(events, conf).windows
    expandable = None if conf.expandable_segments else \
        replay(events, dataclasses.replace(conf, expandable_segments=True)).windows
    return ReservedPrediction(conf_text, steps, expandable, allocations, workspace_bytes, workspace_method)


@dataclass(frozen=True)
class LineDifference:
    """One component of the analytic plan against the traced one (bytes; ``relative`` = (traced - analytic) / analytic,
    ``None`` when the analytic line is 0)."""

    component: str
    analytic_bytes: int
    traced_bytes: int

    @property
    def difference_bytes(self) -> int:
        return self.traced_bytes - self.analytic_bytes

    @property
    def relative(self) -> float | None:
        return None if self.analytic_bytes == 0 else self.difference_bytes / self.analytic_bytes


@dataclass(frozen=True)
class PlanDifference:
    """The analytic plan of one device beside the traced plan.

    Attributes:
        lines: one :class:`LineDifference` per traced component: its largest value over the phases, analytic vs traced.
        most_different: the component with the largest absolute difference in bytes.
        analytic_tensor_bytes: the analytic peak of the step without its overhead line (the trace has none).
        traced_peak_bytes: the traced peak.
        note: what the comparison does not cover (the overhead line).
        phases: per phase (:data:`PHASES`), the analytic phase's tensor bytes vs the traced phase's peak.
        analytic_peak_phase: the phase the analytic peak is in.
    """

    lines: list[LineDifference]
    most_different: str
    analytic_tensor_bytes: int
    traced_peak_bytes: int
    note: str
    phases: list[LineDifference] = field(default_factory=list)
    analytic_peak_phase: str = ""
    overhead_bytes: int = 0
    overhead_text: str = ""

    @property
    def relative(self) -> float | None:
        """(traced peak - analytic tensor peak) / analytic tensor peak."""
        if not self.analytic_tensor_bytes:
            return None
        return (self.traced_peak_bytes - self.analytic_tensor_bytes) / self.analytic_tensor_bytes


def relative_text(analytic: int, traced: int) -> str:
    """(traced - analytic) / analytic as ``+12.0%``; ``n/a`` when only the trace has bytes, empty when both are 0."""
    if analytic:
        return f"{(traced - analytic) / analytic:+.1%}"
    return "n/a" if traced else ""


def compare(device_plan: Any, traced: TracedPlan) -> PlanDifference:
    """The analytic ``device_plan`` (:class:`core.plan.memory.DevicePlan`) against ``traced``: each component's largest value
    over the phases, each phase's bytes, and the peaks. The analytic side leaves out what a trace cannot see
    (``untraced_bytes``: the overhead line, and under DDP the gradient buckets, which sit in its temporaries).

    The most different line is the one with the largest absolute byte difference (ties: the first in
    :data:`TRACED_COMPONENTS`).
    """
    untraced = getattr(device_plan, "untraced_bytes", 0) or device_plan.lines["overhead"].bytes
    buckets = untraced - device_plan.lines["overhead"].bytes  # DDP's, in every phase's temporaries
    maxima = traced.maxima
    lines = [LineDifference(name, int(device_plan.lines[name].bytes) - (buckets if name == "temporaries" else 0),
                            int(maxima.get(name, 0)))
             for name in TRACED_COMPONENTS]
    most = max(lines, key=lambda d: abs(d.difference_bytes))
    phases = [LineDifference(name, device_plan.phases[name].total_bytes - untraced, sum(traced.phases[name].values()))
              for name in PHASES if name in device_plan.phases and name in traced.phases]
    note = ("Both totals are the peak of the step (its largest phase); each line is its component's largest value over "
            "the phases. What a trace cannot see is left out of the analytic side: the overhead line (the CUDA "
            "context is not a tensor)" + (f" and DDP's gradient buckets ({buckets:,} B)" if buckets else "") + ".")
    peak_phase = device_plan.peak_phase.name if device_plan.peak_phase else ""
    return PlanDifference(lines, most.component, device_plan.total_bytes - untraced, traced.peak_bytes, note, phases,
                          peak_phase,
                          int(device_plan.lines["overhead"].bytes), device_plan.lines["overhead"].method)


# ------------------------------------------------------------------------------------------------------------ helpers


#: Strategies whose device holds the whole step, so one traced step is the device's step (a DDP replica adds its
#: gradient buckets, which the analytic plan shows under temporaries).
TRACEABLE_STRATEGIES = ("single", "ddp")


def untraceable_reason(plan: Any, spec: RunSpec | None = None) -> str | None:
    """Why ``plan`` (:class:`core.plan.memory.MemoryPlan`) of ``spec`` has no traced plan, or None when it can have one."""
    if spec is not None and spec.method.quantised:
        return ("the traced plan builds the model on meta tensors without bitsandbytes' 4-bit layers; qlora's base is "
                "planned from the 4-bit layout (core/plan/quant.py) and measured by the probe")
    if spec is not None and spec.training and not spec.optimizer_kind.traceable:
        return spec.optimizer_kind.untraced
    beyond = spec.beyond_own_recipe() if spec is not None and spec.training else None
    if beyond is not None:
        return (f"the traced plan steps gpuaccept's own recipe (SFT, the standard cross-entropy, eager); {beyond[1]} "
                f"({beyond[0]}) is planned analytically only")
    if plan.strategy in TRACEABLE_STRATEGIES:
        return None
    return (f"the traced plan covers one device holding the whole step (strategy single or ddp); strategy "
            f"{plan.strategy} is planned analytically only")


def comparison_json(traced: TracedPlan, difference: PlanDifference, device_name: str) -> dict[str, Any]:
    """The traced plan and its comparison, JSON-ready (``gpuaccept plan --traced --json`` and the record)."""
    out = traced.to_json()
    out["compared_with"] = device_name
    out["most_different"] = difference.most_different
    out["analytic_tensor_bytes"] = int(difference.analytic_tensor_bytes)
    out["lines"] = {d.component: {"analytic_bytes": d.analytic_bytes, "traced_bytes": d.traced_bytes}
                    for d in difference.lines}
    out["phase_totals"] = {d.component: {"analytic_bytes": d.analytic_bytes, "traced_bytes": d.traced_bytes}
                           for d in difference.phases}
    out["analytic_peak_phase"] = difference.analytic_peak_phase
    out["note"] = difference.note
    if traced.reserved is not None and device_name.startswith("cuda"):  # a CPU device has no caching allocator
        out["device_memory"] = device_memory(traced.reserved, difference.overhead_bytes, difference.overhead_text)
    return out


def device_memory(reserved: ReservedPrediction, overhead_bytes: int, overhead_text: str) -> dict[str, Any]:
    """The device's memory as the three counters show it, predicted for the steady-state step (bytes): peak allocated
    (``max_memory_allocated``: whole blocks), peak reserved (``max_memory_reserved``), and NVML's used (reserved + what
    lies outside the allocator: the plan's overhead line), each with its method; and the slack, line by line."""
    steady = reserved.steady
    lines = steady.at_peak.slack_lines(reserved.conf_expandable) if steady.at_peak is not None else []
    return {
        "status": "estimated",
        "allocated_bytes": steady.peak_allocated, "reserved_bytes": reserved.peak_reserved,
        "nvml_used_bytes": reserved.peak_reserved + overhead_bytes,
        "methods": {
            "allocated": "the traced steady-state step's allocations replayed: blocks of 512 B multiples, a large "
                         "block handed out whole when 1 MiB or less would remain"
                         + (f"; with the libraries' workspaces, {reserved.workspace_bytes / 2**20:.3g} MiB "
                            f"({reserved.workspace_method})" if reserved.workspace_bytes else ""),
            "reserved": "the same replay through the caching allocator's segments and best fit (docs/allocator.md)"
                        + (f" under {reserved.conf}" if reserved.conf else ", PyTorch's defaults"),
            "nvml_used": f"reserved + the overhead line: {overhead_text}"},
        "slack": [{"what": what, "bytes": n} for what, n in lines],
        "first_step": {"allocated_bytes": reserved.steps[0].peak_allocated,
                       "reserved_bytes": reserved.steps[0].peak_reserved} if len(reserved.steps) > 1 else {},
        **({"expandable_segments_reserved_bytes": reserved.expandable_peak_reserved}
           if reserved.expandable is not None else {}),
    }


def traced_from_json(data: dict[str, Any]) -> TracedPlan:
    """The inverse of :meth:`TracedPlan.to_json` (per-module peaks are not carried)."""
    return TracedPlan(components={k: int(v) for k, v in data["components"].items()}, peak_bytes=int(data["peak_bytes"]),
                      categories={k: int(v) for k, v in data["categories"].items()}, method=str(data["method"]),
                      seconds=float(data["seconds"]), tensors=str(data["tensors"]),
                      phases={p: {k: int(v) for k, v in c.items()} for p, c in data.get("phases", {}).items()},
                      reserved=reserved_from_json(data.get("reserved")))


def config_json(config: Any) -> dict[str, Any]:
    """``config`` as JSON for the traced plan's child: a :class:`core.plan.shapes.FastConfig`'s config.json as read
    (``{"fast": ...}``), or every value of a ``transformers.PretrainedConfig`` (``{"transformers": ...}``);
    :func:`config_from_json` reads it back."""
    import json

    from core.plan.shapes import FastConfig

    if isinstance(config, FastConfig):
        return {"fast": dict(config.raw)}
    return {"transformers": json.loads(config.to_json_string(use_diff=False))}


def config_from_json(data: dict[str, Any]) -> Any:
    """The config :func:`config_json` wrote, of the same class with the same values."""
    from core.plan.shapes import FastConfig

    if "fast" in data:
        return FastConfig(dict(data["fast"]))
    from transformers import AutoConfig

    return AutoConfig.for_model(**data["transformers"])


def trace_in_child(spec: RunSpec, config: Any, target: str, cancelled: Any = None, timeout_s: float = 600.0,
                   workspaces: tuple[int, ...] = (), workspace_method: str = "") -> TracedPlan:
    """Run :func:`trace_plan` in a child process (``python -P -m core.plan.tracer``), so the wizard stays responsive and a
    crash in a model's code cannot take the caller down; the child traces ``config``, the config the caller resolved
    (:func:`core.prerun.make_plan`), written beside the spec (:func:`config_json`): the plan resolves no model.

    Args:
        config: the model's config (a ``transformers.PretrainedConfig`` or a :class:`core.plan.shapes.FastConfig`).
        cancelled: polled twice a second; when it returns True the child's process group is killed.
        workspaces, workspace_method: as :func:`trace_plan`'s.

    Raises:
        GpuAcceptError: the child failed (its last stderr lines are in the message), timed out or was cancelled.
    """
    import json
    import os
    import subprocess
    import tempfile
    from pathlib import Path

    from core import forkserver
    from core.errors import GpuAcceptError, StageCancelled
    from core.interpreter import child_env, python_argv
    from core.procgroup import end_group

    with tempfile.TemporaryDirectory(prefix="gpuaccept-trace-") as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w", encoding="utf-8") as fh:
            json.dump(spec.to_dict(), fh)
        config_path = os.path.join(tmp, "config.json")
        with open(config_path, "w", encoding="utf-8") as fh:
            json.dump(config_json(config), fh)
        out_path, err_path = os.path.join(tmp, "traced.json"), os.path.join(tmp, "stderr.log")
        argv = [spec_path, "--config", config_path, "--target", target, "--out", out_path, "--orphan-cleanup", tmp,
                *(f"--workspace={n}" for n in workspaces), f"--workspace-method={workspace_method}"]
        # gpuaccept's pid: the child ends itself and removes `tmp` if this process is killed (core.protocol.lifeline)
        env = {**child_env(), "TRANSFORMERS_VERBOSITY": "error"}
        child: Any = forkserver.start("core.plan.tracer", argv, Path(err_path), env)
        with open(err_path, "a", encoding="utf-8") as err:
            if child is None:  # no fork server here: a fresh interpreter
                child = subprocess.Popen(python_argv("core.plan.tracer", *argv), stdout=subprocess.DEVNULL,
                                         stderr=err, start_new_session=True, env=env)
            started = time.monotonic()
            try:
                while child.poll() is None:
                    if cancelled is not None and cancelled():
                        raise StageCancelled("the trace was cancelled")
                    if time.monotonic() - started > timeout_s:
                        raise GpuAcceptError(f"the trace took longer than {timeout_s:.0f} s and was stopped")
                    time.sleep(0.5)
            finally:
                end_group(child)
        if child.returncode != 0 or not os.path.exists(out_path):
            with open(err_path, encoding="utf-8", errors="replace") as fh:
                tail = " | ".join(line.strip() for line in fh.read().strip().splitlines()[-3:])
            raise GpuAcceptError(f"the trace failed (exit {child.returncode}): {tail}")
        with open(out_path, encoding="utf-8") as fh:
            return traced_from_json(json.load(fh))


def workspaces_of(spec: RunSpec, device: Any, config: Any = None) -> tuple[tuple[int, ...], str]:
    """cuBLAS's workspace blocks on ``device`` (:class:`core.plan.devices.DeviceInfo`) for ``spec``, and how they were
    sized (:func:`core.plan.workspace.cublas_workspaces`, with this process's torch and environment), with cuDNN
    attention's backward workspace when ``config`` (the model's, for its heads) is given and the step reaches it
    (:func:`core.plan.workspace.cudnn_attention_workspace`); none on the CPU."""
    import importlib.metadata
    import os

    from core.plan.workspace import cublas_workspaces, cudnn_attention_workspace

    if device.kind != "cuda":
        return (), ""
    blocks, how = cublas_workspaces(device.label, spec.training, importlib.metadata.version("torch"), os.environ)
    if config is not None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config  # a composite model's LM
        heads = int(text.num_attention_heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
        cudnn, why = cudnn_attention_workspace(device.label, spec.training, spec.attn_implementation, spec.dtype,
                                               spec.batch_size, heads, spec.seq_len, head_dim, os.environ)
        blocks, how = blocks + ([cudnn] if cudnn else []), f"{how}; {why}"
    return tuple(blocks), how


def traced_table(spec: RunSpec, ctx: Any, cancelled: Any = None) -> dict[str, Any]:
    """The traced plan of ``spec`` compared with ``ctx.plan`` (:class:`core.prerun.PlanContext`), JSON-ready for the
    record and the screens; ``{"status": "not_run" | "cancelled" | "error", "reason": ...}`` when there is none."""
    from core.errors import GpuAcceptError
    from core.status import Stopped

    plan = ctx.plan
    reason = untraceable_reason(plan, spec)
    if reason is not None:
        return {"status": "not_run", "reason": reason}
    device = plan.devices[0]
    try:
        blocks, how = workspaces_of(spec, device.device, ctx.config)
        traced = trace_in_child(spec, ctx.config, device.device.kind, cancelled, workspaces=blocks,
                                workspace_method=how)
    except GpuAcceptError as exc:
        return {"status": str(Stopped.of(exc).status), "reason": str(exc)}
    return comparison_json(traced, compare(device, traced), device.device.name)
