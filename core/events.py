"""Typed events: what the pipeline tells the UI and the headless CLI, and what a child process tells the pipeline.

A child process writes one JSON object a line to ``events.jsonl`` in its job directory and flushes after each, so library
prints (which go to the child's log file) can never corrupt the channel. :class:`EventWriter` writes, :func:`read_events`
tails and parses each line once into its typed child event (:mod:`core.child.events`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.child.events import ChildEvent, EventFormatError, parse_line, payload


@dataclass(frozen=True)
class Event:
    """Base of every pipeline event. ``t`` is seconds since the epoch (time.time())."""

    stage: str
    t: float = field(default_factory=time.time, kw_only=True)


@dataclass(frozen=True)
class StageStarted(Event):
    """A stage began. ``detail`` says what it will do, in one line."""

    detail: str = ""


@dataclass(frozen=True)
class StageFinished(Event):
    """A stage ended. ``status``: pass | fail | not_applicable | error; ``result`` is the stage's typed result."""

    status: str
    summary: str = ""
    result: Any = None


@dataclass(frozen=True)
class Progress(Event):
    """A step inside a stage: training/probe step ``step`` of ``total`` (the run is named by ``run``)."""

    run: str
    step: int
    total: int
    loss: float | None = None
    learning_rate: float | None = None


@dataclass(frozen=True)
class ChildStarted(Event):
    """A stage started a child process (its own process group): the monitor follows ``pid`` and its descendants."""

    run: str
    pid: int
    log_path: str


@dataclass(frozen=True)
class DeviceBound(Event):
    """The child reported torch's UUID for the CUDA device it runs on: the monitor checks its NVML mapping by it."""

    device: str
    uuid: str


@dataclass(frozen=True)
class Message(Event):
    """A line for the log: what is happening (e.g. "converting the embedded model once, ~16 s")."""

    text: str


@dataclass(frozen=True)
class Evaluated(Message):
    """A held-out evaluation finished: ``when`` is "before" / "after" (training) or "" (inference); ``perplexity``
    is token-weighted; ``text`` says it for the log."""

    when: str = ""
    perplexity: float = float("nan")


@dataclass(frozen=True)
class RunFinished(Event):
    """The pipeline ended; ``record_path`` is where the record is; ``status`` is the overall verdict."""

    status: str
    record_path: str
    run_dir: str


def rank_events_path(path: Path, rank: int | None) -> Path:
    """The events file of one rank under torchrun: rank 0 (or a single process) writes ``path`` itself, rank r
    ``events.rank{r}.jsonl`` beside it, so ranks never interleave lines in one file."""
    if not rank:
        return path
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def lead_events(events: list[ChildEvent]) -> list[ChildEvent]:
    """The events of this node's first rank (:attr:`ChildEvent.leads`: local rank 0; every event of a single process;
    on the node of global rank 0 that is rank 0, on another node of a several-node run that node's first rank): the
    rank that reports progress, evaluation, data and training time for its node (every rank holds the same weights
    under DDP)."""
    return [e for e in events if e.leads]


class EventWriter:
    """Writes child events as JSON lines, flushed per event.

    Args:
        path: the events file; created (with parents) if missing, appended to otherwise.
    """

    def __init__(self, path: str | Path, rank: int | None = None, local_rank: int | None = None) -> None:
        self.path = rank_events_path(Path(path), rank)
        self.rank = rank
        self.local_rank = local_rank
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the writer

    def write(self, event: ChildEvent) -> None:
        """Append one typed child event as ``{"kind": KIND, "t": time, **payload}`` (:func:`core.child.events.payload`;
        with ``rank`` / ``local_rank`` under torchrun) and flush it."""
        self.emit(event.KIND, **payload(event))

    def emit(self, kind: str, **data: Any) -> None:
        """Append one event ``{"kind": kind, "t": time, **data}`` (with ``rank`` under torchrun) and flush it: the
        pipeline's own log of its events; a child writes typed events with :meth:`write`."""
        record = {"kind": kind, "t": time.time(), **data}
        if self.rank is not None:
            record["rank"] = self.rank
        if self.local_rank is not None:
            record["local_rank"] = self.local_rank
        self._fh.write(json.dumps(record, default=_jsonable) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def complete_lines(path: str | Path, offset: int, keepends: bool = False) -> tuple[list[bytes], int]:
    """The complete lines of ``path`` from byte ``offset`` (a trailing partial line is left for the next read: a
    writer may be half-way through it), and the offset after them; ([], offset) when the file is missing or holds no
    new complete line."""
    p = Path(path)
    if not p.is_file():
        return [], offset
    with open(p, "rb") as fh:
        fh.seek(offset)
        data = fh.read()
    end = data.rfind(b"\n")
    if end < 0:
        return [], offset
    return data[: end + 1].splitlines(keepends=keepends), offset + end + 1


def read_events(path: str | Path, offset: int = 0) -> tuple[list[ChildEvent], int]:
    """Read the complete lines of a child's events file from byte ``offset``, each parsed once into its typed event
    (:func:`core.child.events.parse_line`).

    Returns:
        (events, new_offset): a trailing partial line is left for the next call.

    Raises:
        EventFormatError: a line that is no child event (not JSON, an unknown kind, keys or types that do not
            match); the message names the file and the line's byte offset.
    """
    p = Path(path)
    lines, new_offset = complete_lines(p, offset, keepends=True)
    events: list[ChildEvent] = []
    at = offset
    for raw in lines:
        line = raw.decode("utf-8")
        if line.strip():
            try:
                events.append(parse_line(line))
            except EventFormatError as exc:
                raise EventFormatError(f"{p} at byte {at}: {exc}") from None
        at += len(raw)
    return events, new_offset
