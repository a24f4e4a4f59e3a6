"""``gpuaccept diff RECORD...``: acceptance records side by side.

The first record is the baseline; every other column says its change from it (the difference, and for a measured
number its size in percent). What is compared (docs/record.md, "Comparing records"):

- **environment**: host, GPUs, NVIDIA driver, CUDA, torch, transformers, peft, Python, CPU threads;
- **spec**: its hash, and each setting that differs (the criteria, ``accept``, are apart: runs judged by other
  thresholds still compare);
- per device: the plan's bytes and the measured peak (and, on the CPU, peak RSS), against the capacity;
- the probe's step time and tokens per second; held-out quality before and after training, next-token accuracy;
  the resume result and its tier; each stage's verdict; the sign-off's override of a verdict that did not pass,
  when a record holds one.

**Comparable** means the same spec hash (and the same kind of record): then a difference in a measurement is the box's,
the driver's or a library's. With another spec it is marked NOT COMPARABLE, with the settings that differ: the numbers
are still shown, but a change in them says nothing about the box.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.bounds import loads_bounded
from core.methods import trains
from core.record.summary import _json_number, box_of, device_rows, quality
from core.status import PASSING

GIB = 2**30
DIFF_SCHEMA = "gpuaccept.diff/1"


@dataclass(frozen=True)
class Row:
    """One compared quantity: its name, one value per record (None: absent), its unit (``bytes``, ``s``, ``/s``,
    or empty for a setting or a name), and whether it differs from the baseline."""

    section: str
    name: str
    values: list[Any]
    unit: str = ""

    @property
    def differs(self) -> bool:
        return any(v != self.values[0] for v in self.values[1:])

    def changes(self) -> list[dict[str, Any] | None]:
        """Per record after the first, its change from the baseline: ``{"by": difference, "pct": percent}`` for
        numbers (pct None when the baseline is 0), None when equal or not numbers."""
        out: list[dict[str, Any] | None] = []
        base = self.values[0]
        for v in self.values[1:]:
            if v == base or not _numeric(v) or not _numeric(base):
                out.append(None)
                continue
            out.append({"by": v - base, "pct": 100 * (v - base) / base if base else None})
        return out


def _numeric(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class Comparison:
    """Records side by side: their labels, whether they are comparable (and why not), and the rows."""

    labels: list[str]
    paths: list[str]
    comparable: bool
    why: str
    rows: list[Row] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The ``gpuaccept diff --json`` object (docs/record.md, "JSON outputs")."""
        return {"schema": DIFF_SCHEMA, "records": [{"label": label, "path": p} for label, p in
                                                   zip(self.labels, self.paths)],
                "comparable": self.comparable, "why": self.why,
                "rows": [{"section": r.section, "name": r.name, "unit": r.unit, "values": r.values,
                          "differs": r.differs, "changes": r.changes()} for r in self.rows]}


def load(path: Path) -> dict[str, Any]:
    """A record, parsed.

    Raises:
        FileNotFoundError: no such file (a folder: the ``record.toml`` in it).
        ValueError: not a TOML file (or one nested deeper, or holding a longer string, than core.bounds reads),
            or not a gpuaccept record.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "record.toml"
    if not path.is_file():
        raise FileNotFoundError(f"record {path} not found")
    try:
        rec = loads_bounded(path.read_text(encoding="utf-8"))  # bounded: core/bounds.py
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not a TOML record ({exc})") from None
    if rec.get("tool") != "gpuaccept" or not isinstance(rec.get("spec"), dict):
        raise ValueError(f"{path} is not a gpuaccept acceptance record")
    return rec


def flatten(table: Any, prefix: str = "") -> dict[str, Any]:
    """``{"lora": {"r": 8}}`` -> ``{"lora.r": 8}`` (lists kept whole)."""
    if not isinstance(table, dict):
        return {prefix: table}
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}.{key}" if prefix else key
        out.update(flatten(value, name) if isinstance(value, dict) else {name: value})
    return out


def spec_differences(recs: list[dict[str, Any]]) -> list[str]:
    """The spec settings (dotted names) whose values are not the same in every record (the model's path included:
    the same model at another path hashes apart)."""
    specs = [{k: v for k, v in flatten(r["spec"]).items() if k != "hash"} for r in recs]
    keys = sorted(set().union(*specs))
    return [k for k in keys if any(s.get(k) != specs[0].get(k) for s in specs[1:])]


def label_of(path: Path) -> str:
    """A record's short name: its run folder's name for a ``record.toml`` (or a folder given), else the file's."""
    path = Path(path)
    if path.is_dir():
        return path.resolve().name
    return path.resolve().parent.name if path.name == "record.toml" else path.stem


def compare(paths: list[Path]) -> Comparison:
    """Records ``paths`` side by side, the first as the baseline.

    Raises:
        ValueError: fewer than two records, or one is not a gpuaccept record (:func:`load`).
        FileNotFoundError: a path that does not exist.
    """
    if len(paths) < 2:
        raise ValueError("gpuaccept diff compares two or more records; give at least two record.toml paths")
    recs = [load(p) for p in paths]
    kinds = {r.get("kind", "recipe") for r in recs}
    hashes = {r["spec"].get("hash") for r in recs}
    differ = spec_differences(recs)
    if len(kinds) > 1:
        comparable, why = False, "NOT COMPARABLE: a command-mode record beside a recipe's (different stages)"
    elif len(hashes) > 1:
        comparable, why = False, ("NOT COMPARABLE: the specs differ (" + ", ".join(differ[:8])
                                  + (", ..." if len(differ) > 8 else "") + "): a change below is the spec's, "
                                  "not only the box's")
    else:
        comparable, why = True, (f"comparable: the same spec (hash {next(iter(hashes))[:12]}); a change below is the "
                                 "box's, the driver's or a library's")
    rows = _environment_rows(recs) + [Row("spec", "hash", [r["spec"].get("hash", "")[:12] for r in recs])]
    rows += [Row("spec", key, [flatten(r["spec"]).get(key) for r in recs]) for key in differ if key != "hash"]
    rows += _criteria_rows(recs) + _device_rows(recs) + _result_rows(recs)
    return Comparison([label_of(p) for p in paths], [str(p) for p in paths], comparable, why, rows)


def _environment_rows(recs: list[dict[str, Any]]) -> list[Row]:
    envs = [r.get("environment", {}) for r in recs]
    rows = [Row("environment", "box", [box_of(r) for r in recs])]
    for key, name in (("nvidia_driver", "NVIDIA driver"), ("cuda_runtime", "CUDA runtime"),
                      ("cuda_driver_api", "CUDA driver API"), ("torch", "torch"), ("transformers", "transformers"),
                      ("peft", "peft"), ("bitsandbytes", "bitsandbytes"), ("python", "Python"),
                      ("torch_threads", "torch threads")):
        rows.append(Row("environment", name, [e.get(key) for e in envs]))
    return rows


def _criteria_rows(recs: list[dict[str, Any]]) -> list[Row]:
    tables = [{k: v for k, v in r.get("accept", {}).items() if k != "not_set"} for r in recs]
    keys = sorted(set().union(*tables))
    return [Row("criteria", key, [t.get(key) for t in tables]) for key in keys
            if any(t.get(key) != tables[0].get(key) for t in tables[1:])]


#: The memory rows per device: (field, name). ``plan peak`` is what the plan's fit is judged by, its overhead line
#: included (the ``[plan]`` line of a headless run says the same number); ``planned tensors`` is that peak without the
#: overhead line, as the probe compares it with the measured peak of tensors (``probe.plan_comparison``).
MEMORY_ROWS = (("plan_peak_bytes", "plan peak"), ("planned_bytes", "planned tensors"),
               ("peak_bytes", "measured peak"), ("peak_rss_bytes", "peak RSS"), ("capacity_bytes", "capacity"))


def _memory_of(rec: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    """:func:`core.record.summary.device_rows` by (device, rank), with ``plan_peak_bytes`` (the bytes the fit was
    judged by: ``fit_bytes``, or ``total_bytes`` in a record without it) and, without a probe's comparison,
    ``planned_bytes`` as the probe would compare it: that peak less the overhead line."""
    plan = {str(d.get("name")): d for d in rec.get("plan", {}).get("devices", []) if isinstance(d, dict)}
    measured = rec.get("probe", {}).get("provenance") == "measured"
    out = {}
    for row in device_rows(rec):
        d = plan.get(row["device"], {})
        peak: Any = d.get("fit_bytes", d.get("total_bytes"))
        overhead: Any = (d.get("components") or {}).get("overhead")
        if not measured:
            row = {**row, "planned_bytes": peak - overhead if _numeric(peak) and _numeric(overhead) else None}
        out[(row["device"], row["rank"])] = {**row, "plan_peak_bytes": peak}
    return out


def _device_rows(recs: list[dict[str, Any]]) -> list[Row]:
    per = [_memory_of(r) for r in recs]
    keys = sorted(set().union(*per), key=lambda k: (k[1], k[0]))
    rows = []
    for key in keys:
        where = key[0] if key[1] == 0 else f"rank {key[1]} ({key[0]})"
        for field_name, name in MEMORY_ROWS:
            values = [p.get(key, {}).get(field_name) for p in per]
            if any(v is not None for v in values):
                rows.append(Row("memory", f"{where} {name}", values, "bytes"))
    return rows


def _result_rows(recs: list[dict[str, Any]]) -> list[Row]:
    q = [quality(r) for r in recs]
    rows = [Row("speed", "step time", [_json_number(r.get("probe", {}).get("step_time_s")) for r in recs], "s"),
            Row("speed", "tokens/s", [_json_number(r.get("probe", {}).get("tokens_per_s")) for r in recs], "/s"),
            Row("quality", "metric", [x["metric"] for x in q])]
    for key, name in _quality_names(recs):
        rows.append(Row("quality", name, [x[key] for x in q]))
    rows.append(Row("quality", "training time", [_json_number(r.get("evaluation", {}).get("training_time_s"))
                                                 for r in recs], "s"))
    rows.append(Row("resume", "status", [r.get("resume", {}).get("status", "not_run") for r in recs]))
    rows.append(Row("resume", "tier", [(r.get("resume", {}).get("tier") or {}).get("name") for r in recs]))
    failed = [", ".join(c.get("name", "?") for c in r.get("resume", {}).get("checks", [])
                        if isinstance(c, dict) and c.get("status") not in PASSING) or "none" for r in recs]
    rows.append(Row("resume", "checks failed", failed))
    for stage in ("plan", "probe", "evaluation", "resume"):
        rows.append(Row("verdict", stage, [r.get("verdict", {}).get("stages", {}).get(stage, {}).get("status")
                                           for r in recs]))
    rows.append(Row("verdict", "overall", [r.get("verdict", {}).get("status") for r in recs]))
    return rows + _signoff_rows(recs)


def _signoff_rows(recs: list[dict[str, Any]]) -> list[Row]:
    """When a record's sign-off overrides its verdict (accepted although a stage did not pass): each record's
    decision, the override's reason and the stages it overrode (None: no sign-off, no override). No rows when no
    record holds an override."""
    offs: list[dict[str, Any]] = [r["signoff"] if isinstance(r.get("signoff"), dict) else {} for r in recs]
    if not any("override" in so for so in offs):
        return []
    return [Row("signoff", "decision", [so.get("decision", so.get("status")) for so in offs]),
            Row("signoff", "override", [so.get("override") for so in offs]),
            Row("signoff", "overridden", [so.get("overridden") for so in offs])]


def _quality_names(recs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(key of :func:`core.record.summary.quality`, row name): an inference record has no training, so its one
    measurement (stored as ``before``) is the held-out perplexity of the fixed weights; a row beside a training
    record says what holds for both: not fine-tuned (yet)."""
    inference = [not trains(r.get("spec", {}).get("mode")) for r in recs]
    if all(inference):
        return [("before", "held-out perplexity"), ("after", "after training"),
                ("accuracy_before", "held-out accuracy"), ("accuracy_after", "accuracy after")]
    if any(inference):
        return [("before", "held-out, not fine-tuned"), ("after", "after training"),
                ("accuracy_before", "accuracy, not fine-tuned"), ("accuracy_after", "accuracy after")]
    return [("before", "before training"), ("after", "after training"),
            ("accuracy_before", "accuracy before"), ("accuracy_after", "accuracy after")]


def _cell(value: Any, unit: str) -> str:
    if value is None:
        return "-"
    if value == "":  # an empty setting, not an absent one: the two never read alike
        return '""'
    if isinstance(value, list) and not value:
        return "[]"
    if unit == "bytes" and _numeric(value):
        return f"{value / GIB:.2f} GiB"  # as on every screen and the [plan] line: GiB = 2^30, 2 decimals
    if isinstance(value, float):
        return f"{value:.6g}{' ' + unit if unit else ''}"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return f"{value}{' ' + unit if unit and _numeric(value) else ''}"


def _change(change: dict[str, Any] | None, unit: str) -> str:
    if change is None:
        return ""
    by = change["by"]
    if unit == "bytes":  # below 0.1 GiB in MiB: a small change never reads +0.00 GiB
        size = f"{by / GIB:+.2f} GiB" if abs(by) >= 0.1 * GIB else f"{by / 2**20:+.1f} MiB"
    else:
        size = f"{by:+.6g}" + (f" {unit}" if unit else "")
    return f" ({size}" + (f", {change['pct']:+.1f} %)" if change["pct"] is not None else ")")


def format_comparison(c: Comparison, everything: bool = False) -> str:
    """The comparison in text, for an 80-column terminal: one line per quantity, ``baseline | other (change)``;
    a ``*`` marks what differs. Without ``everything``, the environment rows and the metric's definition are shown
    only where they differ (the box always)."""
    lines = [f"{chr(65 + i)} = {label}" for i, label in enumerate(c.labels)]
    lines += [c.why, ""]
    shown = [r for r in c.rows if everything or r.differs or _always(r)]
    width = min(28, max(len(r.name) for r in shown))
    section = ""
    for r in shown:
        if r.section != section:
            section = r.section
            lines.append(section)
        texts = [_cell(v, r.unit) for v in r.values]
        at = _first_difference(texts)
        cells = [_short(texts[0], at=at)]
        cells += [_short(t, at=at) + _change(ch, r.unit) for t, ch in zip(texts[1:], r.changes())]
        lines.append(f"{'*' if r.differs else ' '} {r.name:<{width}} " + " | ".join(cells))
    lines += ["", "* differs from A; a change is (B - A, and its size in % of A)"]
    if any(r.section == "memory" for r in shown):
        lines.append("plan peak: what the plan's fit is judged by, its overhead line (CUDA context, or the CPU's "
                     "runtime) included, as the [plan] line says; planned tensors: that peak without the overhead "
                     "line, compared with the measured peak of tensors")
    return "\n".join(lines)


def _always(r: Row) -> bool:
    """Shown even when equal: every row but the environment's (the box excepted) and the metric's definition."""
    if r.section == "environment":
        return r.name == "box"
    return r.name != "metric"


def _first_difference(texts: list[str]) -> int:
    """Where the first of ``texts`` that differs from the baseline's (``texts[0]``) starts to differ; 0 when none
    does."""
    base = texts[0]
    for t in texts[1:]:
        if t != base:
            return next((i for i, (a, b) in enumerate(zip(base, t)) if a != b), min(len(base), len(t)))
    return 0


def _short(text: str, most: int = 40, at: int = 0) -> str:
    """``text`` in at most ``most`` characters; a long one cut so that the character at ``at`` (where two values
    start to differ) is shown: two cut values that differ never read the same."""
    if len(text) <= most:
        return text
    if at < most - 3:
        return text[: most - 3] + "..."
    start = min(at - 8, len(text) - (most - 3))
    tail = text[start:]
    return "..." + (tail if len(tail) <= most - 3 else tail[: most - 6] + "...")
