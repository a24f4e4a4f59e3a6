"""Does the plan fit, and did the probe measure more than it planned: one home for both rules.

- **The rule itself** is :func:`fits_in`: bytes <= capacity, and no verdict (None) when the capacity is unknown;
  :func:`all_fit` says a set of devices fits (a device of unknown capacity does not count against it). Every module
  that judges a fit (the plan's devices, the record, ``gpuaccept verify``, the probe, the quiz, the screens) calls
  them; none compares bytes with a capacity itself. The search for the largest micro-batch or sequence length that
  fits is :mod:`core.plan.search` (it plans, so it imports :mod:`core.plan.memory`; this module imports no plan).
- **Fit** is judged per device (a server's total memory is not a placement: case P5) by the larger of the analytic
  peak and the traced peak when a traced plan exists (plus what a trace cannot see: the CUDA context and DDP's
  gradient buckets), and says which one it used. A plan that fits only by the smaller of two estimates is not a fit.
- **Under-estimate**: a measured peak more than :data:`UNDER_ESTIMATE_TOLERANCE` above the plan it was judged by
  (its tensors: peak allocated on CUDA holds no CUDA context; the CPU's live tensors none either) is named as such in
  the probe's verdict and the record. The plan is an estimate, not a bound; this is how a reader learns it was low.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

#: A measured peak above the plan by more than this fraction is an under-estimate (named, not hidden).
UNDER_ESTIMATE_TOLERANCE = 0.05
#: The word a probe's finding of an under-estimate starts with after its device (verify looks for it).
UNDER_ESTIMATE_WORD = "UNDER-ESTIMATE"
#: Strategies whose every device holds the whole step, so the traced step (one device) applies to each of them.
TRACED_FIT_STRATEGIES = ("single", "ddp")


@dataclass(frozen=True)
class Fit:
    """The fit verdict of one device.

    Attributes:
        device: its name.
        capacity_bytes: what it holds (None: unknown).
        analytic_bytes: the analytic plan's peak of the step (overhead included).
        traced_bytes: the traced peak plus what a trace cannot see (overhead, DDP buckets); None without a trace.
        bytes: the largest of the estimates: what the fit is judged by.
        judged_by: ``"analytic"``, ``"traced"`` or ``"reserved"`` (the predicted NVML used).
        fits: ``bytes <= capacity_bytes``; None when the capacity is unknown.
        tensor_bytes: the larger of the analytic and traced peaks (with the overhead): what a probe's peak
            allocated is compared with (its tensors, without the overhead).
        device_bytes: the traced step's predicted peak reserved (the caching allocator's, core/plan/allocator.py)
            with what a trace cannot see: the predicted NVML used; None without a trace on a CUDA device.
    """

    device: str
    capacity_bytes: int | None
    analytic_bytes: int
    traced_bytes: int | None
    bytes: int
    judged_by: str
    fits: bool | None
    tensor_bytes: int = 0
    device_bytes: int | None = None

    @property
    def untraced_note(self) -> str:
        """Which estimate the fit used, in words."""
        if self.traced_bytes is None:
            return "judged by the analytic plan (no traced plan)"
        if self.judged_by == "reserved":
            return (f"judged by the predicted NVML used (the caching allocator's reserved + the overhead line), the "
                    f"largest ({_gib(self.bytes)} vs tensors {_gib(self.tensor_bytes)})")
        other = self.analytic_bytes if self.judged_by == "traced" else self.traced_bytes
        return (f"judged by the {self.judged_by} plan, the larger ({_gib(self.bytes)} vs {_gib(other)} "
                f"{'analytic' if self.judged_by == 'traced' else 'traced'})")


def fits_in(needed_bytes: int, capacity_bytes: int | None) -> bool | None:
    """The fit rule: ``needed_bytes <= capacity_bytes``, or None (no verdict) when the capacity is unknown.

    Args:
        needed_bytes: what must fit on one device, in bytes (a plan's peak, or a probe's measured use).
        capacity_bytes: what that device holds, in bytes; None when it cannot be known.
    """
    return None if capacity_bytes is None else needed_bytes <= capacity_bytes


def measured_use_bytes(device: str, peak_bytes: int, peak_rss_bytes: int) -> int:
    """What a probed device's fit is judged by, in bytes: the peak allocated on CUDA (``device`` ``cuda:N``); on the
    CPU the larger of the tensor peak and the process's peak RSS (the whole process competes for host memory, runtime
    included). The probe (:func:`core.stages.probe.measured_use`) and ``gpuaccept verify`` both use it."""
    return peak_bytes if device.startswith("cuda") else max(peak_bytes, peak_rss_bytes)


def all_fit(verdicts: Iterable[Fit | bool | None]) -> bool:
    """Every device fits: no verdict is False (a device of unknown capacity, None, does not count against it).

    Args:
        verdicts: per device a :class:`Fit` or the ``fits`` value itself (True, False, None).
    """
    return all((v.fits if isinstance(v, Fit) else v) is not False for v in verdicts)


def traced_peak(traced: dict[str, Any] | None) -> int | None:
    """The traced peak of tensor bytes of a traced table (:func:`core.plan.traced.comparison_json`), or None when the table
    holds no trace (not run, cancelled, error)."""
    if not traced or traced.get("status") != "estimated":
        return None
    return int(traced["peak_bytes"])


def traced_reserved(traced: dict[str, Any] | None) -> int | None:
    """The caching allocator's predicted peak reserved of a traced table on a CUDA device (its ``device_memory``), or
    None (no trace, or a CPU device)."""
    if traced_peak(traced) is None or not traced or not traced.get("device_memory"):
        return None
    return int(traced["device_memory"]["reserved_bytes"])


def fit_of(name: str, capacity: int | None, analytic: int, untraced: int, traced: int | None,
           strategy: str, reserved: int | None = None) -> Fit:
    """The fit of one device from plain numbers (what :func:`fit_verdicts` and ``gpuaccept verify`` both use): the
    larger of the analytic peak and the traced one (tensors, with what a trace cannot see), and on a CUDA device with
    a trace the predicted NVML used (the allocator's ``reserved`` with the same) when that is larger still."""
    with_trace = traced + untraced if traced is not None and strategy in TRACED_FIT_STRATEGIES else None
    tensors_by = "traced" if with_trace is not None and with_trace > analytic else "analytic"
    tensors = with_trace if tensors_by == "traced" and with_trace is not None else analytic
    device = reserved + untraced if reserved is not None and with_trace is not None else None
    judged_by, used = ("reserved", device) if device is not None and device > tensors else (tensors_by, tensors)
    return Fit(name, capacity, analytic, with_trace, used, judged_by, fits_in(used, capacity), tensors, device)


def fit_verdicts(plan: Any, traced: dict[str, Any] | None = None) -> list[Fit]:
    """One :class:`Fit` per device of ``plan`` (:class:`core.plan.memory.MemoryPlan`), with the traced table when there is
    one (it covers one device holding the whole step: strategies single and ddp)."""
    peak, reserved = traced_peak(traced), traced_reserved(traced)
    return [fit_of(d.device.name, d.device.capacity_bytes, d.total_bytes, d.untraced_bytes, peak, plan.strategy,
                   reserved) for d in plan.devices]


def plan_fits(plan: Any, traced: dict[str, Any] | None = None) -> bool:
    """Every device fits (a device of unknown capacity does not count against it), judged by :func:`fit_verdicts`."""
    return all_fit(fit_verdicts(plan, traced))


def under_estimate(planned_bytes: int, measured_bytes: int) -> float | None:
    """(measured - planned) / planned when the measurement is above the plan by more than the tolerance, else None."""
    if planned_bytes <= 0:
        return None
    over = (measured_bytes - planned_bytes) / planned_bytes
    return over if over > UNDER_ESTIMATE_TOLERANCE else None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
