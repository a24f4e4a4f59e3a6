"""Does the plan fit, and did the probe measure more than it planned: one home for both rules.

- **Fit** is judged per device (a server's total memory is not a placement: case P5) by the larger of the analytic
  peak and the traced peak when a traced plan exists (plus what a trace cannot see: the CUDA context and DDP's
  gradient buckets), and says which one it used. A plan that fits only by the smaller of two estimates is not a fit.
- **Under-estimate**: a measured peak more than :data:`UNDER_ESTIMATE_TOLERANCE` above the plan it was judged by
  (its tensors: peak allocated on CUDA holds no CUDA context; the CPU's live tensors none either) is named as such in
  the probe's verdict and the record. The plan is an estimate, not a bound; this is how a reader learns it was low.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: A measured peak above the plan by more than this fraction is an under-estimate (named, not hidden).
UNDER_ESTIMATE_TOLERANCE = 0.05
#: below this share of a device's capacity left, a largest fit is said to be thin (screens and `plan --max-batch`)
THIN_HEADROOM = 0.05
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
        bytes: the larger of the two: what the fit is judged by.
        judged_by: ``"analytic"`` or ``"traced"``.
        fits: ``bytes <= capacity_bytes``; None when the capacity is unknown.
    """

    device: str
    capacity_bytes: int | None
    analytic_bytes: int
    traced_bytes: int | None
    bytes: int
    judged_by: str
    fits: bool | None

    @property
    def untraced_note(self) -> str:
        """Which estimate the fit used, in words."""
        if self.traced_bytes is None:
            return "judged by the analytic plan (no traced plan)"
        other = self.analytic_bytes if self.judged_by == "traced" else self.traced_bytes
        return (f"judged by the {self.judged_by} plan, the larger ({_gib(self.bytes)} vs {_gib(other)} "
                f"{'analytic' if self.judged_by == 'traced' else 'traced'})")


def traced_peak(traced: dict[str, Any] | None) -> int | None:
    """The traced peak of tensor bytes of a traced table (:func:`core.plan.traced.comparison_json`), or None when the table
    holds no trace (not run, cancelled, error)."""
    if not traced or traced.get("status") != "estimated":
        return None
    return int(traced["peak_bytes"])


def fit_of(name: str, capacity: int | None, analytic: int, untraced: int, traced: int | None,
           strategy: str) -> Fit:
    """The fit of one device from plain numbers (what :func:`fit_verdicts` and ``gpuaccept verify`` both use)."""
    with_trace = traced + untraced if traced is not None and strategy in TRACED_FIT_STRATEGIES else None
    judged_by = "traced" if with_trace is not None and with_trace > analytic else "analytic"
    used = with_trace if judged_by == "traced" and with_trace is not None else analytic
    return Fit(name, capacity, analytic, with_trace, used, judged_by, None if capacity is None else used <= capacity)


def fit_verdicts(plan: Any, traced: dict[str, Any] | None = None) -> list[Fit]:
    """One :class:`Fit` per device of ``plan`` (:class:`core.plan.memory.MemoryPlan`), with the traced table when there is
    one (it covers one device holding the whole step: strategies single and ddp)."""
    peak = traced_peak(traced)
    return [fit_of(d.device.name, d.device.capacity_bytes, d.total_bytes, d.untraced_bytes, peak, plan.strategy)
            for d in plan.devices]


def plan_fits(plan: Any, traced: dict[str, Any] | None = None) -> bool:
    """Every device fits (a device of unknown capacity does not count against it)."""
    return all(f.fits is not False for f in fit_verdicts(plan, traced))


def under_estimate(planned_bytes: int, measured_bytes: int) -> float | None:
    """(measured - planned) / planned when the measurement is above the plan by more than the tolerance, else None."""
    if planned_bytes <= 0:
        return None
    over = (measured_bytes - planned_bytes) / planned_bytes
    return over if over > UNDER_ESTIMATE_TOLERANCE else None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


#: The fit search's axes: the micro-batch and the sequence length.
SEARCH_AXES = ("batch_size", "seq_len")
#: The largest value the search tries on an axis without a model limit (a micro-batch of a million sequences).
SEARCH_CEILING = 2**20


@dataclass(frozen=True)
class Largest:
    """The largest value of one setting whose plan fits one device, the rest of the spec unchanged.

    Attributes:
        device: its name.
        axis: ``batch_size`` (the micro-batch) or ``seq_len``.
        value: the largest value that fits; 0 when not even 1 (2 tokens for ``seq_len``) fits; None when the device's
            capacity is unknown.
        plan_bytes: the plan's peak at ``value`` (0 without one).
        capacity_bytes: the device's capacity.
        limit: why it stops there: the next value does not fit, or the model's ``max_position_embeddings``, or the
            search's ceiling.
    """

    device: str
    axis: str
    value: int | None
    plan_bytes: int
    capacity_bytes: int | None
    limit: str

    @property
    def headroom_bytes(self) -> int | None:
        """Capacity left at ``value`` (None when unknown or nothing fits)."""
        if self.capacity_bytes is None or not self.value:
            return None
        return self.capacity_bytes - self.plan_bytes

    @property
    def thin(self) -> bool:
        """Under :data:`THIN_HEADROOM` of the capacity is left: a little less free memory (or the caching allocator's
        rounding on CUDA) and it does not fit."""
        headroom = self.headroom_bytes
        return headroom is not None and self.capacity_bytes is not None and \
            headroom < THIN_HEADROOM * self.capacity_bytes


def largest_fitting(spec: Any, config: Any, devices: list[Any], axis: str, max_positions: int | None = None,
                    trace: Callable[[Any], int] | None = None) -> list[Largest]:
    """Per device, the largest ``axis`` value (micro-batch or sequence length) whose plan fits it.

    The plan's peak grows with the micro-batch and the sequence length (every term is non-decreasing in both), so the
    search doubles from the spec's value until a plan does not fit, then bisects: about 2 log2(value) plans, each a
    few milliseconds (the model summary is built once). With ``trace`` (a spec -> traced peak of tensor bytes, seconds
    each) the value found is then checked as the fit is judged, by the larger of the analytic and traced peaks
    (strategies single and ddp), and bisected down with traces while it does not fit: a model without an op-by-op
    activation model (Korthikanti's approximation) can be well below its trace.

    Args:
        spec: the run (:class:`core.spec.RunSpec`); every other setting is kept.
        config: the model's config.
        devices: the devices planned (:func:`core.plan.memory.detect_devices`).
        axis: ``batch_size`` or ``seq_len``.
        max_positions: the model's declared ``max_position_embeddings`` (the ceiling of ``seq_len``), or None.

    Raises:
        ValueError: ``axis`` is not one of :data:`SEARCH_AXES`.
    """
    import dataclasses

    from core.plan.memory import plan_memory

    if axis not in SEARCH_AXES:
        raise ValueError(f"axis must be one of {SEARCH_AXES}, got {axis!r}")
    floor = 2 if axis == "seq_len" else 1
    ceiling = max_positions if axis == "seq_len" and max_positions else SEARCH_CEILING
    cache: dict[int, list[int]] = {}

    def totals(value: int) -> list[int]:
        if value not in cache:
            plan = plan_memory(dataclasses.replace(spec, **{axis: value}), config, devices)
            cache[value] = [d.total_bytes for d in plan.devices]
        return cache[value]

    out = []
    for i, device in enumerate(devices):
        capacity = device.capacity_bytes
        if capacity is None:
            out.append(Largest(device.name, axis, None, 0, None, "its capacity is unknown"))
            continue
        if totals(floor)[i] > capacity:
            out.append(Largest(device.name, axis, 0, 0, capacity, f"not even {floor} fits"))
            continue
        good, bad = floor, None
        probe = max(floor, min(getattr(spec, axis), ceiling))
        while bad is None:  # double until a value does not fit (or the ceiling fits)
            if totals(probe)[i] <= capacity:
                good = probe
                if probe >= ceiling:
                    break
                probe = min(probe * 2, ceiling)
            else:
                bad = probe
        while bad is not None and bad - good > 1:
            middle = (good + bad) // 2
            if totals(middle)[i] <= capacity:
                good = middle
            else:
                bad = middle
        if bad is not None:
            limit = f"{axis} = {bad} does not fit"
        elif axis == "seq_len" and max_positions:
            limit = f"the model's max_position_embeddings ({max_positions})"
        else:
            limit = f"the search's ceiling ({ceiling:,})"
        out.append(Largest(device.name, axis, good, totals(good)[i], capacity, limit))
    if trace is not None and plan_memory(spec, config, devices).strategy in TRACED_FIT_STRATEGIES:
        out = [_refined(row, i, spec, config, devices, axis, floor, trace, cache) for i, row in enumerate(out)]
    return out


def _refined(row: Largest, index: int, spec: Any, config: Any, devices: list[Any], axis: str, floor: int,
             trace: Callable[[Any], int], cache: dict[int, list[int]]) -> Largest:
    """``row`` checked against the traced plan: the largest value whose larger-of-the-two plan fits (bisection with
    traces, at most log2(value) of them)."""
    import dataclasses

    from core.plan.memory import plan_memory

    if not row.value:
        return row
    traced: dict[int, int] = {}

    def fit_at(value: int) -> tuple[bool, int]:
        candidate = dataclasses.replace(spec, **{axis: value})
        device = plan_memory(candidate, config, devices).devices[index]
        if value not in traced:
            traced[value] = trace(candidate)
        fit = fit_of(device.device.name, device.device.capacity_bytes, device.total_bytes, device.untraced_bytes,
                     traced[value], "single")
        return bool(fit.fits), fit.bytes

    ok, used = fit_at(row.value)
    if ok:
        return dataclasses.replace(row, plan_bytes=used, limit=row.limit + "; the traced plan agrees")
    good, bad, used_good = 0, row.value, 0
    while bad - good > 1:
        middle = max(floor, (good + bad) // 2)
        fits, used = fit_at(middle)
        if fits:
            good, used_good = middle, used
        else:
            bad = middle
        if middle == floor and not fits:
            break
    return dataclasses.replace(row, value=good, plan_bytes=used_good,
                               limit=f"{axis} = {bad} does not fit by the traced plan (the analytic plan said "
                                     f"{row.value})")
