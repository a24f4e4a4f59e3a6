"""The plan as `gpuaccept plan` prints it: per device its components and fit (:func:`format_plan`), the largest
settings that fit (:func:`format_largest`), the traced plan's lines (:func:`format_traced`); GiB (2^30) on screen."""

from __future__ import annotations

from typing import Any


def format_largest(rows: list[Any], spec: Any, devices: list[Any] | None = None) -> str:
    """The fit search as text: per device the recommended value (the largest whose plan leaves the headroom of
    :func:`core.plan.search.headroom_rule`), its plan against the capacity (which capacity, and when it was read),
    its headroom, then the last value that fits at all and why the search stops there. A headroom below 0.1 GiB is
    in MiB (:func:`core.plan.search.headroom_text`): it never reads 0.00 while it is positive."""
    from core.api import headroom_text

    what = "micro-batch" if rows[0].axis == "batch_size" else "sequence length"
    other = f"sequence length {spec.seq_len}" if rows[0].axis == "batch_size" else f"micro-batch {spec.batch_size}"
    checked = any("traced plan" in r.limit for r in rows)
    by_name = {d.name: d for d in devices or []}
    lines = [f"largest {what} that fits, leaving the headroom ({other}, the rest of the spec unchanged; "
             + ("analytic plan checked with traces" if checked else "analytic plan") + f"; headroom: {rows[0].rule}):"]
    for r in rows:
        device = by_name.get(r.device)
        capacity = device.capacity_text() if device is not None else f"{r.capacity_bytes / 2**30:.2f} GiB capacity" \
            if r.capacity_bytes else "unknown capacity"
        if r.value is None:
            lines.append(f"  {r.device}: unknown ({r.limit})")
        elif r.value == 0:
            lines.append(f"  {r.device}: none: {r.limit}")
        else:
            if r.recommended:
                lines.append(f"  {r.device}: {r.recommended} (plan {r.recommended_bytes / 2**30:.2f} GiB of {capacity};"
                             f" headroom {headroom_text(r.recommended_headroom_bytes)})")
            else:
                lines.append(f"  {r.device}: none leaves the headroom (of {capacity})")
            lines.append(f"    the largest that fits at all: {r.value} (plan {r.plan_bytes / 2**30:.2f} GiB, headroom "
                         f"{headroom_text(r.headroom_bytes)}; {r.limit})")
            if r.thin:
                lines.append("    at that one less than 5 % of the device is left: " + (
                    "the host's available memory moves as other processes run" if r.device.startswith("cpu") else
                    "CUDA's caching allocator reserves more than it allocates (fragmentation)") + "; keep a margin")
    return "\n".join(lines)


def format_traced(traced: dict[str, Any]) -> str:
    """The traced plan beside the analytic one, as text (GiB = 2^30 bytes), the most different line named."""
    if traced.get("status") != "estimated":
        return f"traced plan: not run ({traced.get('reason', '')})"
    from core.api import relative_text

    gib = 2**30
    lines = [f"traced plan (ESTIMATE, {traced['seconds']:.1f} s): {traced['method']}",
             f"  {'component':<20} {'analytic':>9}  {'traced':>9}  {'difference':>10}"]
    for name, row in traced["lines"].items():
        a, t = row["analytic_bytes"], row["traced_bytes"]
        rel = relative_text(a, t)
        mark = "  <- differs most" if name == traced["most_different"] else ""
        lines.append(f"  {name:<20} {a / gib:9.3f}  {t / gib:9.3f}  {rel:>10}{mark}")
    for name, row in traced.get("phase_totals", {}).items():
        a, t = row["analytic_bytes"], row["traced_bytes"]
        lines.append(f"  {'phase ' + name.replace('_', ' '):<20} {a / gib:9.3f}  {t / gib:9.3f}  {relative_text(a, t):>10}")
    a, t = traced["analytic_tensor_bytes"], traced["peak_bytes"]
    peaks = f"  (peak: {traced.get('analytic_peak_phase', '?')} / {traced.get('peak_phase', '?')})".replace("_", " ")
    lines.append(f"  {'peak of tensors':<20} {a / gib:9.3f}  {t / gib:9.3f}  {relative_text(a, t):>10}{peaks}")
    lines.append(f"  on {traced['compared_with']}; {traced['note']}")
    lines += format_device_memory(traced.get("device_memory"), traced["compared_with"])
    return "\n".join(lines)


def format_device_memory(memory: dict[str, Any] | None, device: str) -> list[str]:
    """The steady-state step as the device's three counters will show it (ESTIMATES), the reserved slack line by line,
    the first step, and what expandable segments would change."""
    if not memory:
        return []
    gib, mib = 2**30, 2**20
    lines = [f"as {device} will count it (ESTIMATES, steady-state step):"]
    for key, label in (("allocated", "peak allocated"), ("reserved", "peak reserved"), ("nvml_used", "NVML used")):
        lines.append(f"  {label:<20} {memory[key + '_bytes'] / gib:9.3f} GiB  {memory['methods'][key]}")
    for row in memory["slack"]:
        lines.append(f"    {row['bytes'] / mib:10.1f} MiB  {row['what']}")
    first = memory.get("first_step") or {}
    if first:
        lines.append(f"  step 1 (the optimizer's states are made in it): allocated {first['allocated_bytes'] / gib:.3f} "
                     f"GiB, reserved {first['reserved_bytes'] / gib:.3f} GiB")
    grown = memory.get("expandable_segments_reserved_bytes")
    saves = None if grown is None else memory["reserved_bytes"] - grown
    if saves is not None:
        lines.append("  with expandable_segments:True (--alloc-conf) the peak reserved would be "
                     + (f"{saves / mib:.0f} MiB lower" if saves > 0 else f"{-saves / mib:.0f} MiB higher" if saves < 0
                        else "the same"))
    return lines


def format_plan(plan: Any, spec: Any, fits: list[Any] | None = None) -> str:
    """The plan as text: parameters, strategy, convention, then each device with one line per component (its largest
    value over the phases; GiB = 2^30 bytes), the phases with the bytes alive at each one's peak, and the device's
    own fit verdict (``fits``: :func:`core.plan.fit.fit_verdicts`, by default the analytic plan's)."""
    from core.api import component_label, fit_verdicts

    fits = fits if fits is not None else fit_verdicts(plan)
    strategy = plan.strategy + (f" (tp={spec.tp})" if plan.strategy == "tp" else "")
    lines = [
        f"model {spec.model}, mode {spec.mode}, dtype {spec.dtype}, precision "
        f"{spec.precision if spec.dtype != 'fp32' else 'moot (fp32)'}, attention {spec.attn_implementation}, padding "
        f"{spec.padding}, micro-batch {spec.batch_size} x {spec.seq_len} tokens",
        f"strategy {strategy} over {len(plan.devices)} device(s)",
        *([f"recipe: {spec.recipe_text()}"] if spec.training else []),
        f"parameters: {plan.parameters.total:,} total, {plan.parameters.trainable:,} trainable",
        f"convention: {plan.convention}",
        "all numbers below are ESTIMATES (analytic); the probe measures",
    ]
    if plan.activation_model != "op-by-op" and spec.training:
        lines.append("note: activations use Korthikanti's formula generalised to the MLP (no op-by-op model of this "
                     "architecture here: that is the Llama family's); traced on GPT-2, Phi-2, OPT and Gemma shapes the "
                     "activations were within -19 % to +27 % of it: add --traced, and the fit uses the larger")
    for d, fit in zip(plan.devices, fits):
        # the one wording of a capacity (core/plan/devices.py): which quantity, its source, when it was read
        lines.append(f"\n{d.device.name} {d.device.label}: capacity {d.device.capacity_text()}")
        lines.append("  each component's largest value over the step:")
        for name, line in d.lines.items():
            lines.append(f"  {component_label(name, d.device.kind):<17} {line.bytes / 2**30:9.3f} GiB  {line.method}")
        peak = d.peak_phase
        if len(d.phases) > 1:
            lines.append(f"  {'(their sum':<17} {d.sum_of_lines / 2**30:9.3f} GiB  no moment of the step holds them "
                         "all)")
            lines.append("  the phases of the step, bytes alive at each one's peak:")
            for p in d.phases.values():
                mark = "  <- the peak" if p is peak else ""
                lines.append(f"  {p.name.replace('_', ' '):<17} {p.total_bytes / 2**30:9.3f} GiB  at {p.at}{mark}")
        for line in d.host:
            lines.append(f"  {'off the device':<17} {line.bytes / 2**30:9.3f} GiB  {line.component}, not in the peak: "
                         f"{line.method}")
        verdict = {True: "fits", False: "DOES NOT FIT", None: "fit unknown"}[fit.fits]
        lines.append(f"  {'peak of the step':<17} {fit.bytes / 2**30:9.3f} GiB  {verdict} on {d.device.name} "
                     f"({fit.untraced_note})")
    if len(plan.devices) > 1:
        total = sum(f.bytes for f in fits)
        known = all(d.device.capacity_bytes for d in plan.devices)
        capacity = f"{sum(d.device.capacity_bytes for d in plan.devices) / 2**30:.2f} GiB" if known else \
            "an unknown capacity"
        lines.append(f"\nnote: the sum over {len(plan.devices)} devices ({total / 2**30:.2f} GiB of {capacity}) is not a "
                     "placement: CUDA does not pool GPU memory, so each device must fit on its own")
    return "\n".join(lines)
