"""The pipeline: plan -> probe -> train + evaluate -> kill and resume -> record, as one generator of typed events.

Both faces of gpuaccept (the headless CLI and the Textual wizard) call :func:`run_pipeline` and only consume its events;
they never compute memory or verdicts themselves. Stage results arrive in :class:`~core.events.StageFinished` events.
A stage that fails stops the stages after it; the record is written in every case, with what did not run marked so.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
from collections.abc import Callable, Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from core.errors import GpuAcceptError, StageError
from core.events import Event, Message, RunFinished, StageFinished, StageStarted
from core.nodes import cluster_stage, gate, node_agreement, quietly, stopped_before_start
from core.prerun import (
    CONVERTING,
    PlanContext,
    check_runnable,
    convert_in_child,
    make_plan,
    plan_summary,
    rank_devices,
    run_device,
    traced_summary,
)
from core.protocol.events import EventWriter
from core.spec import RunSpec
from core.stages.childproc import launch_options
from core.status import RecordStatus, StageStatus, Stopped

if TYPE_CHECKING:
    from core.record.verdicts import StageVerdict

STAGES = ("plan", "probe", "train_eval", "resume", "record")


class StageResult(Protocol):
    """What every stage's result holds, of either subject (frozen dataclasses: ``ProbeResult``, ``CommandProbe``...)."""

    @property
    def status(self) -> StageStatus: ...

    @property
    def summary(self) -> str: ...


R = TypeVar("R", bound=StageResult)


def judged(result: R, engine: StageVerdict | None) -> R:
    """``result`` (a stage's frozen result, of either subject) as the verdict engine judged it: the status its record
    states (:func:`core.record.build.judged_stage`, :func:`core.command.record.judged_stage`), one rule live and in the
    record; the criteria rows it was judged by where the result keeps them (``criteria``). Where the stage's own status
    differs, the engine's, the reasons said in its summary (``; but ...``). ``engine`` None: ``result`` as it is."""
    if engine is None:
        return result
    changes: dict[str, Any] = {"criteria": list(engine.criteria)} if hasattr(result, "criteria") else {}
    if engine.status != result.status:
        why = "; ".join(engine.reasons) or f"{engine.status.value} by the record's rules"
        changes.update(status=engine.status, summary=f"{result.summary}; but {why}")
    return cast(R, dataclasses.replace(cast(Any, result), **changes)) if changes else result


def new_run_dir(spec: Any, runs_root: Path, now: Any, label: str | None = None) -> Path:
    """``runs/<UTC time>-<mode>-<model>/`` (``label`` instead of the model's name: command mode's script), unique (a
    suffix is added if it exists). Made with an exclusive ``mkdir``, so two processes starting in the same second each
    get their own folder.

    Raises:
        GpuAcceptError: the runs folder cannot hold run folders (read-only, a file, no space), naming it.
    """
    name = label if label is not None else (Path(spec.model.rstrip("/")).name or spec.model)
    model = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:40]
    base = runs_root / f"{now.strftime('%Y%m%dT%H%M%SZ')}-{spec.mode}-{model}"
    try:
        runs_root.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise GpuAcceptError(f"runs_dir: {runs_root} is a file, not a folder; give a folder with --runs-dir") from None
    except NotADirectoryError:
        raise GpuAcceptError(f"runs_dir: {runs_root} cannot be made: a folder above it is a file; give a folder with "
                             "--runs-dir") from None
    except OSError as exc:
        raise GpuAcceptError(f"runs_dir: {runs_root} cannot be made ({exc.strerror or exc}); give a writable folder "
                             "with --runs-dir") from None
    for n in range(1, 10_000):
        path = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue  # taken, by an earlier run or another process this second: the next suffix
        except OSError as exc:
            raise GpuAcceptError(f"runs_dir: cannot make a run folder in {runs_root} ({exc.strerror or exc}); give "
                                 "a writable folder with --runs-dir") from None
    raise GpuAcceptError(f"runs_dir: {runs_root} holds 9,999 run folders named {base.name}; give another --runs-dir")


#: a file of RESERVE_BYTES written when the run folder is made and removed to make room for record.toml if the disk
#: fills during the run (a record is ~20 KiB, written beside it before the rename); removed once the record is written
RESERVE_NAME = ".record-reserve"
RESERVE_BYTES = 64 * 1024


def _reserve(path: Path) -> None:
    """Write ``path`` with RESERVE_BYTES of zeros (written, not sparse, so the space is really taken)."""
    with open(path, "wb") as fh:
        fh.write(bytes(RESERVE_BYTES))
        fh.flush()
        os.fsync(fh.fileno())


class StagedRun:
    """What every acceptance run shares (gpuaccept's recipe, :class:`AcceptanceRun`, and a user's command,
    :class:`core.command.pipeline.CommandRun`): its run directory, its event log (``events.jsonl``), why each stage
    stopped, how a stage ends (:meth:`finished`: the one place a stage's status is set, by the verdict engine) and how
    the record is written. A subclass sets ``run_dir``, ``_log`` (an :class:`EventWriter`), ``results`` (each
    stage's result by name: ``probe``...), ``stopped``, ``log_error``, ``record_path``, ``verdict`` and ``signed``,
    and says how the engine judges a stage of its kind (:meth:`engine`)."""

    run_dir: Path
    _log: EventWriter
    results: dict[str, Any]
    stopped: dict[str, Stopped]
    log_error: str | None
    record_path: Path | None
    verdict: str | None
    signed: bool

    def current_verdict(self) -> dict[str, Any]:
        """What the record would say now (the overall verdict and each stage's): each kind of run says how."""
        raise NotImplementedError

    def engine(self, stage: str) -> StageVerdict | None:
        """The verdict engine's verdict of ``stage`` over the results so far, what the record states of it (None: it
        cannot be judged): each kind of run says how (its facts)."""
        raise NotImplementedError

    def finished(self, stage: str, result: R) -> Generator[Event, None, R]:
        """End ``stage`` with ``result``: kept as the stage's result, judged by the record's engine (:func:`judged`
        over :meth:`engine`: the status it ends with live is the one its record states), and its
        :class:`~core.events.StageFinished`. Returns the judged result."""
        self.results[stage] = result
        self.results[stage] = result = judged(result, self.engine(stage))
        yield self.emit(StageFinished(stage, status=result.status, result=result, summary=result.summary))
        return result

    def write_record(self, signoff: dict[str, Any] | None = None) -> Path:
        """Write the run's record with ``signoff`` (else unsigned) and return its path: each kind of run says how."""
        raise NotImplementedError

    def emit(self, event: Event) -> Event:
        """Append ``event`` to the run's events.jsonl and return it. If the log cannot be written (no space left, the
        folder gone read-only) the event still reaches the caller; the log's failure is kept in ``log_error`` and the
        stage that needs the disk fails on its own, naming the file."""
        if self.log_error is None:
            try:
                self._log.emit(type(event).__name__, **{k: v for k, v in vars(event).items()
                                                        if k not in ("result", "t")})
            except OSError as exc:
                self.log_error = f"{self._log.path}: {exc.strerror or exc}"
        return event

    def _logged(self, gen: Generator[Event, None, Any]) -> Generator[Event, None, Any]:
        """Pass a stage's events through the run's event log; return the stage's result."""
        try:
            while True:
                yield self.emit(next(gen))
        except StopIteration as stop:
            return stop.value

    def _stage(self, name: str, gen: Generator[Event, None, Any]) -> Generator[Event, None, Any]:
        """Run a stage's generator through the log; remember why it stopped if it raised. A full disk or a folder that
        cannot be written ends the stage as an error that names it (the record is still written where there is
        room)."""
        try:
            return (yield from self._logged(gen))
        except GpuAcceptError as exc:
            self.stopped[name] = Stopped.of(exc)
            raise
        except OSError as exc:
            why = f"{name}: {exc.strerror or exc} ({getattr(exc, 'filename', '') or 'a file of the run'}); the run " \
                  f"folder {self.run_dir} keeps what was written"
            self.stopped[name] = Stopped(StageStatus.ERROR, why)
            raise StageError(why) from None
        except GeneratorExit:
            self.stopped.setdefault(name, Stopped(StageStatus.CANCELLED,
                                                  f"{name}: cancelled (the wizard or the process was closed)"))
            raise

    def refused(self, stage: str, why: str) -> GpuAcceptError:
        """The error that refuses ``stage`` before it starts, remembered so the record says why it did not run."""
        self.stopped[stage] = Stopped(StageStatus.NOT_RUN, f"not run: {why}")
        return GpuAcceptError(why)

    def _write_record_file(self, record: dict[str, Any], signoff: dict[str, Any] | None) -> Path:
        """Write ``record`` (with ``signoff``, else ``status = "unsigned"``) to ``record.toml`` atomically, using the
        room kept for it if the disk filled during the run; remember its path, verdict and whether it is signed.

        Raises:
            GpuAcceptError: the record is already signed (a signed record is never overwritten).
            core.record.signoff.SignoffRefused: an accept of a verdict that is not pass without the operator's reason
                (:func:`core.record.signoff.checked_signoff`, the rule ``gpuaccept sign`` applies too); nothing is
                written.
        """
        from core.record.signoff import checked_signoff
        from core.record.written import write_record

        if self.signed:
            raise GpuAcceptError(f"{self.record_path} is already signed; start a new run to sign again")
        record["signoff"] = checked_signoff(record["verdict"], signoff) if signoff else {"status": "unsigned"}
        reserve = self.run_dir / RESERVE_NAME
        try:
            self.record_path = write_record(record, self.run_dir / "record.toml")
        except OSError as exc:
            if exc.errno != errno.ENOSPC or not reserve.exists():
                raise
            reserve.unlink()  # the room kept for this moment: the disk filled during the run
            self.record_path = write_record(record, self.run_dir / "record.toml")
        reserve.unlink(missing_ok=True)
        self.verdict = record["verdict"]["status"]
        self.signed = bool(signoff)
        return self.record_path

    def close(self) -> None:
        """Close the run's event log (the run directory stays)."""
        try:
            self._log.close()
        except OSError as exc:  # its last flush found no room
            self.log_error = self.log_error or f"{self._log.path}: {exc.strerror or exc}"


class AcceptanceRun(StagedRun):
    """One acceptance of one spec: its run directory and the result of each stage, run in order.

    Each stage method is a generator of events that returns the stage's result; a stage refuses (raises
    :class:`~core.errors.GpuAcceptError` naming why) when an earlier stage failed or did not run. :func:`run_pipeline`
    runs them all; the wizard runs them one screen at a time. Every event is also appended to ``events.jsonl``.

    Args:
        ctx: a plan already made for this spec by :func:`make_plan` (the wizard's plan screen), else one is made.
        probe_unfit: run even though the plan does not fit (the wizard's "Probe anyway"): the plan stage fails as
            it would, and the probe measures what the step really needs.
        nvml: what the health preflight reads the GPUs through (core/monitor/health.py): the ``pynvml`` module by
            default, or an object with its API (tests/fake_nvml.py).

    Raises (on construction):
        SpecError, ModelNotFoundError, DataError: bad input (the data file is read and checked too), before any run
            directory is created.
    """

    def __init__(self, spec: RunSpec, runs_root: Path = Path("runs"), devices_override: list[Any] | None = None,
                 ctx: PlanContext | None = None, traced: dict[str, Any] | None = None, probe_unfit: bool = False,
                 nvml: Any = None):
        import tomli_w

        from core.record.written import utc_now

        self.spec = spec
        self.started = utc_now()
        from core.data import check_data
        from core.interrupt import interruptible

        with interruptible("the plan was made and the data read, before any run folder"):  # a signal stops it at once
            self.ctx = ctx if ctx is not None else make_plan(spec, devices_override)
            self.device = run_device(spec, self.ctx.devices)
            check_runnable(spec, self.ctx, self.device, allow_unfit=probe_unfit)
            check_data(spec.data, spec.heldout_fraction)  # a bad data file is named here, before any run folder
        #: the user asked to probe a plan that does not fit (to learn whether the plan was too pessimistic); the plan
        #: stage still fails, and the probe's measurement says what the step really needs
        self.probe_unfit = probe_unfit
        self.nvml = nvml
        #: the devices of this node's ranks, in local-rank order (one for a single process), and how children start
        self.rank_devices = rank_devices(spec, self.ctx.devices, self.device)
        self.launch = launch_options(spec, self.rank_devices)
        # the fork server imports torch, transformers and peft while the plan is reported and traced: every stage
        # child of one process is forked from it (core.forkserver)
        from core import forkserver
        from core.interpreter import child_env

        forkserver.warm(child_env())
        self.run_dir = new_run_dir(spec, Path(runs_root), self.started)
        try:
            (self.run_dir / "spec.toml").write_text(tomli_w.dumps(spec.to_file_dict()), encoding="utf-8")
            (self.run_dir / "plan.json").write_text(json.dumps(self.ctx.plan.to_json(), indent=2), encoding="utf-8")
            self._log = EventWriter(self.run_dir / "events.jsonl")
            _reserve(self.run_dir / RESERVE_NAME)
        except OSError as exc:
            raise GpuAcceptError(f"runs_dir: the run folder {self.run_dir} was made but {exc.filename or 'a file'} "
                                 f"could not be written ({exc.strerror or exc}); free space or give another "
                                 "--runs-dir") from None
        self.results: dict[str, Any] = {"plan": self.ctx.plan, "probe": None, "train_eval": None, "resume": None}
        #: the traced plan beside the analytic one (core.plan.traced.traced_table), made by the plan stage or given
        self.traced: dict[str, Any] | None = traced
        self.stopped: dict[str, Stopped] = {}  # stage -> why it ended without a result, with its status
        self.model_path: Path | None = None
        self.record_path: Path | None = None
        self.verdict: str | None = None
        self.signed = False
        self.log_error: str | None = None  # why events.jsonl stopped being written, if it did

    @property
    def plan_fits(self) -> bool:
        """The plan fits on every device, judged by the larger of the analytic and traced peaks (core/plan/fit.py; a device
        of unknown capacity does not count against it)."""
        from core.plan.fit import plan_fits

        return plan_fits(self.ctx.plan, self.traced)

    @property
    def model_info(self) -> dict[str, Any]:
        return {"name": self.spec.model, "kind": self.ctx.source.kind, "path": str(self.ctx.source.path),
                "model_type": getattr(self.ctx.config, "model_type", "unknown"),
                "parameters_total": self.ctx.plan.parameters.total,
                "parameters_trainable": self.ctx.plan.parameters.trainable}

    # ------------------------------------------------------------------ stages
    def plan_stage(self, cancelled: Callable[[], bool] | None = None) -> Generator[Event, None, Any]:
        """Report the plan made on construction (per device; fit judged per device), and trace one step on fake
        tensors in a child process beside it (unless a traced plan was given)."""
        from core.plan.traced import traced_table, untraceable_reason

        if self.traced is None:
            if untraceable_reason(self.ctx.plan, self.spec) is None:  # else the summary below says why not
                yield self.emit(Message("plan", text="tracing one step on fake tensors (torch MemTracker) in a child "
                                                     "process, to compare with the analytic plan"))
            self.traced = traced_table(self.spec, self.ctx, cancelled)
        yield self.emit(Message("plan", text=traced_summary(self.traced)))
        try:
            (self.run_dir / "plan.json").write_text(json.dumps({**self.ctx.plan.to_json(), "traced": self.traced},
                                                               indent=2), encoding="utf-8")
        except OSError as exc:
            why = f"plan: {self.run_dir / 'plan.json'} could not be written ({exc.strerror or exc})"
            self.stopped["plan"] = Stopped(StageStatus.ERROR, why)
            raise StageError(why) from None
        yield self.emit(StageFinished("plan", status=self.engine("plan").status, result=self.ctx.plan,
                                      summary=plan_summary(self.ctx.plan, self.traced)))
        if cancelled is not None and cancelled():  # a signal while the plan was traced: no later stage starts
            from core.errors import StageCancelled

            why = "cancelled: a signal came while the plan was made (the trace was stopped); no later stage ran"
            self.stopped["probe"] = Stopped(StageStatus.CANCELLED, why)
            raise StageCancelled(why)
        return self.ctx.plan

    def probe_stage(self, cancelled: Callable[[], bool] | None = None) -> Generator[Event, None, Any]:
        """Real steps in a child process; the measured ledger compared with the plan."""
        from core.models import embedded_cache_ready, runnable_path
        from core.monitor.health import preflight
        from core.stages.probe import run_probe

        spec, device = self.spec, self.device
        where = (f"{self.launch.nproc} ranks under torchrun ({spec.strategy}, {', '.join(self.rank_devices)})"
                 if self.launch.nproc > 1 else f"a child process on {device}")
        yield self.emit(StageStarted("probe", detail=f"{spec.probe_steps} real steps in {where}"))
        if self.probe_unfit and not self.plan_fits:
            yield self.emit(Message("probe", text="probing a plan that does not fit, as asked: the plan stage stays "
                                                  "failed; the measured peak says whether the plan was too pessimistic"))
        if len(self.ctx.devices) > 1 and self.launch.nproc == 1:
            yield self.emit(Message("probe", text=f"{len(self.ctx.devices)} devices planned; strategy "
                                                  f"{spec.strategy} probes and trains on {device} only"))
        if self.ctx.source.kind == "embedded" and not embedded_cache_ready():
            yield self.emit(Message("probe", text=CONVERTING))
            yield from convert_in_child(self.run_dir / "convert-embedded.log", "probe", cancelled)
        self.model_path = runnable_path(self.ctx.source)
        health = preflight(self.rank_devices, self.nvml)
        yield self.emit(Message("probe", text=health.summary()))
        probe = yield from self._stage("probe", run_probe(spec, self.model_path, self.run_dir / "probe", device,
                                                          self.ctx.plan, cancelled, self.launch, self.traced,
                                                          health))
        return (yield from self.finished("probe", probe))

    def train_eval_stage(self, cancelled: Callable[[], bool] | None = None) -> Generator[Event, None, Any]:
        """Held-out perplexity before and after training (inference: once, on the fixed weights)."""
        from core.stages.train import run_train_eval

        probe = self.results["probe"]
        if probe is None or probe.status != StageStatus.PASS or self.model_path is None:
            raise GpuAcceptError("the probe did not pass; training and evaluation were not run")
        if self.spec.strategy == "zero3" and self.device == "cpu":
            self.stopped["resume"] = Stopped(StageStatus.NOT_RUN, "not run: training was not run (zero3 on the CPU)")
            raise self.refused(
                "train_eval",
                "zero3 on the CPU: the probe measured FSDP2 sharding (torch fully_shard), but Trainer cannot train with "
                "FSDP on the CPU (accelerate enables it only on accelerators) and would run DDP instead; training, "
                "evaluation and the resume check were not run: run zero3 on CUDA devices, or strategy ddp on the CPU")
        yield self.emit(StageStarted("train_eval", detail="held-out perplexity before/after training"
                                     if self.spec.training else "held-out perplexity of the fixed weights"))
        te, _child = yield from self._stage(
            "train_eval", run_train_eval(self.spec, self.model_path, self.run_dir / "train", self.device, cancelled,
                                         self.launch))
        return (yield from self.finished("train_eval", te))

    def resume_stage(self, cancelled: Callable[[], bool] | None = None, cluster: Any = None,
                     ) -> Generator[Event, None, Any]:
        """Kill the training process after a checkpoint, resume it, compare with the reference (training modes).
        ``cluster`` (several nodes: the nodes' agreement): one node is lost (core/stages/nodeloss.py)."""
        from core.stages.nodeloss import NodeLoss
        from core.stages.resume import not_applicable, run_resume_check

        spec = self.spec
        if spec.training and spec.resume.check:
            te = self.results["train_eval"]
            if te is None or self.model_path is None:
                raise GpuAcceptError("the training run (the reference) did not run; the resume check was not run")
            yield self.emit(StageStarted("resume", detail="kill the training process, resume from its checkpoint, "
                                                          "compare"))
            nodes = NodeLoss(cluster, spec.torchrun.nnodes) if cluster is not None else None
            resume = yield from self._stage(
                "resume", run_resume_check(spec, self.model_path, self.run_dir, self.device, te, cancelled, self.launch,
                                           nodes=nodes))
        else:
            yield self.emit(StageStarted("resume", detail="nothing to resume"))
            resume = not_applicable(spec)
        return (yield from self.finished("resume", resume))

    def engine(self, stage: str) -> StageVerdict:
        """The verdict engine's verdict of ``stage`` now (:func:`core.record.build.judged_stage` over the results so
        far, the probe as recorded, the traced plan): what the record states of it."""
        from core.record.build import judged_stage

        r = self.results
        return judged_stage(self.spec, stage, r["plan"], self.probe_as_recorded(), r["train_eval"], r["resume"],
                            self.traced)

    def current_verdict(self) -> dict[str, Any]:
        """The verdict the record would hold if written now (:func:`core.record.build.verdict` over the same results, the
        traced plan and why stages stopped), for a screen to show before writing."""
        from core.record.build import verdict

        r = self.results
        return verdict(self.spec, r["plan"], self.probe_as_recorded(), r["train_eval"], r["resume"], self.stopped,
                       self.traced)

    def probe_as_recorded(self) -> Any:
        """The probe's result compared with the plan the record holds (:func:`core.stages.probe.against_plan`): a
        traced plan that arrived after the probe started (the wizard's Ctrl+N on Plan) is the one it is compared with,
        as when it came first. None when the probe did not run."""
        from core.stages.probe import against_plan

        probe, made = self.results["probe"], self.results["plan"]
        if probe is None or made is None or not probe.devices:
            return probe
        return against_plan(probe, self.spec, made, self.traced)

    def write_record(self, signoff: dict[str, Any] | None = None) -> Path:
        """Build ``record.toml`` from the stage results (what did not run is marked so) and write it atomically.

        Raises:
            GpuAcceptError: the record is already signed (a signed record is never overwritten).
        """
        from core.record.build import build_record, environment
        from core.record.written import utc_now

        if self.signed:
            raise GpuAcceptError(f"{self.record_path} is already signed; start a new run to sign again")
        record = build_record(self.spec, run_dir=self.run_dir, model=self.model_info, plan=self.results["plan"],
                              traced=self.traced, probe=self.probe_as_recorded(), train_eval=self.results["train_eval"],
                              resume=self.results["resume"], started=self.started, finished=utc_now(),
                              env=environment(), stopped=self.stopped)
        return self._write_record_file(record, signoff)


def run_pipeline(
    spec: RunSpec,
    runs_root: Path = Path("runs"),
    cancelled: Callable[[], bool] | None = None,
    devices_override: list[Any] | None = None,
) -> Generator[Event, None, Path | None]:
    """Run every stage in order, yielding events; return the record's path (None when it could not be written).

    The run directory keeps the spec, the pipeline's events (``events.jsonl``), each child's job, log, events and
    checkpoints, and ``record.toml``. Bad input raises a named :class:`~core.errors.GpuAcceptError` before the run
    directory is created. A stage that fails or is cancelled stops the ones after it; the record is written anyway.
    """
    yield StageStarted("plan", detail="per-component memory plan per device (no weights loaded)")
    cluster = node_agreement(spec)
    try:
        run = AcceptanceRun(spec, runs_root, devices_override)
    except GpuAcceptError as exc:
        stopped_before_start(cluster, exc)  # the other nodes stop at their next gate with this reason
        raise
    try:
        yield from run.plan_stage(cancelled)
        yield from gate(run, cluster, "probe", True)
        probe = yield from run.probe_stage(cancelled)
        passed = probe.status == StageStatus.PASS
        yield from gate(run, cluster, "train_eval", passed, "" if passed else
                        f"its probe failed: {'; '.join(probe.problems) or probe.summary}")
        if not passed:
            raise GpuAcceptError("the probe failed; later stages were not run")
        yield from run.train_eval_stage(cancelled)
        if spec.training and spec.resume.check:
            yield from gate(run, cluster, "resume", True)
        yield from run.resume_stage(cancelled, cluster)
    except GpuAcceptError as exc:
        if cluster is not None:
            quietly(cluster.stop, str(exc))
        yield run.emit(Message("pipeline", text=f"stopped: {exc}"))
    finally:
        run.close()
    if run.log_error:
        yield Message("pipeline", text=f"the event log stopped being written ({run.log_error}); the events shown here "
                                       "are complete, the file is not")
    path = yield from record_stage(run)
    if cluster is not None:
        yield from cluster_stage(run, cluster, path)
        quietly(cluster.close)  # the node holding the store waits for the others to be done with it
    return path


def record_stage(run: Any) -> Generator[Event, None, Path | None]:
    """Write the run's record (unsigned) as the last stage of a headless pipeline (gpuaccept's recipe and a user's
    command alike): its events, then :class:`RunFinished`; the record's path, or None when there was no room (the
    run folder keeps every artefact)."""
    yield StageStarted("record", detail="record.toml, written atomically")
    try:
        path: Path = run.write_record()
    except OSError as exc:  # no room, or the folder went read-only: say so; every artefact stays in the run folder
        why = exc.strerror or str(exc)
        yield StageFinished("record", status=RecordStatus.NOT_WRITTEN, summary=f"the record could not be written "
                            f"({why}); the run folder {run.run_dir} keeps every artefact")
        yield RunFinished("record", status=StageStatus.FAIL, record_path="", run_dir=str(run.run_dir))
        return None
    yield StageFinished("record", status=RecordStatus.WRITTEN, summary=str(path))
    yield RunFinished("record", status=StageStatus(run.verdict or StageStatus.FAIL), record_path=str(path),
                      run_dir=str(run.run_dir))
    return path


