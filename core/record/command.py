"""``gpuaccept verify`` for records of kind ``command`` (the user's own command: core/command/record.py).

Schema (:func:`command_schema_problems`): the tables of :data:`TABLES`, the spec's sha256, each table's provenance among
those it may have (``not_applicable`` with its ``why``), the verdict's four stages and the sign-off (the rules shared
with gpuaccept's own records), and every value below: finite floats, UTC date-times only at ``*_utc`` keys, and the
kinds of :data:`core.record.schema.RULES` (the ``spec`` and ``ran`` tables, which hold the user's words and what the
user's script reported, are held to the first two rules only).

Verdicts (:func:`command_verdict_problems`): the record's tables parsed into the verdict engine's facts
(:mod:`core.record.verdicts`; a value a verdict depends on that is missing or of the wrong type is a named problem) and
each status recomputed by the engine, with the rules the pipeline applies:

- plan (estimated): pass exactly when every planned device's ``fit_bytes`` <= its capacity (unknown: not against);
- probe (measured): pass exactly when the command exited 0, ran every step it was asked for, and each device's
  measured bytes <= its capacity; ``fits`` of each device follows from its numbers;
- evaluation (measured): pass exactly when both values are finite and after is better than before in the metric's
  direction (``higher_is_better``);
- resume (measured): pass exactly when every check passed and the checks of :data:`REQUIRED_CHECKS` are there; each
  comparison row's difference is |reference - resumed|; a passing tolerance check and each row within the tier's
  bound (:class:`core.stages.noise.RecordedRule`: bit-exact, or within ``multiple`` x the twin's noise; records
  before schema 4, a relative tolerance);
- overall: pass exactly when every stage is pass or not_applicable.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from core.criteria import COMMAND_SPEED_ON, AcceptCriteria
from core.plan.fit import fits_in
from core.record.judged import criteria_of, criteria_rows_problems
from core.record.schema import _walk
from core.record.shape import onboarding_problems, provenance_problems, spec_table_hash, verdict_and_signoff_problems
from core.record.verdicts import (
    STAGES,
    CheckFact,
    ComparedStep,
    KillSteps,
    MetricFacts,
    NotApplicable,
    PlanFacts,
    PlannedDevice,
    ProbedDevice,
    ProbeFacts,
    RecordValueError,
    ResumeFacts,
    StageVerdict,
    check_evidence,
    compared_steps_problems,
    count,
    entry,
    evaluation_verdict,
    flag,
    health_facts,
    number,
    plan_verdict,
    probe_verdict,
    resume_verdict,
    stated_problems,
    subtable,
    tables,
    text,
)
from core.record.written import READABLE_VERSIONS, TOOL
from core.stages.noise import EVIDENCE_SCHEMA, POOLED_SCHEMA, RESIZED_SUFFIX, RecordedRule, tier_problems
from core.status import PASSING, StageStatus

#: the first command-record version with the ``accept`` table and each stage's criteria rows
CRITERIA_VERSION = 5
TABLES = ("spec", "command", "environment", "ran", "plan", "probe", "data", "evaluation", "resume", "verdict",
          "signoff")
TOP_LEVEL = ("schema_version", "kind", "tool", "tool_version", "created_utc", "started_utc", "run_dir")
PROVENANCES = {"command": ("measured",), "environment": ("measured",),
               "ran": ("measured", "not_run", "not_applicable"),
               "plan": ("estimated", "not_run", "not_applicable"), "probe": ("measured", "not_run"),
               "data": ("measured", "not_run", "not_applicable"),
               "evaluation": ("measured", "not_run", "not_applicable"),
               "resume": ("measured", "not_run", "not_applicable")}
#: the checks every resume comparison that passes holds (core/command/resume.py); Trainer-based scripts add
#: trainer_state, world_size and trainable_set
REQUIRED_CHECKS = ("checkpoints", "kill", "kill_point", "checkpoint_selection", "checkpoint_complete", "manifest",
                   "safe_loading", "manifest_after", "global_steps", "loss", "final_checkpoint")


def command_schema_problems(rec: dict[str, Any]) -> list[str]:
    """What in a parsed command record breaks its schema; empty when it conforms."""
    out: list[str] = []
    if rec.get("schema_version") not in READABLE_VERSIONS or isinstance(rec.get("schema_version"), bool):
        return [f"schema_version is {rec.get('schema_version')!r}; this gpuaccept reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}"]
    if rec.get("tool") != TOOL or not isinstance(rec.get("tool_version"), str):
        out.append("tool must be \"gpuaccept\" with a tool_version string")
    out.extend(f"{key} is missing" for key in ("created_utc", "started_utc") if key not in rec)
    missing = [t for t in TABLES if not isinstance(rec.get(t), dict)]
    if missing:
        return out + ["missing tables: " + ", ".join(missing)]
    unknown = sorted(set(rec) - set(TOP_LEVEL) - set(TABLES) - {"onboarding", "accept"})
    if unknown:
        out.append("unknown top-level keys: " + ", ".join(unknown))
    if rec["schema_version"] >= CRITERIA_VERSION and not isinstance(rec.get("accept"), dict):
        out.append(f"accept is missing: a command record of version {rec['schema_version']} holds the criteria it "
                   "was judged by")
    out.extend(onboarding_problems(rec.get("onboarding")))
    spec = rec["spec"]
    if spec.get("mode") != "command" or not isinstance(spec.get("command"), dict):
        out.append("spec must hold mode = \"command\" and the [command] table")
    else:
        _spec_types(spec["command"], out)
    try:
        if spec.get("hash") != spec_table_hash(spec):
            out.append("spec.hash is not the sha256 of the spec table: the spec was edited (and the hash not "
                       "recomputed)")
    except (TypeError, ValueError) as exc:
        out.append(f"spec.hash cannot be recomputed ({exc})")
    out.extend(provenance_problems(rec, PROVENANCES))
    out.extend(verdict_and_signoff_problems(rec))
    for key, value in rec.items():
        _walk({key: value}, "", "", out, rules=key not in ("spec", "ran"))
    return out


def _spec_types(table: dict[str, Any], out: list[str]) -> None:
    """Each key of the record's [command] table is one CommandSpec knows, with its type."""
    from core.commandspec import SETTING_TYPES

    for key, value in table.items():
        rule = SETTING_TYPES.get(key)
        if rule is None:
            out.append(f"spec.command.{key} is not a setting of [command]")
        elif not rule[0](value):
            out.append(f"spec.command.{key} is {value!r}, not {rule[1]}")


def command_stage_verdicts(rec: dict[str, Any]) -> tuple[dict[str, StageVerdict | None], list[str]]:
    """Each stage's verdict by the engine (:mod:`core.record.verdicts`) from the record's own tables, parsed into its
    facts: what command mode's record states (:func:`core.command.record.build_command_record` judges the tables it
    wrote with this) and what ``verify`` recomputes (:func:`command_verdict_problems`).

    Returns:
        (stage -> its verdict, None where its table holds no measurement; the problems of the tables' own numbers:
        a device's ``fits``, a comparison row's difference, a tolerance check outside its tier's bound).

    Raises:
        core.record.verdicts.RecordValueError: a value a verdict depends on is missing or of the wrong type (named).
    """
    problems: list[str] = []
    version = count(entry(rec, "schema_version", "record"), "schema_version")
    crit = criteria_of(rec) if version >= CRITERIA_VERSION else AcceptCriteria()
    verdicts = {"plan": _plan(rec["plan"], problems), "probe": _probe(rec["probe"], problems, crit),
                "evaluation": _evaluation(rec["evaluation"], problems, crit),
                "resume": _resume(rec["resume"], problems, version, crit)}
    return verdicts, problems


def command_verdict_problems(rec: dict[str, Any]) -> list[str]:
    """Each stage's status recomputed by the verdict engine from the record's data (:func:`command_stage_verdicts`)
    against the status it states, in its table and in the verdict, and each stage's criteria rows; the problems
    found, empty when every verdict follows.

    Raises:
        core.record.verdicts.RecordValueError: a value a verdict depends on is missing or of the wrong type (named).
    """
    verdicts, problems = command_stage_verdicts(rec)
    version = count(entry(rec, "schema_version", "record"), "schema_version")
    computed = {n: v.status if v is not None else None for n, v in verdicts.items()}
    for name, status in computed.items():
        if status is not None and rec[name].get("status") != status:
            problems.append(f"{name}.status says {rec[name].get('status')}, its data says {status}")
    if version >= CRITERIA_VERSION:  # each stage's criteria rows: recomputed from the numbers and the accept table
        criteria_rows_problems(rec, {n: list(v.criteria) if v is not None else [] for n, v in verdicts.items()},
                               problems)
    stages = subtable(entry(subtable(rec["verdict"], "verdict"), "stages", "verdict"), "verdict.stages")
    stated = {n: text(entry(subtable(entry(stages, n, "verdict.stages"), f"verdict.stages.{n}"), "status",
                            f"verdict.stages.{n}"), f"verdict.stages.{n}.status") for n in STAGES}
    # a stage whose table holds no measurement (not_run) cannot have passed; anything else may be said of it
    unmeasured = tuple(s for s in StageStatus if s != StageStatus.PASS)
    return problems + stated_problems(stated, computed, rec["verdict"]["status"],
                                      {n: rec[n].get("provenance") for n in STAGES}, unmeasured)


def _capacity(d: Mapping[str, Any], where: str) -> int | None:
    """A device's capacity in bytes; absent: unknown (TOML has no null)."""
    return None if d.get("capacity_bytes") is None else count(d["capacity_bytes"], f"{where}.capacity_bytes")


def _fits_findings(devices: list[Mapping[str, Any]], key: str, table: str, problems: list[str]) -> None:
    """Each device's ``fits`` follows from its ``key`` bytes and its capacity (:func:`core.plan.fit.fits_in`)."""
    for i, d in enumerate(devices):
        where = f"{table}.devices[{i}]"
        fits = fits_in(count(entry(d, key, where), f"{where}.{key}"), _capacity(d, where))
        if d.get("fits") is not fits and not (fits is None and "fits" not in d):
            problems.append(f"{where}.fits says {d.get('fits')}, its bytes say {fits}")


def _plan(plan: dict[str, Any], problems: list[str]) -> StageVerdict | None:
    prov = plan.get("provenance")
    if prov == "not_applicable":
        return plan_verdict(NotApplicable())
    if prov != "estimated":
        return None
    devices = tables(entry(plan, "devices", "plan"), "plan.devices")
    _fits_findings(devices, "fit_bytes", "plan", problems)
    facts = PlanFacts(tuple(PlannedDevice(text(d.get("name", f"plan.devices[{i}]"), f"plan.devices[{i}].name"),
                                          count(d["fit_bytes"], f"plan.devices[{i}].fit_bytes"),
                                          _capacity(d, f"plan.devices[{i}]")) for i, d in enumerate(devices)))
    return plan_verdict(facts)


def _probe(probe: dict[str, Any], problems: list[str], crit: AcceptCriteria) -> StageVerdict | None:
    if probe.get("provenance") != "measured":
        return None
    exit_code = entry(probe, "exit_code", "probe")
    if isinstance(exit_code, bool) or not isinstance(exit_code, (int, str)):
        raise RecordValueError(f"probe.exit_code is {exit_code!r}, not an exit status or \"killed\"")
    if probe.get("status") == StageStatus.CANCELLED and exit_code == "killed":  # measured until a quit: not judged
        return probe_verdict(ProbeFacts((), quit=True))
    devices = tables(entry(probe, "devices", "probe"), "probe.devices")
    if not devices:
        problems.append("probe.devices is empty: no device was measured")
    _fits_findings(devices, "measured_bytes", "probe", problems)
    expected = probe.get("expected_steps")  # absent: the script did not say how many steps it was asked for
    facts = ProbeFacts(
        tuple(ProbedDevice(text(entry(d, "device", f"probe.devices[{i}]"), f"probe.devices[{i}].device"),
                           count(d["measured_bytes"], f"probe.devices[{i}].measured_bytes"),
                           _capacity(d, f"probe.devices[{i}]")) for i, d in enumerate(devices)),
        capacity_required=False,  # measured from outside: an unknown capacity is not held against the command
        exit_code=exit_code, steps=count(entry(probe, "steps", "probe"), "probe.steps"),
        expected_steps=None if expected is None else count(expected, "probe.expected_steps"), criteria=crit,
        step_time_s=None if "step_time_s" not in probe else number(probe["step_time_s"], "probe.step_time_s"),
        tokens_per_s=None if "tokens_per_s" not in probe else number(probe["tokens_per_s"], "probe.tokens_per_s"),
        speed_on=COMMAND_SPEED_ON,
        health=health_facts(probe, used=[d["device"] for d in devices]))
    return probe_verdict(facts)


def _evaluation(ev: dict[str, Any], problems: list[str], crit: AcceptCriteria) -> StageVerdict | None:
    prov = ev.get("provenance")
    if prov == "not_applicable":
        return evaluation_verdict(NotApplicable())
    if prov != "measured":
        return None
    before = subtable(entry(ev, "before", "evaluation"), "evaluation.before")
    after = subtable(entry(ev, "after", "evaluation"), "evaluation.after")
    facts = MetricFacts(flag(entry(ev, "higher_is_better", "evaluation"), "evaluation.higher_is_better"),
                        number(before["value"], "evaluation.before.value") if "value" in before else None,
                        number(after["value"], "evaluation.after.value") if "value" in after else None,
                        text(ev.get("metric", ""), "evaluation.metric"), crit)
    return evaluation_verdict(facts)


def _rule(res: dict[str, Any], version: int) -> RecordedRule:
    """The rule of a command record's resume tier: schema 4 on, its method and multiple (:mod:`core.stages.noise`);
    before, its relative tolerance (a tier without one: 0, bit-exact)."""
    tier = subtable(res.get("tier", {}), "resume.tier")
    if version >= 4:
        method = tier.get("method") if tier.get("method") in ("exact", "twin") else "exact"
        multiple = number(tier.get("multiple", 0.0), "resume.tier.multiple")
        return RecordedRule(str(method), multiple=multiple,  # a record without loss_multiple bounded losses by multiple
                            loss_multiple=number(tier.get("loss_multiple", multiple), "resume.tier.loss_multiple"),
                            evidence_kept=version >= EVIDENCE_SCHEMA, pooled=version >= POOLED_SCHEMA,
                            resized=str(tier.get("name", "")).endswith(RESIZED_SUFFIX))
    return RecordedRule("legacy", rtol=number(tier.get("rtol", 0.0), "resume.tier.rtol"))


def _kill_steps(res: dict[str, Any]) -> KillSteps | None:
    """The kill point's steps c, k, n and the last one compared, when the record holds them all."""
    keys = ("checkpoint_step", "kill_step", "next_checkpoint_step", "final_checkpoint_step")
    if not all(isinstance(res.get(k), int) and not isinstance(res.get(k), bool) for k in keys):
        return None
    return KillSteps(*(int(res[k]) for k in keys))


def resume_facts(res: dict[str, Any], version: int, crit: AcceptCriteria | None = None) -> ResumeFacts:
    """A command record's resume table as the engine's facts: its checks, :data:`REQUIRED_CHECKS`, its tier's rule,
    the compared steps and the kill point's steps.

    Raises:
        core.record.verdicts.RecordValueError: a value they depend on is missing or of the wrong type (named).
    """
    checks = []
    for i, c in enumerate(tables(entry(res, "checks", "resume"), "resume.checks")):
        where = f"resume.checks[{i}]"
        checks.append(CheckFact(
            text(entry(c, "name", where), f"{where}.name"), text(entry(c, "status", where), f"{where}.status") in PASSING,
            text(entry(c, "kind", where), f"{where}.kind"),
            number(c.get("largest_difference", 0.0), f"{where}.largest_difference"),  # an exact check records none
            None if "noise" not in c else number(c["noise"], f"{where}.noise"),
            None if "bound" not in c else number(c["bound"], f"{where}.bound"), check_evidence(c, where),
            None if "margin" not in c else number(c["margin"], f"{where}.margin")))
    steps = []
    for i, row in enumerate(tables(res.get("comparison", []), "resume.comparison")):  # none: no step was compared
        where = f"resume.comparison[{i}]"
        steps.append(ComparedStep(count(entry(row, "step", where), f"{where}.step"),
                                  number(entry(row, "loss_reference", where), f"{where}.loss_reference"),
                                  number(entry(row, "loss_resumed", where), f"{where}.loss_resumed"),
                                  None if "loss_twin" not in row else number(row["loss_twin"], f"{where}.loss_twin")))
    tier = subtable(res.get("tier", {}), "resume.tier")
    judged_tier = (text(tier["name"], "resume.tier.name"), number(tier.get("multiple", 0.0), "resume.tier.multiple")) \
        if crit is not None and "name" in tier else None
    return ResumeFacts(tuple(checks), REQUIRED_CHECKS, _rule(res, version), tuple(steps), tier=judged_tier,
                       criteria=crit if crit is not None else AcceptCriteria(), kill_steps=_kill_steps(res),
                       kill_steps_expected=True)


def _resume(res: dict[str, Any], problems: list[str], rec_version: int, crit: AcceptCriteria) -> StageVerdict | None:
    prov = res.get("provenance")
    if prov == "not_applicable" or res.get("status") == StageStatus.NOT_APPLICABLE:
        return resume_verdict(NotApplicable())
    if prov != "measured":
        return None
    facts = resume_facts(res, rec_version, crit if rec_version >= CRITERIA_VERSION else None)
    if rec_version >= 4 and res.get("tier"):  # a bound from measured noise: its multiples are gpuaccept's, not edited
        problems += tier_problems(subtable(res["tier"], "resume.tier"), max(rec_version, POOLED_SCHEMA - 1))[1]
    verdict = resume_verdict(facts)
    # what does not follow, in words (the engine's verdict fails the stage on each)
    ok = bool(facts.checks) and all(c.passed for c in facts.checks)
    missing = [n for n in facts.required if n not in {c.name for c in facts.checks}]
    if ok and missing:
        problems.append(f"resume passes without the checks {', '.join(missing)}")
        ok = False
    k = facts.kill_steps
    if k is None:
        if any(c.name == "kill_point" and c.passed for c in facts.checks):
            problems.append("resume passes its kill point without the steps c, k, n and the last checkpoint")
            ok = False
    elif not k.checkpoint < k.kill < k.next_checkpoint <= k.final:
        problems.append(f"resume's steps are out of order: checkpoint {k.checkpoint}, kill at {k.kill}, next "
                        f"checkpoint {k.next_checkpoint}, compared up to {k.final} (the kill lands after c and "
                        "before n)")
        ok = False
    for c in facts.checks:  # each passing tolerance check within its tier's bound, each computed again
        if c.kind == "tolerance" and c.passed:
            found = facts.rule.check_problems(c.name, c.largest_difference, c.noise, c.bound)
            problems.extend(found)
            ok = ok and not found
        if c.kind == "tolerance":
            found = facts.rule.evidence_problems(c.name, c.passed, c.largest_difference, c.noise, c.bound, c.evidence)
            problems.extend(found)
            ok = ok and not found
    found = compared_steps_problems(facts)
    problems.extend(found)
    ok = ok and not found
    loss = next((c for c in facts.checks if c.name == "loss"), None)
    noise, bound = (loss.noise, loss.bound) if loss is not None else (None, None)
    for i, (row, step) in enumerate(zip(res.get("comparison", []), facts.steps)):
        ref, got = step.reference, step.resumed
        diff = number(entry(row, "difference", f"resume.comparison[{i}]"), f"resume.comparison[{i}].difference")
        if not (math.isnan(diff) and (math.isnan(ref) or math.isnan(got))) and abs(abs(ref - got) - diff) > 1e-12:
            problems.append(f"resume.comparison[{i}].difference is {diff}, |reference - resumed| is {abs(ref - got)}")
        found = facts.rule.row_problems(step.step, ref, abs(ref - got), noise, bound, step.twin)
        if found and ok:  # the first step outside the tier is named
            problems.extend(found)
            ok = False
    return verdict
