"""The fit search: per device, the largest micro-batch or sequence length whose plan fits it (``gpuaccept plan
--max-batch`` / ``--max-seq``, the plan screen's largest micro-batch).

Fit is judged by the one rule of :mod:`core.plan.fit` (:func:`core.plan.fit.fits_in`, :func:`core.plan.fit.fit_of`);
this module plans (:func:`core.plan.memory.plan_memory`) at each value it tries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from core.plan.fit import TRACED_FIT_STRATEGIES, fit_of, fits_in
from core.plan.memory import plan_memory

#: below this share of a device's capacity left, a largest fit is said to be thin (screens and `plan --max-batch`)
THIN_HEADROOM = 0.05
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
        if not fits_in(totals(floor)[i], capacity):
            out.append(Largest(device.name, axis, 0, 0, capacity, f"not even {floor} fits"))
            continue
        good, bad = floor, None
        probe = max(floor, min(getattr(spec, axis), ceiling))
        while bad is None:  # double until a value does not fit (or the ceiling fits)
            if fits_in(totals(probe)[i], capacity):
                good = probe
                if probe >= ceiling:
                    break
                probe = min(probe * 2, ceiling)
            else:
                bad = probe
        while bad is not None and bad - good > 1:
            middle = (good + bad) // 2
            if fits_in(totals(middle)[i], capacity):
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
