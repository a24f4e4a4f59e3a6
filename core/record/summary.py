"""Machine-readable results: the summary of a run, of a verification, and of a folder of records.

The objects are plain JSON (``null`` where the record has no value); their schemas are docs/record.md, "JSON outputs",
and each carries its name and version in ``schema`` (``gpuaccept.run/1``, ``gpuaccept.verify/1``,
``gpuaccept.verify-folder/1``) so a reader can refuse what it does not know.

- :func:`run_summary`: what ``gpuaccept run --headless --json`` prints once the run ends (the verdict, each stage with
  its criteria, per device the plan, the measured peak and the capacity, speed, quality, the resume result);
- :func:`verification_summary`: ``gpuaccept verify --json``;
- :func:`folder_rows` / :func:`folder_summary`: ``gpuaccept verify DIR``, every record below a folder.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from core.bounds import MAX_RECORD_FILE, loads_bounded, read_input_text, special_file_kind
from core.record.verify import EXIT_VERIFIED, Verification, verify

RUN_SCHEMA = "gpuaccept.run/1"
VERIFY_SCHEMA = "gpuaccept.verify/1"
FOLDER_SCHEMA = "gpuaccept.verify-folder/1"

#: What each exit code of ``verify`` means, in words (docs/record.md, "Exit codes").
RESULTS = {0: "verified", 3: "unsigned (consistent)", 4: "bad signature", 5: "schema invalid",
           6: "verdict does not follow from the data", 7: "signature good, signer not checked",
           8: "signature intact, signer not allowed"}
#: The order in which several records' exit codes give one for the folder (the single record's order).
EXIT_PRIORITY = (4, 8, 5, 6, 3, 7, 0)


def _json_number(value: Any) -> float | int | None:
    """A record number as JSON: the writer's ``"nan"`` / ``"inf"`` spellings and anything not a number are None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if value == value and value not in (float("inf"), float("-inf")) else None


def device_rows(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """Per probed device (or planned device, when the probe did not measure): its name, rank, the plan's bytes it
    was compared with, the measured peak (``peak_bytes``: CUDA's peak allocated, the CPU's peak of tensors), the
    process's peak RSS, the capacity of its planned device, in bytes (None: not known or not run)."""
    plan, probe = rec.get("plan", {}), rec.get("probe", {})
    capacity = {str(d.get("name")): d.get("capacity_bytes") for d in plan.get("devices", []) if isinstance(d, dict)}
    total = {str(d.get("name")): d.get("total_bytes") for d in plan.get("devices", []) if isinstance(d, dict)}
    planned = {(str(c.get("device")), c.get("rank", 0)): c.get("planned_bytes")
               for c in probe.get("plan_comparison", []) if isinstance(c, dict)}
    rows = []
    measured = probe.get("devices", []) if probe.get("provenance") == "measured" else []
    for d in measured:
        name, rank = str(d.get("device")), d.get("rank", 0)
        rows.append({"device": name, "rank": rank, "planned_bytes": planned.get((name, rank), total.get(name)),
                     "peak_bytes": d.get("peak_bytes"), "peak_rss_bytes": d.get("peak_rss_bytes"),
                     "capacity_bytes": capacity.get(name)})
    if not measured:
        rows = [{"device": name, "rank": 0, "planned_bytes": total[name], "peak_bytes": None, "peak_rss_bytes": None,
                 "capacity_bytes": capacity.get(name)} for name in total]
    return rows


def quality(rec: dict[str, Any]) -> dict[str, Any]:
    """The evaluation's metric and its values before and after training (the base and the final checkpoint in
    command mode), with next-token accuracy when it was counted; None where not measured."""
    ev = rec.get("evaluation", {})
    out: dict[str, Any] = {"status": ev.get("status", "not_run"), "metric": ev.get("metric")}
    for when in ("before", "after"):
        point = ev.get(when)
        point = point if isinstance(point, dict) and point.get("provenance") != "not_run" else {}
        out[when] = _json_number(point.get("perplexity", point.get("value")))
        out[f"accuracy_{when}"] = _json_number(point.get("accuracy"))
    return out


def run_summary(rec: dict[str, Any] | None, record_path: Path | None, status: str) -> dict[str, Any]:
    """The ``gpuaccept run --headless --json`` object of a finished run (``rec``: its record, None when none was
    written; ``status``: the run's verdict as the pipeline ended it)."""
    if rec is None:
        return {"schema": RUN_SCHEMA, "verdict": status, "record": None, "stages": {}, "devices": []}
    stages = rec.get("verdict", {}).get("stages", {})
    probe, resume = rec.get("probe", {}), rec.get("resume", {})
    return {
        "schema": RUN_SCHEMA,
        "verdict": rec.get("verdict", {}).get("status", status),
        "record": str(record_path) if record_path else None,
        "kind": rec.get("kind", "recipe"),
        "spec_hash": rec.get("spec", {}).get("hash"),
        "mode": rec.get("spec", {}).get("mode"),
        "host": rec.get("environment", {}).get("host"),
        "stages": {name: {"status": st.get("status"), "evidence": st.get("evidence"),
                          "criteria": st.get("criteria", [])} for name, st in stages.items()},
        "accept": rec.get("accept", {}),
        "devices": device_rows(rec),
        "step_time_s": _json_number(probe.get("step_time_s")),
        "tokens_per_s": _json_number(probe.get("tokens_per_s")),
        "quality": quality(rec),
        "resume": {"status": resume.get("status", "not_run"), "tier": (resume.get("tier") or {}).get("name")},
        "signed": rec.get("signoff", {}).get("status") != "unsigned",
    }


def verification_summary(path: Path, result: Verification) -> dict[str, Any]:
    """The ``gpuaccept verify --json`` object: the record, the exit code and its meaning, each check's findings, and
    the sign-off as the record states it (``signoff``: null when unsigned; its ``override``, null without one)."""
    sig = result.signature
    so = result.signoff
    signoff = None if not so or so.get("status") == "unsigned" else {
        "operator": so.get("operator"), "role": so.get("role"), "decision": so.get("decision"),
        "comment": so.get("comment"), "override": result.override()}
    return {"schema": VERIFY_SCHEMA, "record": str(path), "exit_code": result.exit_code,
            "result": RESULTS[result.exit_code],
            "signature": {"status": sig.status, "detail": sig.detail, "signer_checked": bool(sig.signer_checked)},
            "schema_problems": list(result.schema), "verdict_problems": list(result.verdicts),
            "signoff": signoff, "verified": result.exit_code == EXIT_VERIFIED}


def records_below(folder: Path) -> list[Path]:
    """The records at or below ``folder``, in path order: every ``record.toml`` (even one that no longer parses: it
    is reported, not skipped) and every other ``*.toml`` that is a gpuaccept record (``tool = "gpuaccept"`` with a
    verdict; a run folder's ``spec.toml`` is not).

    Raises:
        NotADirectoryError: ``folder`` is not a folder.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise NotADirectoryError(f"{folder} is not a folder")
    found = []
    for path in sorted(folder.rglob("*.toml")):
        if path.name.startswith("."):  # a writer's temporary file (core.record.written.write_record), not a record
            continue
        if path.name == "record.toml" or special_file_kind(path) not in (None, "a directory"):
            found.append(path)  # a FIFO or a device named like a record: a row of its own, never opened
            continue
        try:
            rec = loads_bounded(read_input_text(path, "a gpuaccept record", MAX_RECORD_FILE))
        except (OSError, tomllib.TOMLDecodeError):
            continue
        if rec.get("tool") == "gpuaccept" and "verdict" in rec:
            found.append(path)
    return found


def box_of(rec: dict[str, Any]) -> str:
    """The box a record was measured on, in words: its host and its GPUs (``host: 2x NVIDIA H200``), or ``host
    (CPU)``; a cluster record's nodes (``2 nodes: node0, node1``)."""
    nodes = rec.get("nodes") if isinstance(rec, dict) and rec.get("kind") == "cluster" else None
    if isinstance(nodes, list):  # a cluster record: the hosts of its nodes
        return f"{len(nodes)} nodes: " + ", ".join(str(n.get("host", "?")) for n in nodes if isinstance(n, dict))
    env = rec.get("environment", {}) if isinstance(rec, dict) else {}
    gpus = [str(g.get("name")) for g in env.get("gpus", []) if isinstance(g, dict)]
    host = str(env.get("host", "?"))
    if not gpus:
        return f"{host} (CPU)"
    names = sorted(set(gpus))
    return f"{host}: " + ", ".join(f"{gpus.count(n)}x {n}" for n in names)


def folder_rows(folder: Path, allowed_signers: Path | None = None, identity: str | None = None
                ) -> list[dict[str, Any]]:
    """One row per record below ``folder``: its path, box, the verdict it states, its signature's status and what
    ``verify`` found (its exit code and result)."""
    rows = []
    for path in records_below(folder):
        result = verify(path, allowed_signers, identity)
        try:
            rec = loads_bounded(read_input_text(path, "a gpuaccept record", MAX_RECORD_FILE))
        except (OSError, tomllib.TOMLDecodeError):
            rec = {}
        verdict = rec.get("verdict", {}) if isinstance(rec.get("verdict"), dict) else {}
        rows.append({"record": str(path), "box": box_of(rec), "verdict": verdict.get("status", "?"),
                     "spec_hash": rec.get("spec", {}).get("hash") if isinstance(rec.get("spec"), dict) else None,
                     "signature": result.signature.status, "exit_code": result.exit_code,
                     "result": RESULTS[result.exit_code]})
    return rows


def folder_exit_code(rows: list[dict[str, Any]]) -> int:
    """The folder's exit code: the first of :data:`EXIT_PRIORITY` any record has (0 only when every one verified;
    a folder with no record is a usage error, 2)."""
    if not rows:
        return 2
    codes = {r["exit_code"] for r in rows}
    return next(c for c in EXIT_PRIORITY if c in codes)


def folder_summary(folder: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``gpuaccept verify DIR --json`` object."""
    return {"schema": FOLDER_SCHEMA, "folder": str(folder), "exit_code": folder_exit_code(rows), "records": rows}


def format_folder(rows: list[dict[str, Any]], root: Path) -> str:
    """The folder's table in text: record (relative to ``root``), box, verdict, signature, what verify found."""
    if not rows:
        return f"no record.toml below {root}"
    def rel(p: str) -> str:
        try:
            return str(Path(p).relative_to(root))
        except ValueError:
            return p

    table = [("record", "box", "verdict", "signature", "verify")]
    table += [(rel(r["record"]), r["box"], r["verdict"], r["signature"], r["result"]) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table)
