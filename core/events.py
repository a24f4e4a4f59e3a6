"""Typed events: what the pipeline tells the UI and the headless CLI, and what a child's events mean to a stage.

What a child process tells the pipeline is its own format, shared by both sides (:mod:`core.protocol.events`: the
typed child events, :class:`~core.protocol.events.EventWriter` and :func:`~core.protocol.events.read_events`); here
the parent reads them: what a child is doing before its first step (:class:`FirstStepWait`) and which rank leads
(:func:`lead_events`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from core.protocol.events import ChildEvent
from core.status import RecordStatus, StageStatus

if TYPE_CHECKING:
    from core.plan.memory import MemoryPlan


class StageResult(Protocol):
    """What every stage's typed result holds, whichever stage and mode made it: the recipe's
    (:class:`core.stages.probe.ProbeResult`, :class:`core.stages.train.TrainEvalResult`,
    :class:`core.stages.resume.ResumeResult`) and command mode's (:class:`core.command.probe.CommandProbe`,
    :class:`core.command.pipeline.CommandPlan`, :class:`core.command.evaluate.CommandEvaluation`,
    :class:`core.command.resume.CommandResume`). A reader that needs more tells them apart by their class."""

    @property
    def status(self) -> StageStatus:
        """How the stage ended (pass, fail, not_applicable; cancelled where a stage kept what it measured)."""
        ...

    @property
    def summary(self) -> str:
        """The stage's outcome in one line."""
        ...


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
    """A stage ended.

    Attributes:
        status: how it ended (:class:`~core.status.StageStatus`: pass | fail | not_applicable); the last stage of a
            headless pipeline, ``record``, judges nothing and says whether the record was written
            (:class:`~core.status.RecordStatus`: written | not_written, ``summary`` its path or why not).
        result: the stage's typed result (:class:`StageResult`); the recipe's plan stage gives its
            :class:`~core.plan.memory.MemoryPlan`; None for the record.
    """

    status: StageStatus | RecordStatus
    summary: str = ""
    result: StageResult | MemoryPlan | None = None


@dataclass(frozen=True)
class Progress(Event):
    """A step inside a stage: training/probe step ``step`` of ``total`` (the run is named by ``run``).

    A stage of several runs (the resume check: twin, interrupted, resumed) also says where the whole stage stands:
    ``work_done`` of ``work_total`` steps over all its runs (each run counts the steps it trains, so the bar is
    proportional to the work and never goes back) and ``part`` = (this run's place, the runs), 1-based."""

    run: str
    step: int
    total: int
    loss: float | None = None
    learning_rate: float | None = None
    work_done: int | None = None
    work_total: int | None = None
    part: tuple[int, int] | None = None


@dataclass(frozen=True)
class Waiting(Event):
    """A child is working without a step to show (before its first step: imports, loading the model, the data, an
    evaluation; after its last: the evaluation after training): ``what`` it is doing, in words ("loading the model",
    "evaluating the held-out text after training: 8 of 32 blocks"), in child ``pid`` of run ``run``, since ``since``
    (seconds since the epoch: when the child started, or when training ended). A screen shows it with the seconds
    elapsed until the next :class:`Progress` (:func:`waiting_for` says what each child event means)."""

    run: str
    pid: int
    what: str
    since: float

    def line(self, now: float) -> str:
        """``probe: loading the model in child 1234… 12 s`` at time ``now``."""
        return f"{self.run}: {self.what} in child {self.pid}… {max(0.0, now - self.since):.0f} s"


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
    """The pipeline ended; ``record_path`` is where the record is ("" when it could not be written); ``status`` is the
    overall verdict (pass | fail)."""

    status: StageStatus
    record_path: str
    run_dir: str


def waiting_for(event: ChildEvent | None, role: str, resumes: bool = False, tracked: bool = False) -> str | None:
    """What a child is doing after ``event``, its latest event before its first step (None: the child was just
    started), in words for :class:`Waiting`; None when ``event`` starts no new phase (a step, a placement of another
    role...).

    Args:
        role: the child's (``probe``, ``train``, ``evaluate``, ``twin``, ``interrupted``, ``resumed``).
        resumes: it starts from a checkpoint (Trainer loads it before its first step).
        tracked: the probe's first step runs under the memory tracker (the CPU).
    """
    from core.protocol.events import DataInfo, Evaluation, ModelBuilt, Placement, Started, Trainable

    if event is None:
        return "starting (importing torch and transformers)"
    if isinstance(event, Started):
        return "loading the model"
    if isinstance(event, ModelBuilt):
        return "preparing the data"
    if isinstance(event, DataInfo):
        if role == "train":
            return "evaluating the held-out text before training"
        if role == "evaluate":
            return "evaluating the held-out text"
        return "placing the model" if role == "probe" else "building the trainer"
    if isinstance(event, Placement) and role == "probe":
        return "running its first step" + (" (tracked for memory: slower than the steps after it)" if tracked else "")
    if isinstance(event, Evaluation) and role == "train" and event.when == "before":
        return "building the trainer"
    if isinstance(event, Trainable):
        return ("loading the checkpoint and running its first step" if resumes else
                "building the trainer and running its first step")
    return None


class FirstStepWait:
    """Says what a child is doing while it has no step to show (:class:`Waiting` events for a stage to yield): one as
    it starts, then one each time a child event starts a new phase (:func:`waiting_for`) until its first step; after
    its last step, the evaluation after training; and an evaluation's blocks as they go.

    Args:
        stage, run, pid: the stage, the run and the child's pid as :class:`ChildStarted` names them.
        role, resumes, tracked: as :func:`waiting_for` takes them.
    """

    def __init__(self, stage: str, run: str, pid: int, role: str, resumes: bool = False, tracked: bool = False) -> None:
        self.stage, self.run, self.pid, self.role = stage, run, pid, role
        self.resumes, self.tracked = resumes, tracked
        self.since = time.time()
        self.stepped = False
        self.after_since: float | None = None  # when training ended (the evaluation after it is timed from then)

    def started(self) -> Waiting:
        """The wait as the child starts (importing)."""
        return self._waiting(waiting_for(None, self.role))

    def see(self, event: ChildEvent) -> Waiting | None:
        """The wait's new phase after ``event`` (the lead rank's), or None: no new phase. Before the first step, each
        phase :func:`waiting_for` names; after the last step, the evaluation after training (from ``Trained``, timed
        from then); during any evaluation, its blocks done of all (``EvalProgress``)."""
        from core.protocol.events import EvalProgress, ProbeStep, Step, Trained

        if isinstance(event, (Step, ProbeStep)):
            self.stepped = True
        if not event.leads:
            return None
        if isinstance(event, Trained) and self.role == "train":
            self.after_since = time.time()
            return self._waiting("evaluating the held-out text after training", self.after_since)
        if isinstance(event, EvalProgress):
            when = f" {event.when} training" if event.when and self.role == "train" else ""
            since = self.after_since if event.when == "after" and self.after_since is not None else self.since
            return self._waiting(f"evaluating the held-out text{when}: {event.done} of {event.total} blocks", since)
        if self.stepped:
            return None
        what = waiting_for(event, self.role, self.resumes, self.tracked)
        return self._waiting(what) if what is not None else None

    def _waiting(self, what: str | None, since: float | None = None) -> Waiting:
        return Waiting(self.stage, run=self.run, pid=self.pid, what=what or "",
                       since=self.since if since is None else since)


def lead_events(events: list[ChildEvent]) -> list[ChildEvent]:
    """The events of this node's first rank (:attr:`ChildEvent.leads`: local rank 0; every event of a single process;
    on the node of global rank 0 that is rank 0, on another node of a several-node run that node's first rank): the
    rank that reports progress, evaluation, data and training time for its node (every rank holds the same weights
    under DDP)."""
    return [e for e in events if e.leads]
