"""What a run of the user's command left to read: the Trainer hook's events, the metrics file, the checkpoints.

Each reader returns typed values and the problems it found (a line that is not JSON, a step without a loss), never
raises on the user's files: a command that writes no metrics or no checkpoint gets a verdict that says so.

- :func:`read_hook_events`: the JSON lines of ``core/child/inject/trainer_hook.py`` (``trainer``, ``batches``,
  ``step``, ``save``, ``held``, ``train_end``, ``hook_error``), tailed from a byte offset.
- :func:`read_metrics` / :func:`trainer_state_steps`: a JSON-lines metrics file (``step``, ``loss``, optionally
  ``learning_rate`` or ``lr``, ``sample_ids``, ``rank``), a CSV one with a header (Lightning's ``CSVLogger``, as
  LitGPT writes it), or the ``log_history`` of Trainer's ``trainer_state.json``.

The checkpoints a run left are listed by :func:`core.stages.checkpoint.list_checkpoints` (the recipe's rule too).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.protocol.events import complete_lines


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step of a run as its metrics say it (one rank's, under torchrun).

    Attributes:
        loss: the logged loss (Trainer's: the mean over the logging window).
        learning_rate: the learning rate applied, or None when the metrics do not say.
        sample_ids: what the step trained on: the metrics' ``sample_ids``, or the sha256 digests of the micro-batches'
            ``input_ids`` the Trainer hook saw; None when neither is there.
        memory: the peak bytes the hook reported with the step (``peak_rss_bytes``, ``peak_allocated_bytes``, ...).
    """

    step: int
    loss: float
    learning_rate: float | None = None
    sample_ids: list[Any] | None = None
    rank: int = 0
    t: float = 0.0
    memory: dict[str, int] = field(default_factory=dict)


@dataclass
class HookReport:
    """Everything the Trainer hook wrote for one run (every rank's lines)."""

    trainers: list[dict[str, Any]] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    batches: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)  # (rank, step) -> batches event
    saves: list[dict[str, Any]] = field(default_factory=list)
    held: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> held event
    ends: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> train_end event
    errors: list[str] = field(default_factory=list)
    offsets: dict[str, int] = field(default_factory=dict)  # events file name -> bytes read

    @property
    def lead(self) -> dict[str, Any] | None:
        """Rank 0's ``trainer`` event (the first Trainer that began training), or None: no Trainer reported itself."""
        ranked = sorted(self.trainers, key=lambda e: (e.get("rank", 0), e.get("t", 0.0)))
        return ranked[0] if ranked else None

    @property
    def world_size(self) -> int:
        lead = self.lead
        return int(lead.get("world_size", 1)) if lead else 1

    def steps_with_batches(self) -> list[StepRecord]:
        """The logged steps, each with the digests of the micro-batches the step trained on (its ``batches`` event)
        as its sample ids."""
        out = []
        for s in self.steps:
            b = self.batches.get((s.rank, s.step))
            ids = list(b["digests"]) if b and b.get("digests") else None
            out.append(StepRecord(s.step, s.loss, s.learning_rate, ids, s.rank, s.t, s.memory))
        return out


def hook_files(path: Path) -> list[Path]:
    """The hook's events files of a run: rank 0's ``path`` and each other rank's beside it (``<stem>.rank<r>.jsonl``,
    the hook's ``rank_path``)."""
    return [path, *sorted(path.parent.glob(f"{path.stem}.rank*{path.suffix}"))]


def read_hook_events(path: Path, report: HookReport) -> list[StepRecord]:
    """Read the complete lines added to every rank's events file of the hook (:func:`hook_files`) since the last call
    into ``report``; the steps logged since then are returned. A line that is not JSON is named in ``report.errors``."""
    new: list[StepRecord] = []
    for file in hook_files(path):
        new.extend(_read_hook_file(file, report))
    return new


def _read_hook_file(path: Path, report: HookReport) -> list[StepRecord]:
    lines, report.offsets[path.name] = complete_lines(path, report.offsets.get(path.name, 0))
    new: list[StepRecord] = []
    for raw in lines:
        if not raw.strip():
            continue
        try:
            e = json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: nested past json's recursion
            report.errors.append(f"{path.name}: a line is not JSON ({raw[:80]!r})")
            continue
        if not isinstance(e, dict):
            report.errors.append(f"{path.name}: a line is not a JSON object ({raw[:80]!r})")
            continue
        kind, rank = e.get("kind"), int(e.get("rank", 0) or 0)
        if kind == "trainer":
            report.trainers.append(e)
        elif kind == "step":
            step = _step_record(e, rank)
            if step is not None:
                report.steps.append(step)
                new.append(step)
        elif kind == "batches":
            report.batches[(rank, int(e.get("step", 0)))] = e
        elif kind == "save":
            report.saves.append(e)
        elif kind == "held":
            report.held[rank] = e
        elif kind == "train_end":
            report.ends[rank] = e
        elif kind == "hook_error":
            report.errors.append(f"rank {rank} {e.get('where')}: {e.get('error')}")
    return new


MEMORY_KEYS = ("peak_rss_bytes", "peak_allocated_bytes", "peak_reserved_bytes")


def _step_record(e: dict[str, Any], rank: int) -> StepRecord | None:
    """The step of a line: an integer ``step`` (not a string, a float or a boolean) and a numeric ``loss``; None
    otherwise."""
    step, loss = e.get("step"), e.get("loss")
    if not isinstance(step, int) or isinstance(step, bool) or not isinstance(loss, (int, float)) or \
            isinstance(loss, bool):
        return None
    step, loss = int(step), float(loss)
    lr = e.get("learning_rate", e.get("lr"))
    ids = e.get("sample_ids")
    return StepRecord(step=step, loss=loss, learning_rate=float(lr) if isinstance(lr, (int, float)) else None,
                      sample_ids=list(ids) if isinstance(ids, list) else None, rank=rank,
                      t=float(e.get("t", 0.0) or 0.0),
                      memory={k: int(e[k]) for k in MEMORY_KEYS if isinstance(e.get(k), int)})


@dataclass
class MetricsFile:
    """A metrics file tailed as it grows (the user's own, inside the run's output folder): JSON lines, or CSV when its
    name ends in ``.csv``. ``lines``: the lines (JSON) or data rows (CSV) read so far."""

    path: Path
    steps: list[StepRecord] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    offset: int = 0
    lines: int = 0


def metrics_format(path: Path) -> str:
    """How a metrics file is read, in words, by its name: "CSV" (``.csv``) or "JSON lines"."""
    return "CSV" if path.suffix.lower() == ".csv" else "JSON lines"


def read_metrics(metrics: MetricsFile) -> list[StepRecord]:
    """Read the steps added to ``metrics.path`` since the last call (:func:`_read_csv` for a ``.csv`` file): one JSON
    object per line with ``step`` (an integer) and ``loss`` (a finite number), optionally ``learning_rate`` (or
    ``lr``), ``sample_ids`` (a list) and ``rank``. A line that is not such an object is named in ``metrics.problems``
    (by its line number) and skipped. Returns the new steps."""
    if metrics_format(metrics.path) == "CSV":
        return _read_csv(metrics)
    path = metrics.path
    lines, metrics.offset = complete_lines(path, metrics.offset)
    new: list[StepRecord] = []
    for raw in lines:
        metrics.lines += 1
        if not raw.strip():
            continue
        try:
            e = json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: nested past json's recursion
            metrics.problems.append(f"{path.name} line {metrics.lines}: not JSON")
            continue
        if not isinstance(e, dict):
            metrics.problems.append(f"{path.name} line {metrics.lines}: not a JSON object")
            continue
        _add_step(metrics, e, f"line {metrics.lines}", new)
    return new


def _add_step(metrics: MetricsFile, e: dict[str, Any], where: str, new: list[StepRecord]) -> None:
    """The step of one parsed line or row appended to ``metrics.steps`` and ``new``, or named in its problems."""
    if not isinstance(e.get("t"), (int, float)):
        e["t"] = time.time()  # when the line was read: within a poll (20 ms) of when it was written
    record = _step_record(e, int(e.get("rank", 0) or 0) if isinstance(e.get("rank", 0), int) else 0)
    if record is None or not math.isfinite(record.loss):
        metrics.problems.append(f"{metrics.path.name} {where}: needs an integer step and a finite loss")
        return
    metrics.steps.append(record)
    new.append(record)


def _read_csv(metrics: MetricsFile) -> list[StepRecord]:
    """The data rows of a CSV metrics file beyond the ``metrics.lines`` read before. The whole file is read each time:
    Lightning's ``CSVLogger`` rewrites it, with a wider header, when a metric first appears (``val_loss`` after an
    evaluation). A row with an empty ``loss`` holds other metrics and is skipped; a partly written last line waits
    for the next read. Columns: ``step`` and ``loss`` (numbers as text), optionally ``learning_rate`` (or ``lr``)."""
    try:
        text = metrics.path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    complete = text[:text.rfind("\n") + 1]
    rows = list(csv.DictReader(io.StringIO(complete)))
    new: list[StepRecord] = []
    for number, row in enumerate(rows[metrics.lines:], start=metrics.lines + 2):  # + the header, from 1
        if not (row.get("loss") or "").strip():
            continue
        _add_step(metrics, {k: _csv_number(v) for k, v in row.items() if k}, f"line {number}", new)
    metrics.lines = len(rows)
    return new


def _csv_number(text: str | None) -> Any:
    """A CSV cell as an int, a float or (neither) the text: ``"3"`` -> 3, ``"10.8"`` -> 10.8."""
    for kind in (int, float):
        try:
            return kind(text)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            continue
    return text


def trainer_state_steps(checkpoint: Path) -> list[StepRecord]:
    """The logged steps of Trainer's ``trainer_state.json`` in ``checkpoint`` (its ``log_history`` entries with a
    loss), or [] when there is none."""
    try:
        state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    out = []
    for h in state.get("log_history", []) if isinstance(state, dict) else []:
        if isinstance(h, dict) and "loss" in h and "step" in h:
            record = _step_record(h, 0)
            if record is not None:
                out.append(record)
    return out


ERROR_LINE = re.compile(r"^\s*([\w.]*(Error|Exception)|Killed|Segmentation fault)\b.*")


def failure_lines(path: Path, n: int = 3, width: int = 240) -> str:
    """What a failed command said: its last line naming an error (``FileNotFoundError: ...``: a launcher such as
    torchrun prints its own footer after the rank's traceback), then its last ``n`` lines."""
    tail = last_lines(path, 200, width).split(" | ")
    errors = [ln for ln in tail if ERROR_LINE.match(ln)]
    last = tail[-n:]
    return " | ".join(([errors[-1]] if errors and errors[-1] not in last else []) + last)


def last_lines(path: Path, n: int = 6, width: int = 200) -> str:
    """The last ``n`` non-empty lines of a log, each cut to ``width`` characters, joined by " | " (for a verdict's
    evidence: what the command said last)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - 16384))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in text.replace("\r", "\n").splitlines() if ln.strip()]
    return " | ".join(ln[:width] for ln in lines[-n:])
