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
#: The share of a device's capacity a recommended value may plan for when the criteria set no ``max_device_share``
#: below 1: the value that fits with :data:`THIN_HEADROOM` left (:func:`headroom_rule`).
DEFAULT_PLAN_SHARE = 1 - THIN_HEADROOM
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
        recommended: the largest value whose plan leaves the headroom of :func:`headroom_rule` (at most ``share``
            of the capacity): what a screen recommends, since ``value`` may leave almost nothing; 0 when not even
            the floor does, None when the capacity is unknown.
        recommended_bytes: the plan's peak at ``recommended`` (0 without one).
        share: the share of the capacity ``recommended`` may plan for.
        rule: that headroom rule, in words.
    """

    device: str
    axis: str
    value: int | None
    plan_bytes: int
    capacity_bytes: int | None
    limit: str
    recommended: int | None = None
    recommended_bytes: int = 0
    share: float = 1.0
    rule: str = ""

    @property
    def headroom_bytes(self) -> int | None:
        """Capacity left at ``value`` (None when unknown or nothing fits)."""
        if self.capacity_bytes is None or not self.value:
            return None
        return self.capacity_bytes - self.plan_bytes

    @property
    def recommended_headroom_bytes(self) -> int | None:
        """Capacity left at ``recommended`` (None when unknown or nothing leaves the headroom)."""
        if self.capacity_bytes is None or not self.recommended:
            return None
        return self.capacity_bytes - self.recommended_bytes

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
    search doubles from the floor (1, or 2 tokens) until a plan does not fit, then bisects: about 2 log2(value) plans,
    each a few milliseconds (the model summary is built once). It starts from the floor, not from the spec's value,
    so its answer depends on the devices' capacities alone (read once, in ``devices``), never on the micro-batch or
    sequence length being tried: the plan screen's b / B / s / S keys do not move it. Each row also holds the
    recommended value, the largest whose plan leaves the headroom of :func:`headroom_rule`. With ``trace`` (a spec ->
    traced peak of tensor bytes, seconds each) the value found is then checked as the fit is judged, by the larger of
    the analytic and traced peaks
    (strategies single and ddp), and bisected down with traces while it does not fit: a model without an op-by-op
    activation model (Korthikanti's approximation) can be well below its trace.

    Args:
        spec: the run (:class:`core.spec.RunSpec`); every other setting is kept.
        config: the model's config.
        devices: the devices planned (:func:`core.plan.devices.detect_devices`).
        axis: ``batch_size`` or ``seq_len``.
        max_positions: the model's declared ``max_position_embeddings`` (the ceiling of ``seq_len``), or None.

    Raises:
        ValueError: ``axis`` is not one of :data:`SEARCH_AXES`.
    """
    if axis not in SEARCH_AXES:
        raise ValueError(f"axis must be one of {SEARCH_AXES}, got {axis!r}")
    floor = 2 if axis == "seq_len" else 1
    ceiling = max_positions if axis == "seq_len" and max_positions else SEARCH_CEILING
    share, rule = headroom_rule(spec)
    cache: dict[int, list[int]] = {}

    def totals(value: int) -> list[int]:
        if value not in cache:
            plan = plan_memory(dataclasses.replace(spec, **{axis: value}), config, devices)
            cache[value] = [d.total_bytes for d in plan.devices]
        return cache[value]

    def search(i: int, budget: int) -> tuple[int, int | None]:
        """(the largest value whose plan is within ``budget``, the first that is not or None): doubling from the
        floor, then bisecting, so the answer depends on the budget alone, never on the spec's current value."""
        good, bad, probe = floor, None, floor
        while bad is None:  # double until a value does not fit (or the ceiling fits)
            if fits_in(totals(probe)[i], budget):
                good = probe
                if probe >= ceiling:
                    break
                probe = min(probe * 2, ceiling)
            else:
                bad = probe
        while bad is not None and bad - good > 1:
            middle = (good + bad) // 2
            if fits_in(totals(middle)[i], budget):
                good = middle
            else:
                bad = middle
        return good, bad

    out = []
    for i, device in enumerate(devices):
        capacity = device.capacity_bytes
        if capacity is None:
            out.append(Largest(device.name, axis, None, 0, None, "its capacity is unknown", share=share, rule=rule))
            continue
        if not fits_in(totals(floor)[i], capacity):
            out.append(Largest(device.name, axis, 0, 0, capacity, f"not even {floor} fits", share=share, rule=rule))
            continue
        good, bad = search(i, capacity)
        if bad is not None:
            limit = f"{axis} = {bad} does not fit"
        elif axis == "seq_len" and max_positions:
            limit = f"the model's max_position_embeddings ({max_positions})"
        else:
            limit = f"the search's ceiling ({ceiling:,})"
        budget = int(capacity * share)
        kept = search(i, budget)[0] if fits_in(totals(floor)[i], budget) else 0
        out.append(Largest(device.name, axis, good, totals(good)[i], capacity, limit, kept,
                           totals(kept)[i] if kept else 0, share, rule))
    if trace is not None and plan_memory(spec, config, devices).strategy in TRACED_FIT_STRATEGIES:
        out = [_refined(row, i, spec, config, devices, axis, floor, trace, cache) for i, row in enumerate(out)]
    return out


def headroom_text(nbytes: int | None) -> str:
    """A headroom in words that never reads 0.00 while it is positive: GiB (2^30) with 2 decimals from 0.1 GiB up,
    below it MiB with 1 decimal, below 0.1 MiB KiB, below 0.1 KiB bytes; ``N/A`` for None."""
    if nbytes is None:
        return "N/A"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= 0.1 * size:
            return f"{nbytes / size:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{nbytes} B"


def headroom_rule(spec: Any) -> tuple[float, str]:
    """The share of a device's capacity a recommended value may plan for, and the rule in words: the criteria's
    ``max_device_share`` where it is set below 1 (the probe is judged by it), else :data:`DEFAULT_PLAN_SHARE` (a plan
    with under :data:`THIN_HEADROOM` of the device left is thin: a little less free memory, or the caching
    allocator's rounding, and it does not fit)."""
    accept = getattr(spec, "accept", None)
    set_share = getattr(accept, "max_device_share", 1.0) if accept is not None else 1.0
    if isinstance(set_share, (int, float)) and 0 < set_share < 1:
        return float(set_share), f"max_device_share {set_share:g}: at most {100 * set_share:g} % of the capacity"
    return DEFAULT_PLAN_SHARE, (f"{100 * THIN_HEADROOM:g} % of the capacity kept free (the default headroom: "
                                "max_device_share is not set below 1)")


def _refined(row: Largest, index: int, spec: Any, config: Any, devices: list[Any], axis: str, floor: int,
             trace: Callable[[Any], int], cache: dict[int, list[int]]) -> Largest:
    """``row`` checked against the traced plan: the largest value whose larger-of-the-two plan fits (bisection with
    traces, at most log2(value) of them), and its recommended value the same way within its headroom."""
    if not row.value or row.capacity_bytes is None:
        return row
    traced: dict[int, int] = {}

    def fit_at(value: int, budget: int) -> tuple[bool, int]:
        candidate = dataclasses.replace(spec, **{axis: value})
        device = plan_memory(candidate, config, devices).devices[index]
        if value not in traced:
            traced[value] = trace(candidate)
        fit = fit_of(device.device.name, budget, device.total_bytes, device.untraced_bytes, traced[value], "single")
        return bool(fit.fits), fit.bytes

    def down(value: int, budget: int) -> tuple[int, int, int | None]:
        """(the largest value up to ``value`` that fits ``budget`` by both plans, its bytes, the first that does not,
        None when ``value`` itself fits)."""
        ok, used = fit_at(value, budget)
        if ok:
            return value, used, None
        good, bad, used_good = 0, value, 0
        while bad - good > 1:
            middle = max(floor, (good + bad) // 2)
            fits, used = fit_at(middle, budget)
            if fits:
                good, used_good = middle, used
            else:
                bad = middle
            if middle == floor and not fits:
                break
        return good, used_good, bad

    good, used, bad = down(row.value, row.capacity_bytes)
    if bad is None:
        out = dataclasses.replace(row, plan_bytes=used, limit=row.limit + "; the traced plan agrees")
    else:
        out = dataclasses.replace(row, value=good, plan_bytes=used,
                                  limit=f"{axis} = {bad} does not fit by the traced plan (the analytic plan said "
                                        f"{row.value})")
    if out.recommended and out.value:
        kept, kept_bytes, _ = down(min(out.recommended, out.value), int(row.capacity_bytes * row.share))
        out = dataclasses.replace(out, recommended=kept, recommended_bytes=kept_bytes if kept else 0)
    elif not out.value:
        out = dataclasses.replace(out, recommended=0, recommended_bytes=0)
    return out
