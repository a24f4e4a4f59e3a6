"""Probe stage: real steps in a child process, a measured ledger per device, compared with the plan.

Everything here is **measured** (from the child's live tensors, the CUDA allocator, or the OS), never estimated; the
comparison with the plan states which measured quantity it compares with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generator

from core.childproc import check_exit, start_child, watch
from core.events import ChildStarted, DeviceBound, Event, Message, Progress
from core.spec import RunSpec


@dataclass(frozen=True)
class DeviceMeasurement:
    """What the probe measured on one device, in bytes.

    ``peak_bytes`` is what is compared with the plan's total: peak allocated on CUDA; on CPU the peak of live tensor
    bytes tracked in the step (the process's peak RSS, which also holds the Python and torch runtime, is kept beside it).
    """

    device: str
    weights_bytes: int
    gradients_bytes: int
    optimizer_states_bytes: int
    peak_bytes: int
    peak_method: str
    peak_reserved_bytes: int | None
    peak_rss_bytes: int
    rss_after_load_bytes: int
    parameters: int
    trainable_parameters: int


@dataclass(frozen=True)
class PlanComparison:
    """Plan vs measurement on one device. ``error_pct`` = 100 x (planned - measured) / measured."""

    device: str
    planned_bytes: int
    measured_bytes: int
    error_pct: float
    compared: str
    components: dict[str, tuple[int, int | None]] = field(default_factory=dict)  # name -> (planned, measured or None)


@dataclass(frozen=True)
class ProbeResult:
    """Outcome of the probe stage. ``status``: pass (ran, fits) | fail (ran, above capacity)."""

    status: str
    steps: int
    step_time_s: float
    tokens_per_s: float
    devices: list[DeviceMeasurement]
    placement: dict[str, dict[str, int]]
    comparisons: list[PlanComparison]
    log_path: str
    summary: str


def run_probe(
    spec: RunSpec, model_path: Path, job_dir: Path, device: str, plan: Any, cancelled=None
) -> Generator[Event, None, ProbeResult]:
    """Run the probe child and yield its progress; return the :class:`ProbeResult`.

    Raises:
        StageError: the child failed (its error and log are named).
    """
    yield Message("probe", text=f"starting the probe child on {device} ({spec.probe_steps} real steps)")
    child = start_child("probe", job_dir, {"role": "probe", "spec": spec.to_dict(), "model_path": str(model_path),
                                           "device": device})
    yield ChildStarted("probe", run="probe", pid=child.proc.pid, log_path=str(child.log_path))
    for event in watch(child, cancelled=cancelled):
        if event["kind"] == "device_uuid":
            yield DeviceBound("probe", device=event["device"], uuid=event["uuid"])
        if event["kind"] == "probe_step":
            yield Progress("probe", run="probe", step=event["step"], total=event["total"])
    check_exit(child)
    by_kind = {e["kind"]: e for e in child.events}
    ledger = by_kind["ledger"]
    placement = by_kind["placement"]["devices"]
    place = placement.get(device, {"parameters": 0, "trainable": 0})
    if device.startswith("cuda"):
        peak, peak_method = ledger["peak_allocated_bytes"], "peak allocated (torch.cuda.max_memory_allocated)"
        reserved = ledger["peak_reserved_bytes"]
    else:
        peak, peak_method = ledger["peak_tracked_tensor_bytes"], ledger["tracked_method"]
        reserved = None
    measurement = DeviceMeasurement(
        device=device,
        weights_bytes=ledger["weights_bytes"],
        gradients_bytes=ledger["gradients_bytes"],
        optimizer_states_bytes=ledger["optimizer_states_bytes"],
        peak_bytes=int(peak),
        peak_method=peak_method,
        peak_reserved_bytes=reserved,
        peak_rss_bytes=ledger["peak_rss_bytes"],
        rss_after_load_bytes=ledger["rss_after_load_bytes"],
        parameters=place["parameters"],
        trainable_parameters=place["trainable"],
    )
    comparisons = [compare_with_plan(plan_device, measurement) for plan_device in plan.devices[:1]]
    capacity = plan.devices[0].device.capacity_bytes if plan.devices else None
    # On the CPU the whole process competes for host memory: judge the fit by its peak RSS (runtime included).
    used = measurement.peak_bytes if device.startswith("cuda") else max(measurement.peak_bytes, measurement.peak_rss_bytes)
    fits = capacity is None or used <= capacity
    status = "pass" if fits else "fail"
    c = comparisons[0] if comparisons else None
    summary = (
        f"{ledger['steps']} steps on {device}, {ledger['step_time_s']:.2f} s/step, "
        f"measured peak {_gib(measurement.peak_bytes)}"
        + (f" vs plan {_gib(c.planned_bytes)} ({c.error_pct:+.1f} %)" if c else "")
    )
    return ProbeResult(
        status=status,
        steps=ledger["steps"],
        step_time_s=ledger["step_time_s"],
        tokens_per_s=ledger["tokens_per_s"],
        devices=[measurement],
        placement=placement,
        comparisons=comparisons,
        log_path=str(child.log_path),
        summary=summary,
    )


def compare_with_plan(plan_device: Any, m: DeviceMeasurement) -> PlanComparison:
    """Compare a device's plan with its measurement, component by component where measured.

    The plan's total excludes nothing; on CPU its ``overhead`` line is 0 (the runtime is not a tensor), so it is compared
    with the tracked tensor peak, not with RSS.
    """
    planned = plan_device.total_bytes
    components = {
        "weights": (plan_device.lines["weights"].bytes, m.weights_bytes),
        "gradients": (plan_device.lines["gradients"].bytes, m.gradients_bytes),
        "optimizer_states": (plan_device.lines["optimizer_states"].bytes, m.optimizer_states_bytes),
    }
    for name, line in plan_device.lines.items():
        components.setdefault(name, (line.bytes, None))
    error = 100.0 * (planned - m.peak_bytes) / m.peak_bytes if m.peak_bytes else 0.0
    return PlanComparison(
        device=m.device,
        planned_bytes=planned,
        measured_bytes=m.peak_bytes,
        error_pct=error,
        compared=f"plan total vs {m.peak_method}",
        components=components,
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
