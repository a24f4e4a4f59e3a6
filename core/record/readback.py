"""A record's own numbers read back as the verdict engine's facts (:mod:`core.record.verdicts`): what ``verify``
recomputes each stage's verdict from. Every reader checks the kinds of the values it reads (core/record/schema.py) and
raises on one of the wrong type (verify reports it as a problem)."""

from __future__ import annotations

import math
from typing import Any

from core.criteria import AcceptCriteria, Judgement, device_label, speed_on
from core.methods import trains
from core.plan.fit import measured_use_bytes
from core.record.verdicts import (
    STAGES,
    CheckFact,
    ComparedPeak,
    ComparedStep,
    PlanFacts,
    ProbedDevice,
    ProbeFacts,
    QualityFacts,
    ResumeFacts,
    check_evidence,
    count,
    entry,
    evaluation_verdict,
    expected_probe_devices,
    health_facts,
    links_facts,
    plan_verdict,
    probe_verdict,
    resume_verdict,
    subtable,
    tables,
    text,
    timed_means,
)
from core.record.verdicts import number as num
from core.stages.noise import RecordedRule
from core.stages.probe import wrapper_problem
from core.status import PASSING


def rank_of(d: Any, where: str) -> tuple[int, int]:
    """(rank, world size) of a probed device; a single process's record may leave them out (rank 0 of 1)."""
    return count(d.get("rank", 0), f"{where}.rank"), count(d.get("world_size", 1), f"{where}.world_size")


def compared_peaks(rec: dict[str, Any]) -> tuple[ComparedPeak, ...]:
    """The probe's plan comparison as the plan's criterion takes it: per device the plan's tensor bytes and the
    measured peak (none when the probe did not measure)."""
    probe = rec["probe"]
    if probe.get("provenance") != "measured":
        return ()
    devices = tables(entry(probe, "devices", "probe"), "probe.devices")
    world = max((rank_of(d, f"probe.devices[{i}]")[1] for i, d in enumerate(devices)), default=1)
    out = []
    for i, r in enumerate(tables(entry(probe, "plan_comparison", "probe"), "probe.plan_comparison")):
        where = f"probe.plan_comparison[{i}]"
        out.append(ComparedPeak(device_label(text(entry(r, "device", where), f"{where}.device"),
                                             rank_of(r, where)[0], world),
                                count(entry(r, "planned_bytes", where), f"{where}.planned_bytes"),
                                count(entry(r, "measured_bytes", where), f"{where}.measured_bytes")))
    return tuple(out)


def probe_facts(rec: dict[str, Any], crit: AcceptCriteria, capacity: dict[str, int | None]) -> ProbeFacts:
    """The probe's facts from a record whose probe was measured: each device's use (:func:`measured_use_bytes`)
    with the capacity of the planned device of its name, its wrapper against the spec's strategy, the ranks the spec
    runs, the speed as :func:`probe_speed` recomputes it, and (schema 2) the attention implementation it ran with."""
    spec, plan, probe = rec["spec"], rec["plan"], rec["probe"]
    strategy = text(entry(spec, "strategy", "spec"), "spec.strategy")
    devices: list[ProbedDevice] = []
    for i, d in enumerate(tables(entry(probe, "devices", "probe"), "probe.devices")):
        where = f"probe.devices[{i}]"
        name = text(entry(d, "device", where), f"{where}.device")
        rank, world = rank_of(d, where)
        used = measured_use_bytes(name, count(entry(d, "peak_bytes", where), f"{where}.peak_bytes"),
                                  count(d.get("peak_rss_bytes", 0), f"{where}.peak_rss_bytes"))
        devices.append(ProbedDevice(device_label(name, rank, world), used, capacity.get(name),
                                    wrapper_problem(strategy, text(d.get("wrapper", ""), f"{where}.wrapper"))))
    step_time_s, tokens_per_s, on, _ = probe_speed(rec)
    v2 = rec["schema_version"] >= 2  # the attention implementation is planned and recorded from schema 2
    return ProbeFacts(tuple(devices), crit, step_time_s, tokens_per_s, on,
                      expected_devices=expected_probe_devices(spec, len(plan.get("devices", []))),
                      attention=text(probe.get("attention_implementation", ""), "probe.attention_implementation")
                      if v2 else "",
                      planned_attention=text(entry(spec, "attn_implementation", "spec"), "spec.attn_implementation")
                      if v2 else "",
                      health=health_facts(probe), links=links_facts(probe)[0],
                      rank_step_times=rank_step_times(probe))


def rank_step_times(probe: dict[str, Any]) -> tuple[tuple[str, float], ...]:
    """Each rank's mean over ``probe.timing.timed_steps`` of its ``devices[].step_times_s`` (none without a timing
    table: a record before it); the kinds were checked by :func:`probe_speed`."""
    timing = probe.get("timing")
    if not isinstance(timing, dict):
        return ()
    timed = [s for s in timing.get("timed_steps", []) if isinstance(s, int)]
    ranks = {}
    for d in probe.get("devices", []):
        times = d.get("step_times_s")
        if isinstance(times, list) and all(isinstance(t, (int, float)) for t in times):
            rank, world = d.get("rank", 0), d.get("world_size", 1)
            ranks[rank] = (device_label(str(d.get("device", "")), rank, world), [float(t) for t in times])
    return timed_means(ranks.values(), timed)


def quality_facts(rec: dict[str, Any], crit: AcceptCriteria, training: bool) -> QualityFacts:
    """The evaluation's facts from a record whose evaluation was measured: perplexity before, after (training; None
    when not measured) and the final model's next-token accuracy (None: not measured)."""
    ev = rec["evaluation"]
    before = subtable(entry(ev, "before", "evaluation"), "evaluation.before")
    after = subtable(entry(ev, "after", "evaluation"), "evaluation.after") if training else {}
    final = after if training else before
    return QualityFacts(
        training, num(entry(before, "perplexity", "evaluation.before"), "evaluation.before.perplexity"),
        num(after["perplexity"], "evaluation.after.perplexity") if "perplexity" in after else None,
        num(final["accuracy"], "evaluation accuracy") if "accuracy" in final else None, crit)


def resume_facts(rec: dict[str, Any], crit: AcceptCriteria, rule: RecordedRule) -> ResumeFacts:
    """The resume check's facts from a record whose resume was measured: every check, the tier's rule and criterion,
    and the compared steps (the checks a passing record must show are a finding: :func:`_expected_checks_problems`)."""
    res = rec["resume"]
    checks = []
    for i, c in enumerate(tables(entry(res, "checks", "resume"), "resume.checks")):
        where = f"resume.checks[{i}]"
        name, distance, noise, bound = bounded(c, where)
        checks.append(CheckFact(name, text(entry(c, "status", where), f"{where}.status") in PASSING,
                                text(entry(c, "kind", where), f"{where}.kind"), distance, noise, bound,
                                check_evidence(c, where),
                                None if "margin" not in c else num(c["margin"], f"{where}.margin")))
    steps = []
    for i, row in enumerate(tables(entry(res, "comparison", "resume"), "resume.comparison")):
        where = f"resume.comparison[{i}]"
        steps.append(ComparedStep(count(entry(row, "step", where), f"{where}.step"),
                                  num(entry(row, "loss_reference", where), f"{where}.loss_reference"),
                                  num(entry(row, "loss_resumed", where), f"{where}.loss_resumed"),
                                  None if "loss_twin" not in row else num(row["loss_twin"], f"{where}.loss_twin")))
    return ResumeFacts(tuple(checks), rule=rule, steps=tuple(steps), tier=tier_of(res), criteria=crit)


def tier_of(res: dict[str, Any]) -> tuple[str, float] | None:
    """The recorded tier's (name, multiple) for the ``resume_tier`` criterion; a record before schema 5 gives its
    relative tolerance as the multiple. None without a named tier."""
    tier = res.get("tier")
    if not isinstance(tier, dict) or not tier.get("name"):
        return None
    loose = tier.get("multiple") if "multiple" in tier else tier.get("rtol")  # rtol: records before schema 5
    return str(tier["name"]), num(loose, "resume.tier.multiple")


def judgements_of(rec: dict[str, Any], crit: AcceptCriteria, capacity: dict[str, int | None],
                  training: bool) -> dict[str, list[Judgement]]:
    """Each stage's criteria rows recomputed from the record's own numbers by the verdict engine
    (:mod:`core.record.verdicts`, the rules the stages applied): the plan's error against the probe's peaks, each
    probed device's share of its capacity and the probe's speed, the evaluation's quality, the resume's tier. A stage
    whose table holds no measurement has none (the plan's criterion is then not judged)."""
    plan, probe, ev, res = rec["plan"], rec["probe"], rec["evaluation"], rec["resume"]
    out: dict[str, list[Judgement]] = {name: [] for name in STAGES}
    if plan.get("provenance") == "estimated":
        out["plan"] = list(plan_verdict(PlanFacts((), compared_peaks(rec), crit)).criteria)
    if probe.get("provenance") == "measured":
        out["probe"] = list(probe_verdict(probe_facts(rec, crit, capacity)).criteria)
    if ev.get("provenance") == "measured":
        out["evaluation"] = list(evaluation_verdict(quality_facts(rec, crit, training)).criteria)
    tier = tier_of(res) if res.get("provenance") == "measured" else None
    if tier is not None:
        out["resume"] = list(resume_verdict(ResumeFacts((), tier=tier, criteria=crit)).criteria)
    return out


def probe_speed(rec: dict[str, Any]) -> tuple[float, float, str | None, list[str]]:
    """The probe's speed as its criteria judge it, recomputed from the record: (seconds per step, tokens per second,
    what the rows are judged on (:func:`core.criteria.speed_on`; None: "the probe's steps"), what is wrong).

    With a ``probe.timing`` table: per rank, the mean of its ``devices[].step_times_s`` at ``timing.timed_steps``
    (the steps run without the memory tracker, after the warm-up), the slowest rank's; tokens per second summed over
    the ranks from the spec's tokens per step. It must be the recorded ``step_time_s`` / ``tokens_per_s``, the timed
    steps must be untracked whenever an untracked step ran after step 1, and ``timed_tracked`` / ``warmup_excluded``
    must say what the steps say. Without one (a record written before the probe said how it timed): the recorded
    figures, judged as they are."""
    probe, spec = rec["probe"], rec.get("spec", {})
    step_s = num(probe.get("step_time_s"), "probe.step_time_s")
    tokens_s = num(probe.get("tokens_per_s"), "probe.tokens_per_s")
    timing = probe.get("timing")
    if timing is None:
        return step_s, tokens_s, None, []
    if not isinstance(timing, dict):
        return step_s, tokens_s, None, ["probe.timing is not a table"]
    timed = [count(s, "probe.timing.timed_steps[]") for s in timing.get("timed_steps", [])]
    tracked = [count(s, "probe.timing.tracked_steps[]") for s in timing.get("tracked_steps", [])]
    if not timed:
        return step_s, tokens_s, None, ["probe.timing.timed_steps is empty: the speed was timed on no step"]
    problems: list[str] = []
    overlap = [s for s in timed if s in tracked]
    if timing.get("timed_tracked") is not bool(overlap):
        problems.append(f"probe.timing.timed_tracked is {timing.get('timed_tracked')!r}, but the timed steps {timed} "
                        f"{'include' if overlap else 'are none of'} the tracked steps {tracked}")
    if timing.get("warmup_excluded") is not (1 not in timed):
        problems.append(f"probe.timing.warmup_excluded is {timing.get('warmup_excluded')!r}, but the timed steps are "
                        f"{timed}")
    times: dict[int, list[float]] = {}  # rank -> seconds per step (a device map's devices share their rank's)
    for i, d in enumerate(probe.get("devices", [])):
        got = d.get("step_times_s")
        if not isinstance(got, list) or not got:
            return step_s, tokens_s, speed_on(timed, bool(overlap)), problems + [
                f"probe.devices[{i}].step_times_s is missing: the timed steps' seconds cannot be recomputed"]
        times.setdefault(d.get("rank", 0), [num(t, f"probe.devices[{i}].step_times_s[]") for t in got])
    if not times:
        return step_s, tokens_s, speed_on(timed, bool(overlap)), problems
    ran = min(len(t) for t in times.values())
    if max(timed) > ran:
        return step_s, tokens_s, speed_on(timed, bool(overlap)), problems + [
            f"probe.timing.timed_steps {timed} name a step the probe did not run ({ran} ran)"]
    untracked = [s for s in range(2, ran + 1) if s not in tracked]
    if overlap and untracked:
        problems.append(f"the probe's speed is timed on tracked step(s) {overlap} (slowed by the memory tracker) "
                        f"while untracked step(s) {untracked} ran: the criteria judge the untracked ones")
        timed, overlap = untracked, []
    means = [sum(t[s - 1] for s in timed) / len(timed) for t in times.values()]
    recomputed = max(means)
    if not math.isclose(recomputed, step_s, rel_tol=1e-9, abs_tol=1e-12):
        problems.append(f"probe.step_time_s is {step_s!r}, but the mean of steps {timed} of the slowest rank's "
                        f"step_times_s is {recomputed!r}")
    per_step = tokens_per_step(spec)
    tokens = sum(per_step / m for m in means if m > 0) if per_step is not None else tokens_s
    if per_step is not None and not math.isclose(tokens, tokens_s, rel_tol=1e-9, abs_tol=1e-9):
        problems.append(f"probe.tokens_per_s is {tokens_s!r}, but the spec's {per_step} tokens per step over the "
                        f"timed steps' seconds give {tokens!r}")
    return recomputed, tokens, speed_on(timed, bool(overlap)), problems


def tokens_per_step(spec: dict[str, Any]) -> int | None:
    """Tokens one rank's optimizer step takes: micro-batch x sequence length (x accumulation when training); None
    when the spec table lacks one of them."""
    try:
        n = count(spec["batch_size"], "spec.batch_size") * count(spec["seq_len"], "spec.seq_len")
        return n * (count(spec.get("grad_accum", 1), "spec.grad_accum") if trains(spec.get("mode")) else 1)
    except (KeyError, TypeError):
        return None


def bounded(ch: Any, where: str) -> tuple[str, float, float | None, float | None]:
    """(name, largest difference, noise, bound) of a recorded resume check, as numbers (None: not recorded; an exact
    check records no largest difference: 0)."""
    name = text(entry(ch, "name", where), f"{where}.name")
    return (name, num(ch.get("largest_difference", 0.0), f"resume check {name} largest_difference"),
            None if "noise" not in ch else num(ch["noise"], f"resume check {name} noise"),
            None if "bound" not in ch else num(ch["bound"], f"resume check {name} bound"))
