"""A record's shape, checked before any verdict is computed again (``gpuaccept verify``'s second step): its version,
tables, types, provenance tags, UTC-aware times, the verdict's stages and the sign-off (:func:`schema_problems`), and
which stages of a verdict did not pass (:func:`stages_not_passed`: what an accepting sign-off overrides)."""

from __future__ import annotations

from typing import Any

from core.record.written import READABLE_VERSIONS, TOOL
from core.status import StageStatus

PROVENANCES = ("measured", "estimated", "not_run")
TABLES = ("spec", "environment", "model", "seeds", "plan", "probe", "data", "evaluation", "resume", "verdict",
          "signoff")
STAGE_STATUSES = tuple(s.value for s in (StageStatus.PASS, StageStatus.FAIL, StageStatus.NOT_APPLICABLE,
                                          StageStatus.NOT_RUN, StageStatus.CANCELLED, StageStatus.ERROR))
#: the stage statuses an overall pass allows; any other (fail, error, cancelled, not_run) is a stage not passed
PASSING_STATUSES = (StageStatus.PASS.value, StageStatus.NOT_APPLICABLE.value)
VERDICT_STAGES = ("plan", "probe", "evaluation", "resume")
TOP_LEVEL = ("schema_version", "tool", "tool_version", "created_utc", "started_utc", "run_dir")
OPTIONAL_TABLES = ("onboarding",)  # the onboarding quiz's answers, when the operator adds them


def _utc_aware(value: Any) -> bool:
    from datetime import datetime

    offset = value.utcoffset() if isinstance(value, datetime) else None
    return offset is not None and offset.total_seconds() == 0


def _version_2_problems(rec: dict[str, Any]) -> list[str]:
    """What schema 2 adds: the spec's precision, attention implementation and padding, each one of its values; a plan's
    devices with their phases (names among :data:`core.plan.phases.PHASES`), peak phase and fit."""
    from core.plan.phases import PHASES
    from core.spec import ATTN_IMPLEMENTATIONS, PADDINGS, PRECISIONS

    out = []
    for key, allowed in (("precision", PRECISIONS), ("attn_implementation", ATTN_IMPLEMENTATIONS),
                         ("padding", PADDINGS)):
        if rec["spec"].get(key) not in allowed:
            out.append(f"spec.{key} is {rec['spec'].get(key)!r}; schema 2 holds one of {', '.join(allowed)}")
    plan = rec["plan"]
    if plan.get("provenance") != "estimated":
        return out
    devices = plan.get("devices", [])
    if not isinstance(devices, list) or not all(isinstance(d, dict) for d in devices):
        return out + ["plan.devices must be an array of tables, one per device"]
    for i, d in enumerate(devices):
        where = f"plan.devices[{i}]"
        missing = [k for k in ("phases", "peak_phase", "fit_bytes", "fit_judged_by", "sum_of_components_bytes",
                               "untraced_bytes") if k not in d]
        if missing:
            out.append(f"{where} lacks {', '.join(missing)} (schema 2 plans the phases of the step and the fit)")
            continue
        phases = d["phases"]
        if not isinstance(phases, dict) or not phases or any(p not in PHASES for p in phases):
            out.append(f"{where}.phases must be a table of phases among {', '.join(PHASES)}")
        if d["fit_judged_by"] not in ("analytic", "traced", "reserved"):
            out.append(f"{where}.fit_judged_by is {d['fit_judged_by']!r}; analytic, traced or reserved")
    return out


def spec_table_hash(spec_table: dict[str, Any]) -> str:
    """sha256 of a record's ``spec`` table without its ``hash`` key, as :meth:`RunSpec.spec_hash` computes it."""
    from core.spec import canonical_sha256

    return canonical_sha256({k: v for k, v in spec_table.items() if k != "hash"})


def schema_problems(rec: dict[str, Any]) -> list[str]:
    """What in a parsed record breaks its schema version (docs/record.md); empty when it conforms.

    Checked: ``schema_version``, ``tool``, ``tool_version``; ``created_utc`` / ``started_utc``; every table of
    :data:`TABLES`; the spec's sha256; a ``provenance`` of :data:`PROVENANCES` on every table of numbers (an
    ``estimated`` one with its ``method``); verdict statuses; the sign-off (``status = "unsigned"``, or operator, role,
    decision accept / reject, comment, ``time_utc``); then every value of every table and array against the value rules
    of :func:`core.record.schema.value_problems` (finite floats, UTC date-times only at ``*_utc`` keys, non-empty keys,
    the kind of each key: counts, numbers, strings, digests, the spec's own field types).
    """
    from core.record.schema import value_problems

    out: list[str] = []
    version = rec.get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int) or version not in READABLE_VERSIONS:
        out.append(f"schema_version is {rec.get('schema_version')!r}; this gpuaccept reads versions "
                   f"{', '.join(map(str, READABLE_VERSIONS))}")
        return out
    if rec.get("tool") != TOOL or not isinstance(rec.get("tool_version"), str):
        out.append("tool must be \"gpuaccept\" with a tool_version string")
    out.extend(f"{key} is missing" for key in ("created_utc", "started_utc") if key not in rec)
    tables = TABLES + (("accept",) if version >= 4 else ())
    missing = [t for t in tables if not isinstance(rec.get(t), dict)]
    if missing:
        out.append("missing tables: " + ", ".join(missing))
        return out
    out.extend(onboarding_problems(rec.get("onboarding")))
    if version >= 4:
        out.extend(_accept_problems(rec["accept"]))
    unknown = sorted(set(rec) - set(TOP_LEVEL) - set(tables) - set(OPTIONAL_TABLES))
    if unknown:
        out.append("unknown top-level keys: " + ", ".join(unknown))
    try:
        recomputed = spec_table_hash(rec["spec"])
    except (TypeError, ValueError) as exc:  # a value JSON cannot hold (a date, a NaN): also a value finding below
        out.append(f"spec.hash cannot be recomputed: the spec table holds a value a spec cannot ({exc})")
    else:
        if rec["spec"].get("hash") != recomputed:
            out.append("spec.hash is not the sha256 of the spec table: the spec was edited (and the hash not "
                       "recomputed)")
    if version >= 2:
        out.extend(_version_2_problems(rec))
    allowed = {"environment": ("measured",), "model": ("measured",), "seeds": ("measured",),
               "plan": ("estimated", "not_run"), "probe": ("measured", "not_run"), "data": ("measured", "not_run"),
               "evaluation": ("measured", "not_run")}
    out.extend(provenance_problems(rec, allowed))
    res = rec["resume"]
    if res.get("status") != StageStatus.NOT_APPLICABLE and res.get("provenance") not in ("measured", "not_run"):
        out.append(f"resume.provenance is {res.get('provenance')!r}; measured or not_run (or status not_applicable)")
    out.extend(verdict_and_signoff_problems(rec))
    return out + value_problems(rec)


def provenance_problems(rec: dict[str, Any], allowed: dict[str, tuple[str, ...]]) -> list[str]:
    """Each table of ``allowed`` has one of its provenances: an ``estimated`` one with its ``method``, a
    ``not_applicable`` one with its ``why`` (the recipe's records and the command's both apply it)."""
    out = []
    for table, provenances in allowed.items():
        prov = rec[table].get("provenance")
        if prov not in provenances:
            out.append(f"{table}.provenance is {prov!r}; for this table one of {', '.join(provenances)}")
        elif prov == "estimated" and not rec[table].get("method"):
            out.append(f"{table} is estimated but says no method")
        elif prov == "not_applicable" and not isinstance(rec[table].get("why"), str):
            out.append(f"{table} is not_applicable but says no why")
    return out


def _accept_problems(table: dict[str, Any]) -> list[str]:
    """The ``accept`` table (schema 4) holds criteria gpuaccept knows, each in its range (:mod:`core.criteria`), and
    ``not_set`` names exactly the criteria without a threshold."""
    import dataclasses

    from core.criteria import AcceptCriteria
    from core.errors import SpecError

    try:
        crit = AcceptCriteria.from_table(table)
    except SpecError as exc:
        return [f"the accept table: {exc}"]
    unset = sorted(f.name for f in dataclasses.fields(crit) if getattr(crit, f.name) is None)
    listed = table.get("not_set", [])
    if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed) or sorted(listed) != unset:
        return [f"accept.not_set is {table.get('not_set')!r}; the criteria without a threshold are {unset}"]
    return []


def onboarding_problems(attempts: Any) -> list[str]:
    """Each onboarding attempt (the quiz's answers, when added) has an operator, a UTC ``time_utc``, questions whose
    ``correct`` is ``chosen == right``, ``questions_asked`` their number and ``score`` the correct ones."""
    out: list[str] = []
    if attempts is None:
        return out
    for i, a in enumerate(attempts if isinstance(attempts, list) else [attempts]):
        rows = a.get("questions") if isinstance(a, dict) else None
        ok = (isinstance(a, dict) and str(a.get("operator", "")).strip() and isinstance(rows, list)
              and all(isinstance(r, dict) and r.get("correct") == (r.get("chosen") == r.get("right")) for r in rows)
              and a.get("questions_asked") == len(rows) and a.get("score") == sum(r["correct"] for r in rows)
              and _utc_aware(a.get("time_utc")))
        if not ok:
            out.append(f"onboarding[{i}]: needs operator, UTC time_utc, questions whose correct = (chosen == "
                       "right), questions_asked = their number and score = the correct ones")
    return out


def verdict_and_signoff_problems(rec: dict[str, Any]) -> list[str]:
    """The verdict (pass or fail, exactly the stages of :data:`VERDICT_STAGES`, each with a status and its evidence)
    and the sign-off (``status = "unsigned"`` alone, or operator, role, decision accept / reject, comment, time, and
    for an accept of a verdict that is not pass the override: :func:`_override_problems`)."""
    out: list[str] = []
    if rec["verdict"].get("status") not in (StageStatus.PASS, StageStatus.FAIL):
        out.append(f"verdict.status is {rec['verdict'].get('status')!r}; pass or fail")
    stages = rec["verdict"].get("stages")
    if not isinstance(stages, dict) or sorted(stages) != sorted(VERDICT_STAGES):
        out.append(f"verdict.stages must hold exactly {', '.join(VERDICT_STAGES)}")
    else:
        for name, item in stages.items():
            if not isinstance(item, dict) or item.get("status") not in STAGE_STATUSES or \
                    not isinstance(item.get("evidence"), str):
                out.append(f"verdict.stages.{name} needs a status ({', '.join(STAGE_STATUSES)}) and its evidence")
    so = rec["signoff"]
    if so.get("status") == "unsigned":
        if set(so) != {"status"}:
            out.append("signoff says unsigned but holds " + ", ".join(sorted(set(so) - {"status"})))
    else:
        out.extend(f"signoff.{key} is missing" for key in ("operator", "role", "comment", "time_utc") if key not in so)
        if not so.get("operator"):
            out.append("signoff.operator is empty")
        if so.get("decision") not in ("accept", "reject"):
            out.append(f"signoff.decision is {so.get('decision')!r}; accept or reject")
        out.extend(_override_problems(rec["verdict"], so))
    return out


def stages_not_passed(verdict: Any) -> list[str]:
    """The stages of a record's ``verdict`` table that did not pass: each of :data:`VERDICT_STAGES` whose status is
    not one of :data:`PASSING_STATUSES` (fail, error, cancelled, not_run, or missing), in that order. These are what a
    sign-off that accepts the record overrides (``signoff.overridden``). Empty for a verdict that is not a table."""
    stages = verdict.get("stages") if isinstance(verdict, dict) else None
    if not isinstance(stages, dict):
        return []
    return [name for name in VERDICT_STAGES
            if not (isinstance(stages.get(name), dict) and stages[name].get("status") in PASSING_STATUSES)]


def verdict_passes(verdict: Any) -> bool:
    """Whether a record's ``verdict`` table says pass: ``status = "pass"`` and every stage pass or not_applicable."""
    return isinstance(verdict, dict) and verdict.get("status") == StageStatus.PASS and not stages_not_passed(verdict)


def _override_problems(verdict: dict[str, Any], so: dict[str, Any]) -> list[str]:
    """The sign-off's override, when it has one (docs/record.md, ``signoff``): the operator's reason to accept a record
    whose verdict is not pass (``override``, a non-empty string, with the decision accept) and the stages it accepted
    although they did not pass (``overridden``: exactly :func:`stages_not_passed`)."""
    if "override" not in so and "overridden" not in so:
        return []
    out = []
    reason = so.get("override")
    if not isinstance(reason, str) or not reason.strip():
        out.append(f"signoff.override is {reason!r}; the operator's reason to accept, a non-empty string")
    if so.get("decision") != "accept":
        out.append(f"signoff.override goes with the decision accept, not {so.get('decision')!r}")
    if verdict_passes(verdict):
        out.append("signoff.override overrides nothing: the verdict is pass")
    elif so.get("overridden") != stages_not_passed(verdict):
        out.append(f"signoff.overridden is {so.get('overridden')!r}; the stages that did not pass are "
                   f"{stages_not_passed(verdict)!r}")
    return out
