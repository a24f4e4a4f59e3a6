"""``gpuaccept verify`` for records of kind ``command`` (the user's own command: core/command/record.py).

Schema (:func:`command_schema_problems`): the tables of :data:`TABLES`, the spec's sha256, each table's provenance among
those it may have (``not_applicable`` with its ``why``), the verdict's four stages and the sign-off (the rules shared
with gpuaccept's own records), and every value below: finite floats, UTC date-times only at ``*_utc`` keys, and the
kinds of :data:`core.record.schema.RULES` (the ``spec`` and ``ran`` tables, which hold the user's words and what the
user's script reported, are held to the first two rules only).

Verdicts (:func:`command_verdict_problems`), recomputed from the record's numbers, with the rules the pipeline applies:

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
from typing import Any

from core.record.build import (
    READABLE_VERSIONS,
    TOOL,
    _onboarding_problems,
    _verdict_and_signoff_problems,
    provenance_problems,
    spec_table_hash,
)
from core.record.schema import _walk
from core.stages.noise import RecordedRule

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
STAGES = ("plan", "probe", "evaluation", "resume")
PASSING = ("pass", "not_applicable")


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
    unknown = sorted(set(rec) - set(TOP_LEVEL) - set(TABLES) - {"onboarding"})
    if unknown:
        out.append("unknown top-level keys: " + ", ".join(unknown))
    out.extend(_onboarding_problems(rec.get("onboarding")))
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
    out.extend(_verdict_and_signoff_problems(rec))
    for key, value in rec.items():
        _walk({key: value}, "", "", out, rules=key not in ("spec", "ran"))
    return out


def _spec_types(table: dict[str, Any], out: list[str]) -> None:
    """Each key of the record's [command] table is one CommandSpec knows, with its type."""
    from core.command.spec import SETTING_TYPES

    for key, value in table.items():
        rule = SETTING_TYPES.get(key)
        if rule is None:
            out.append(f"spec.command.{key} is not a setting of [command]")
        elif not rule[0](value):
            out.append(f"spec.command.{key} is {value!r}, not {rule[1]}")


def command_verdict_problems(rec: dict[str, Any]) -> list[str]:
    """Each stage's status recomputed from the record's data against the status it states (see the module
    docstring); the problems found, empty when every verdict follows.

    Raises:
        TypeError, KeyError, ValueError: a value a verdict depends on is missing or of the wrong type.
    """
    problems: list[str] = []
    computed: dict[str, str] = {}
    _plan(rec["plan"], problems, computed)
    _probe(rec["probe"], problems, computed)
    _evaluation(rec["evaluation"], problems, computed)
    _resume(rec["resume"], problems, computed, int(rec.get("schema_version", 1)))
    stated = {n: rec["verdict"]["stages"][n]["status"] for n in STAGES}
    for name in STAGES:
        table = rec["evaluation" if name == "evaluation" else name]
        status = computed.get(name)
        if status is None:
            if stated[name] == "pass":
                problems.append(f"verdict.stages.{name} says pass, but its table holds no measurement "
                                f"(provenance {table.get('provenance')!r})")
        elif stated[name] != status:
            problems.append(f"verdict.stages.{name} says {stated[name]}, its data says {status}")
    final = {n: computed.get(n, stated[n]) for n in STAGES}
    overall = "pass" if all(s in PASSING for s in final.values()) else "fail"
    if rec["verdict"]["status"] != overall:
        problems.append(f"verdict.status says {rec['verdict']['status']}, the stages say {overall}")
    return problems


def _steps_in_order(res: dict[str, Any], problems: list[str]) -> bool:
    """The kill point's steps as the check places them: checkpoint c < kill step k < the next checkpoint n <= the last
    one compared (each present)."""
    keys = ("checkpoint_step", "kill_step", "next_checkpoint_step", "final_checkpoint_step")
    if not all(isinstance(res.get(k), int) for k in keys):
        if any(c["name"] == "kill_point" and c["status"] == "pass" for c in res["checks"]):
            problems.append("resume passes its kill point without the steps c, k, n and the last checkpoint")
            return False
        return True
    c, k, n, final = (res[k] for k in keys)
    if c < k < n <= final:
        return True
    problems.append(f"resume's steps are out of order: checkpoint {c}, kill at {k}, next checkpoint {n}, compared up "
                    f"to {final} (the kill lands after c and before n)")
    return False


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"{where} is {value!r}, not a number")
    if isinstance(value, str) and value not in ("inf", "-inf", "nan"):
        raise TypeError(f"{where} is {value!r}, not a number")
    return float(value)


def _fits(measured: Any, capacity: Any, where: str) -> bool | None:
    if capacity is None:
        return None
    if not isinstance(measured, int) or not isinstance(capacity, int):
        raise TypeError(f"{where}: bytes must be integers")
    return measured <= capacity


def _devices_fit(devices: list[dict[str, Any]], key: str, table: str, problems: list[str]) -> bool:
    """Each device's ``fits`` follows from its ``key`` bytes and its capacity (:func:`_fits`); True when none is
    over its capacity."""
    ok = True
    for i, d in enumerate(devices):
        fits = _fits(d[key], d.get("capacity_bytes"), f"{table}.devices[{i}]")
        if d.get("fits") is not fits and not (fits is None and "fits" not in d):
            problems.append(f"{table}.devices[{i}].fits says {d.get('fits')}, its bytes say {fits}")
        ok = ok and fits is not False
    return ok


def _plan(plan: dict[str, Any], problems: list[str], computed: dict[str, str]) -> None:
    prov = plan.get("provenance")
    if prov == "not_applicable":
        computed["plan"] = "not_applicable"
        return
    if prov != "estimated":
        return
    ok = _devices_fit(plan["devices"], "fit_bytes", "plan", problems)
    computed["plan"] = "pass" if ok else "fail"
    if plan.get("status") != computed["plan"]:
        problems.append(f"plan.status says {plan.get('status')}, its devices say {computed['plan']}")


def _probe(probe: dict[str, Any], problems: list[str], computed: dict[str, str]) -> None:
    if probe.get("provenance") != "measured":
        return
    if probe.get("status") == "cancelled" and probe["exit_code"] == "killed":  # measured until a quit: not judged
        computed["probe"] = "cancelled"
        return
    ok = probe["exit_code"] == 0
    expected = probe.get("expected_steps")
    if expected is not None and probe["steps"] < expected:
        ok = False
    if not probe["devices"]:
        problems.append("probe.devices is empty: no device was measured")
        ok = False
    ok = _devices_fit(probe["devices"], "measured_bytes", "probe", problems) and ok
    computed["probe"] = "pass" if ok else "fail"
    if probe.get("status") != computed["probe"]:
        problems.append(f"probe.status says {probe.get('status')}, its data says {computed['probe']}")


def _evaluation(ev: dict[str, Any], problems: list[str], computed: dict[str, str]) -> None:
    prov = ev.get("provenance")
    if prov == "not_applicable":
        computed["evaluation"] = "not_applicable"
        return
    if prov != "measured":
        return
    before, after = ev["before"], ev["after"]
    if "value" not in after or "value" not in before:
        computed["evaluation"] = "fail"
    else:
        a, b = _number(after["value"], "evaluation.after.value"), _number(before["value"], "evaluation.before.value")
        higher = ev["higher_is_better"]
        if not isinstance(higher, bool):
            raise TypeError("evaluation.higher_is_better is not true or false")
        better = math.isfinite(a) and math.isfinite(b) and (a > b if higher else a < b)
        computed["evaluation"] = "pass" if better else "fail"
    if ev.get("status") != computed["evaluation"]:
        problems.append(f"evaluation.status says {ev.get('status')}, its values say {computed['evaluation']}")


def _rule(res: dict[str, Any], version: int) -> RecordedRule:
    """The rule of a command record's resume tier: schema 4 on, its method and multiple (:mod:`core.stages.noise`);
    before, its relative tolerance."""
    tier = res.get("tier", {})
    if version >= 4:
        method = tier.get("method") if tier.get("method") in ("exact", "twin") else "exact"
        return RecordedRule(method, multiple=_number(tier.get("multiple", 0.0), "resume.tier.multiple"))
    return RecordedRule("legacy", rtol=_number(tier.get("rtol", 0.0), "resume.tier.rtol"))


def _bounded(c: dict[str, Any], where: str) -> tuple[str, float, float | None, float | None]:
    """(name, largest difference, noise, bound) of a recorded check, as numbers (None: not recorded)."""
    return (str(c.get("name")), _number(c.get("largest_difference", 0.0), f"{where}.largest_difference"),
            None if "noise" not in c else _number(c["noise"], f"{where}.noise"),
            None if "bound" not in c else _number(c["bound"], f"{where}.bound"))


def _resume(res: dict[str, Any], problems: list[str], computed: dict[str, str], rec_version: int) -> None:
    prov = res.get("provenance")
    if prov == "not_applicable" or res.get("status") == "not_applicable":
        computed["resume"] = "not_applicable"
        return
    if prov != "measured":
        return
    checks = res["checks"]
    names = [c["name"] for c in checks]
    ok = bool(checks) and all(c["status"] == "pass" for c in checks)
    missing = [n for n in REQUIRED_CHECKS if n not in names]
    if ok and missing:
        problems.append(f"resume passes without the checks {', '.join(missing)}")
        ok = False
    rule = _rule(res, rec_version)
    ok = _steps_in_order(res, problems) and ok
    for i, c in enumerate(checks):  # each passing tolerance check within its tier's bound
        if c.get("kind") == "tolerance" and c["status"] == "pass":
            found = rule.check_problems(*_bounded(c, f"resume.checks[{i}]"))
            problems.extend(found)
            ok = ok and not found
    loss = next((c for c in checks if c.get("name") == "loss"), None)
    _, _, noise, bound = _bounded(loss, "resume check loss") if loss else ("loss", 0.0, None, None)
    for i, row in enumerate(res.get("comparison", [])):
        ref, got = _number(row["loss_reference"], "loss_reference"), _number(row["loss_resumed"], "loss_resumed")
        diff = _number(row["difference"], f"resume.comparison[{i}].difference")
        if not (math.isnan(diff) and (math.isnan(ref) or math.isnan(got))) and abs(abs(ref - got) - diff) > 1e-12:
            problems.append(f"resume.comparison[{i}].difference is {diff}, |reference - resumed| is {abs(ref - got)}")
        twin = row.get("loss_twin")
        found = rule.row_problems(row.get("step"), ref, abs(ref - got), noise, bound,
                                  None if twin is None else _number(twin, f"resume.comparison[{i}].loss_twin"))
        if found and ok:
            problems.extend(found)
            ok = False
    computed["resume"] = "pass" if ok else "fail"
    if res.get("status") != computed["resume"]:
        problems.append(f"resume.status says {res.get('status')}, its checks say {computed['resume']}")
