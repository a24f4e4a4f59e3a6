"""The value rules of an acceptance record, checked over every table and array (docs/record.md, "Values").

:func:`core.record.shape.schema_problems` checks the record's shape (its tables, provenances, verdict statuses, sign-off);
:func:`value_problems` walks every key and element below it and holds each value to the rules here, so that a NaN, a
naive time or a float step number deep in a table is a schema finding, not a verdict computed from it.

Rules applied everywhere:

- a key is a non-empty string;
- a float is finite: the writer spells a non-finite measurement ``"nan"``, ``"inf"`` or ``"-inf"``
  (:func:`core.record.written.clean`), so a TOML ``nan`` or ``inf`` was not written by gpuaccept;
- a date-time sits only at a key ending ``_utc`` and carries the UTC offset; local dates and times are never written;
- the first rule of :data:`RULES` whose pattern matches a value's path gives its kind (:data:`KINDS`).

The ``spec`` table is held to :class:`core.spec.RunSpec` itself (each key present has its field's type) and to the
rules applied everywhere; :data:`RULES` hold for the other tables.
"""
from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Callable
from fnmatch import fnmatchcase
from typing import Any

#: A 64-digit lowercase hex digest: sha256 of a file, a split or the spec.
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: How the writer spells a measurement that is not finite (a diverged loss, its perplexity).
NON_FINITE = ("nan", "inf", "-inf")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


#: kind -> (test, what the value must be, as the finding says it).
KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "count": (lambda v: _is_int(v) and v >= 0, "a count (an integer >= 0)"),
    "number": (_is_number, "a finite number"),
    "nonneg": (lambda v: _is_number(v) and v >= 0, "a finite number >= 0"),
    "measured": (lambda v: _is_number(v) or v in NON_FINITE,
                 "a number (a non-finite one spelled \"nan\", \"inf\" or \"-inf\")"),
    "str": (lambda v: isinstance(v, str), "a string"),
    # a criterion's threshold or judged value: a number (a non-finite one spelled out) or a name (resume_tier's)
    "judged": (lambda v: _is_number(v) or isinstance(v, str), "a number or a name"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "utc": (lambda v: isinstance(v, dt.datetime) and v.utcoffset() == dt.timedelta(0),
            "a UTC date-time with its offset"),
    "sha256": (lambda v: isinstance(v, str) and bool(_SHA256.fullmatch(v)), "a sha256 (64 lowercase hex digits)"),
    # not_applicable: a table of a command record whose stage does not apply (core/record/command.py says which)
    "provenance": (lambda v: v in ("measured", "estimated", "not_run", "not_applicable"),
                   "measured, estimated, not_run or not_applicable"),
}

_COUNT_NAMES = ("step", "steps", "*_step", "*_steps", "rank", "*_rank", "world_size", "seed", "*_seed", "parameters",
                "parameters_*", "*_parameters", "total", "trainable", "blocks", "*_blocks", "*_blocks_evaluated", "*_documents", "tokens",
                "threads", "*_threads", "cpu_count", "nnodes", "nproc_per_node", "batch_size", "seq_len", "grad_accum",
                "r", "alpha", "tp", "*_every", "kill_after_checkpoint", "questions_asked", "score",
                "killed_process_group", "lora_modules_adapted", "schema_version", "index", "allocations", "*_segments")
_STR_NAMES = ("status", "method", "evidence", "why", "summary", "name", "kind", "note", "label", "at", "device",
              "host", "operator", "role", "comment", "decision", "log", "tool", "tool_version", "run_dir",
              "capacity_source")
_BOOL_NAMES = ("fits", "correct", "check", "cuda_available")

#: (pattern, kind): the first whose pattern matches a value's path decides its kind. A path is written as the record's
#: keys joined by dots with ``[]`` for an array element (``probe.devices[].peak_bytes``); a pattern is an fnmatch
#: pattern over the whole path (``*`` also crosses dots), so the specific patterns come first.
RULES: tuple[tuple[str, str], ...] = (
    # measurements that may honestly be non-finite: a diverged loss, its perplexity, their differences
    ("evaluation.*.mean_nll", "measured"), ("evaluation.*.perplexity", "measured"),
    ("evaluation.*.accuracy", "number"), ("evaluation.*.correct_tokens", "count"),
    # the criteria (core/criteria.py): thresholds, and each stage's rows (a value or threshold may be a name)
    ("accept.not_set[]", "str"), ("accept.resume_tier", "str"), ("accept.*", "nonneg"),
    ("verdict.stages.*.criteria[].criterion", "str"), ("verdict.stages.*.criteria[].met", "bool"),
    ("verdict.stages.*.criteria[].on", "str"), ("verdict.stages.*.criteria[].value", "judged"),
    ("verdict.stages.*.criteria[].threshold", "judged"),
    ("evaluation.loss_per_step[]", "measured"), ("resume.comparison[].loss_*", "measured"),
    ("resume.comparison[].difference", "measured"), ("resume.checks[].largest_difference", "measured"),
    ("resume.checks[].noise", "measured"), ("resume.checks[].bound", "measured"), ("resume.checks[].margin", "measured"), ("resume.twin_steps[]", "count"),
    # what a tolerance check is computed from (core/stages/noise.py): per tensor [name, distance, reference's norm, a
    # distance per noise pair] (schema 6: [name, distance, twin's distance, reference's norm]), per step and rank
    # [step, resumed, reference] and the noise family's losses; the family's members by name and its pairs
    ("resume.checks[].evidence_rows.tensors*", "judged"), ("resume.checks[].evidence_rows.members*", "str"),
    ("resume.checks[].evidence_rows.files*", "str"),
    ("resume.checks[].evidence_rows.pairs*", "count"), ("resume.checks[].evidence_rows.*", "measured"),
    ("resume.tier.twins", "count"), ("resume.tier.multiple", "nonneg"), ("resume.tier.loss_multiple", "nonneg"), ("environment.test_jitter", "nonneg"), ("environment.test_fault", "str"),
    # the sign-off's override of a verdict that is not pass: the operator's reason, the stages it accepted
    ("signoff.override", "str"), ("signoff.overridden[]", "str"),
    # bytes keyed by component or category name
    ("plan.devices[].components.*", "count"), ("plan.devices[].phases.*.components.*", "count"),
    ("plan.traced.components.*", "count"), ("plan.traced.categories.*", "count"),
    ("plan.traced.phases.*", "count"),
    # the caching allocator's prediction (core/plan/traced.py ReservedPrediction, device_memory)
    ("*.fragmentation", "nonneg"), ("*.alloc_conf", "str"), ("*.workspace_method", "str"),
    ("plan.traced.device_memory.methods.*", "str"), ("plan.traced.device_memory.slack[].what", "str"),
    ("plan.traced.device_memory.slack[].bytes", "count"),
    ("probe.placement.*.bytes", "count"), ("*.findings[]", "str"), ("*.problems[]", "str"),
    # how the probe's speed was timed: 1-based steps, seconds per step, and two yes/no facts
    ("probe.timing.*_steps[]", "count"), ("probe.timing.timed_tracked", "bool"),
    ("probe.timing.warmup_excluded", "bool"), ("probe.devices*.step_times_s[]", "nonneg"),
    ("*lora_targets_resolved[]", "str"), ("spec.lora.targets[]", "str"),
    ("plan.devices[].methods.*", "str"), ("plan.sources.*", "str"), ("plan.ignored.*", "str"),
    ("resume.checkpoint_manifest.*", "sha256"),
    ("spec.hash", "sha256"), ("data.*_hash", "sha256"),
    ("resume.compared_steps[]", "count"), ("*_per_step[]", "number"), ("*error_pct", "number"), ("*_pct", "nonneg"),
    ("*.rtol", "nonneg"), ("*learning_rate", "number"), ("*.heldout_fraction", "number"),
    ("*_utc", "utc"), ("*_bytes", "count"), ("*.seconds", "nonneg"), ("*_s", "nonneg"),
    ("provenance", "provenance"), ("*.provenance", "provenance"),
    *((("*." + n) if not n.startswith("*") else n, "count") for n in _COUNT_NAMES),
    *(("*." + n, "str") for n in _STR_NAMES), *(("*." + n, "bool") for n in _BOOL_NAMES),
    *((n, "count") for n in _COUNT_NAMES if not n.startswith("*")), *((n, "str") for n in _STR_NAMES),
)


def kind_of(path: str) -> str | None:
    """The kind :data:`RULES` gives a value at ``path`` (``probe.devices[].peak_bytes``), or None: no rule."""
    return next((kind for pattern, kind in RULES if fnmatchcase(path, pattern)), None)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _walk(value: Any, path: str, where: str, out: list[str], rules: bool = True) -> None:
    """Append to ``out`` what breaks a rule at or below ``value`` (``path``: pattern form; ``where``: with indices)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str) or not key.strip():
                out.append(f"{where or 'the record'} has an empty key")
                continue
            _walk(item, f"{path}.{key}" if path else key, f"{where}.{key}" if where else key, out, rules)
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _walk(item, path + "[]", f"{where}[{i}]", out, rules)
        return
    if isinstance(value, float) and not math.isfinite(value):
        out.append(f"{where} is {value!r} as a TOML float; gpuaccept writes a non-finite measurement as the string "
                   f"\"{value!r}\", and only where a loss may diverge")
        return
    kind = kind_of(path) if rules else None
    if isinstance(value, (dt.date, dt.time)) and kind != "utc":
        out.append(f"{where} is a date or time ({value!s}); date-times belong only at keys ending _utc")
        return
    if kind is None:
        return
    test, what = KINDS[kind]
    if not test(value):
        out.append(f"{where} is {_show(value)}, not {what}")


def _spec_problems(spec: dict[str, Any]) -> list[str]:
    """Each key of the record's spec table that a setting of :class:`core.spec.RunSpec` names (core/settings.py: the
    top-level keys and the sub-tables, not ``[accept]``, which the record keeps apart) has that setting's kind: ints
    are ints (not bools or floats), floats finite numbers, strings strings, lists lists of strings."""
    from core.settings import KIND_WORDS, value_fits
    from core.spec import spec_settings

    settings = [s for s in spec_settings() if s.table != "accept"]
    out: list[str] = []
    for name in dict.fromkeys(s.table for s in settings if s.table is not None):
        if name in spec and not isinstance(spec[name], dict):
            out.append(f"spec.{name} is {_show(spec[name])}, not a table")
    for s in settings:
        holder = spec if s.table is None else spec.get(s.table)
        if not isinstance(holder, dict) or s.name not in holder:
            continue
        value = holder[s.name]
        ok = value_fits(s.kind, value) and (s.kind != "int" or _is_int(value)) and (
            s.kind != "float" or _is_number(value))
        if not ok:
            want = KIND_WORDS[s.kind] if s.kind in ("list", "table") else s.kind
            out.append(f"spec.{s.key} is {_show(value)}, not {want} (as the spec takes it)")
    return out


def value_problems(rec: dict[str, Any]) -> list[str]:
    """What in ``rec`` (a parsed record) breaks a value rule, each naming its path (``probe.devices[0].peak_bytes``);
    empty when every value conforms. Never raises on a parsed TOML document."""
    out: list[str] = []
    for key, value in rec.items():
        # the spec table's kinds are the spec's own field types (_spec_problems); the generic rules hold there too
        _walk({key: value}, "", "", out, rules=key != "spec")
    if isinstance(rec.get("spec"), dict):
        out.extend(_spec_problems(rec["spec"]))
    return out
