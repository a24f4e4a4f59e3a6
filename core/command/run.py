"""One run of the user's command, followed to its end (or to the kill the resume check asks for).

:func:`run_command` starts the command (:func:`core.command.process.start_job`), then until it exits: tails the Trainer
hook's events and the metrics file, lists the checkpoints, samples the memory of its whole process tree
(:func:`core.command.process.sample_memory`), reports each new step as a :class:`~core.events.Progress` event, and
kills the whole tree when ``kill_when`` says so, when ``cancelled()`` becomes true or when the spec's timeout passes.
The run directory keeps the log, the hook's events, the memory samples and the command's own output folder.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.command.process import Job, KillResult, kill_job, members, sample_memory, start_job
from core.command.reports import (
    HookReport,
    MetricsFile,
    StepRecord,
    metrics_format,
    read_hook_events,
    read_metrics,
    trainer_state_steps,
)
from core.commandspec import CommandSpec
from core.errors import StageCancelled
from core.events import ChildStarted, Event, Progress
from core.stages.checkpoint import Checkpoint, list_checkpoints
from core.stages.childproc import killed_note

#: how often the metrics and the hook's events are read, and the kill decided (seconds)
POLL_S = 0.02
#: how often the process tree's memory is sampled, on a thread of its own (a sample walks /proc: it must not delay a
#: kill that the metrics ask for)
SAMPLE_S = 0.25
CHECKPOINTS_S = 0.2


class _Sampling:
    """Samples the job's memory every :data:`SAMPLE_S` on a daemon thread until stopped."""

    def __init__(self, job: Job, backend: Any) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(job, backend), name="gpuaccept-job-memory",
                                       daemon=True)
        self.thread.start()

    def _run(self, job: Job, backend: Any) -> None:
        while not self.stop.is_set():
            try:
                sample_memory(job, backend)
            except Exception:  # noqa: BLE001 - a failed read leaves a gap in memory.jsonl, never stops the run
                pass
            self.stop.wait(SAMPLE_S)

    def end(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5.0)


@dataclass
class RunOutcome:
    """What one run of the command did (every number measured; what could not be read is in ``problems``).

    Attributes:
        exit_code: the command's exit status; None when gpuaccept killed it (``kill`` says how).
        steps: the per-step metrics (:func:`chosen_steps`), every rank's; ``metrics_source`` says where from.
        checkpoints: the checkpoints in ``out_dir`` when the run ended (or was killed), by step.
        peaks: the largest sampled bytes per device label of the process tree (:func:`core.command.process.sample_memory`).
        at_kill: the checkpoints present the moment the kill was decided (the interrupted run).
    """

    name: str
    argv: list[str]
    out_dir: Path
    job_dir: Path
    log_path: Path
    exit_code: int | None = None
    kill: KillResult | None = None
    seconds: float = 0.0
    hook: HookReport = field(default_factory=HookReport)
    metrics: MetricsFile | None = None
    steps: list[StepRecord] = field(default_factory=list)
    metrics_source: str = ""
    checkpoints: list[Checkpoint] = field(default_factory=list)
    skipped_checkpoints: list[str] = field(default_factory=list)
    peaks: dict[str, int] = field(default_factory=dict)
    at_kill: list[Checkpoint] = field(default_factory=list)
    timed_out: bool = False
    problems: list[str] = field(default_factory=list)
    pid: int = 0
    containment: str = ""  # how its processes were held (core/command/keeper.py)
    exit_note: str = ""  # what the exit status means where it is a kill gpuaccept did not send (killed_note)
    log_cut_bytes: int = 0  # bytes of output cut from command.log (its cap: core/command/process.LOG_CAP_BYTES)

    @property
    def trainer(self) -> dict[str, Any] | None:
        """Rank 0's ``trainer`` report from the hook: the script is Trainer-based (measured from inside)."""
        return self.hook.lead

    def last_step(self) -> int:
        return max((s.step for s in self.steps), default=0)

    def steps_seen(self) -> list[StepRecord]:
        """The steps seen so far while it runs (the hook's, else the metrics file's)."""
        if self.hook.steps:
            return self.hook.steps
        return self.metrics.steps if self.metrics is not None else []


def chosen_steps(spec: CommandSpec, outcome: RunOutcome) -> tuple[list[StepRecord], str]:
    """The run's per-step metrics and where they come from: the metrics file when the spec names one; else (``auto``)
    the Trainer hook's logged steps (loss and learning rate as Trainer logged them, the micro-batches' digests as
    sample ids); else the ``log_history`` of ``trainer_state.json`` in the newest checkpoint; else none."""
    if spec.metrics != "auto":
        metrics = outcome.metrics
        steps = metrics.steps if metrics is not None else []
        written = metrics is not None and metrics.path.is_file()
        return steps, (f"{spec.metrics} in the run's output folder ({metrics_format(Path(spec.metrics))})"
                       + ("" if written else ": not written"))
    if outcome.hook.steps:
        return outcome.hook.steps_with_batches(), ("the Trainer hook (on_log: loss and learning rate as Trainer "
                                                   "logged them; sample ids: sha256 of each micro-batch's input_ids)")
    for ckpt in reversed(outcome.checkpoints):
        steps = trainer_state_steps(ckpt.path) if ckpt.path.is_dir() else []
        if steps:
            return steps, f"log_history of {ckpt.name}/trainer_state.json"
    return [], "none found"


def run_command(spec: CommandSpec, name: str, argv: list[str], out_dir: Path, job_dir: Path, stage: str,
                total: int = 0, hold_at_step: int | None = None,
                kill_when: Callable[[RunOutcome], bool] | None = None,
                cancelled: Callable[[], bool] | None = None, backend: Any = None, env: Mapping[str, str] | None = None,
                ) -> Generator[Event, None, RunOutcome]:
    """Run ``argv`` (the command's words, placeholders replaced) to its end; yield its start and its steps.

    Args:
        name: which run this is (``reference``, ``interrupted``, ``resumed``), for events and messages.
        out_dir: the run's ``{out}`` (created here); its checkpoints and metrics file are read from it.
        total: the steps the run is expected to reach, for progress (0: unknown).
        hold_at_step: a Trainer-based script holds after this optimizer step (``GPUACCEPT_HOLD_AT_STEP``).
        kill_when: called after each poll with the run so far; True kills the whole tree (the resume check's kill).
        backend: the NVML backend for GPU memory from outside, or None.
        env: variables of this run's environment beside the spec's ``command.env`` (a twin's nudge).

    Raises:
        StageCancelled: ``cancelled()`` became true; the whole tree was killed first. Its ``outcome`` attribute holds
            the run so far (its steps, peaks and checkpoints read to the end), for the record.
        StageError: the program could not be started.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    outcome = RunOutcome(name=name, argv=list(argv), out_dir=out_dir, job_dir=job_dir, log_path=job_dir / "command.log")
    if spec.metrics != "auto":
        outcome.metrics = MetricsFile(out_dir / spec.metrics)
    job = start_job(name, argv, spec.workdir_path, job_dir, {**spec.env, **(env or {})}, hold_at_step)
    outcome.pid, outcome.containment = job.root_pid, job.containment
    yield ChildStarted(stage, run=name, pid=job.root_pid, log_path=str(job.log_path))
    started = time.monotonic()
    listed = 0.0
    finished = False
    sampling = _Sampling(job, backend)
    try:
        while True:
            new = _read(job, outcome)
            if kill_when is not None and new and kill_when(outcome):  # at once: before anything else is read
                outcome.kill = kill_job(job)
                outcome.at_kill = list_checkpoints(out_dir, spec.checkpoints)[0]
                finished = True
                break
            if not total and outcome.trainer is not None:  # a Trainer says how far it goes
                total = int((outcome.trainer.get("arguments") or {}).get("max_steps") or 0)
                total = max(total, 0)
            for step in new:
                if step.rank == 0:
                    yield Progress(stage, run=name, step=step.step, total=total, loss=step.loss,
                                   learning_rate=step.learning_rate)
            now = time.monotonic()
            if now - listed >= CHECKPOINTS_S:
                listed = now
                outcome.checkpoints, outcome.skipped_checkpoints = list_checkpoints(out_dir, spec.checkpoints)
            if kill_when is not None and kill_when(outcome):
                outcome.kill = kill_job(job)
                outcome.at_kill = list_checkpoints(out_dir, spec.checkpoints)[0]
                finished = True
                break
            if cancelled is not None and cancelled():
                outcome.kill = kill_job(job)
                finished = True
                stop = StageCancelled(f"{name} run of the command: cancelled; every process of it was killed")
                stop.outcome = outcome  # type: ignore[attr-defined]  # what was measured until then (read at the end)
                raise stop
            if job.proc.poll() is not None:
                finished = True
                outcome.exit_code = job.proc.returncode
                break
            if spec.timeout_s and now - started > spec.timeout_s:
                outcome.kill = kill_job(job)
                outcome.timed_out = True
                finished = True
                break
            time.sleep(POLL_S)
    finally:
        if not finished or job.proc.poll() is None:  # interrupted (Ctrl-C), or the consumer stopped reading
            outcome.kill = outcome.kill or kill_job(job)
        sampling.end()
        outcome.seconds = time.monotonic() - started
        _finish(spec, job, outcome)
        _end_leftovers(job, outcome)
    return outcome


def _end_leftovers(job: Job, outcome: RunOutcome) -> None:
    """Kill what the command left running after it exited (a daemonised helper, a data-loader worker that outlived
    its rank): nothing of one run may hold memory while the next is measured. Named in the run's problems: those the
    keeper killed as the command's first process ended (its report), then any found after."""
    if outcome.kill is not None:
        return
    try:
        job.proc.wait(timeout=15)  # the keeper ends what is left, then exits with the command's status
    except subprocess.TimeoutExpired:
        pass
    pids = [int(p) for p in job.report().get("leftovers", [])]
    left = members(job, scan_env=True)
    result = kill_job(job) if left else None
    pids += [p.pid for p in left if p.pid not in pids]
    if pids:
        outcome.problems.append(f"the command left {len(pids)} process(es) running after it exited (pids "
                                f"{', '.join(map(str, pids[:8]))}): gpuaccept killed them"
                                + ("" if result is None or result.clean else f"; still alive: {result.left}"))


def _read(job: Job, outcome: RunOutcome) -> list[StepRecord]:
    new = read_hook_events(job.events_path, outcome.hook)
    if outcome.metrics is not None:
        got = read_metrics(outcome.metrics)
        if not outcome.hook.steps:
            new = got
    return new


def _finish(spec: CommandSpec, job: Job, outcome: RunOutcome) -> None:
    """The last reads once the run has ended: the hook's and the metrics' last lines, the checkpoints, the peaks."""
    _read(job, outcome)
    outcome.checkpoints, outcome.skipped_checkpoints = list_checkpoints(outcome.out_dir, spec.checkpoints)
    outcome.steps, outcome.metrics_source = chosen_steps(spec, outcome)
    outcome.peaks = dict(job.peaks)
    if outcome.kill is None and outcome.exit_code not in (None, 0):
        outcome.exit_note = killed_note(outcome.exit_code, job.oom_kills_at_start, job.peaks.get("tree", 0))
        in_cgroup = job.report().get("oom_kill")
        if in_cgroup:  # the job's own cgroup counted it (memory.events, where it has a memory controller)
            outcome.exit_note += f"; the job's cgroup counted {in_cgroup} OOM kill(s) (memory.events oom_kill)"
    report = job.report()
    outcome.log_cut_bytes = int(report.get("log_cut_bytes") or 0)
    if report.get("log_write_error"):  # the disk refused the command's log: its output was drained and dropped
        dropped = int(report.get("log_dropped_bytes") or 0)
        outcome.problems.append(f"the disk refused the command's log ({report['log_write_error']}; {dropped:,} bytes "
                                "of its output dropped, the command never blocked): free space in the runs folder "
                                "and run again")
    if outcome.metrics is not None:
        outcome.problems.extend(outcome.metrics.problems)
    outcome.problems.extend(f"Trainer hook: {e}" for e in outcome.hook.errors)
