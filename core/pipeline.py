"""The pipeline: plan -> probe -> train + evaluate -> kill and resume -> record, as one generator of typed events.

Both faces of gpuaccept (the headless CLI and the Textual wizard) call :func:`run_pipeline` and only consume its events;
they never compute memory or verdicts themselves. Stage results arrive in :class:`~core.events.StageFinished` events.
A stage that fails stops the stages after it; the record is written in every case, with what did not run marked so.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import re
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.devicespec import parse_devices
from core.errors import GpuAcceptError, SpecError, StageError
from core.events import Event, Message, RunFinished, StageFinished, StageStarted
from core.protocol.events import EventWriter
from core.spec import RunSpec
from core.stages.childproc import launch_options
from core.status import RecordStatus, StageStatus, Stopped

STAGES = ("plan", "probe", "train_eval", "resume", "record")


@dataclass(frozen=True)
class PlanContext:
    """What the plan stage found: the resolved model, its config, the devices and the plan."""

    source: Any
    config: Any
    devices: list[Any]
    plan: Any


def make_plan(spec: RunSpec, devices_override: list[Any] | None = None) -> PlanContext:
    """Resolve the model, read its config (no weights), validate the spec against it and plan memory per device.

    Raises:
        SpecError, ModelNotFoundError: named errors for bad input.
    """
    from core.models import declared_max_positions, load_config, resolve_model
    from core.plan.devices import detect_devices
    from core.plan.memory import plan_memory
    from core.plan.meta import linear_module_names, untied
    from core.spec import validate_against_config

    source = resolve_model(spec.model)
    config = load_config(source)
    if spec.untie_embeddings:
        config = untied(config)
    modules = linear_module_names(config) if spec.adapters else None
    validate_against_config(spec, declared_max_positions(source, config), modules)
    # on the CPU, torchrun's ranks are planned as devices: local_world_size(1) is nproc_per_node there (else 1)
    devices = devices_override if devices_override is not None else detect_devices(spec.devices,
                                                                                   cpu_ranks=spec.local_world_size(1))
    plan = plan_memory(spec, config, devices)
    return PlanContext(source=source, config=config, devices=devices, plan=plan)


@dataclass(frozen=True)
class InputsChecked:
    """What :func:`check_inputs` read: the model found and the data's split, for a screen to confirm them, and every
    problem found on the way.

    Attributes:
        model: the model as found (``"the embedded SmolLM2-135M"``, a directory, a cached hub id), in words; None when
            it was not found.
        max_positions: the sequence length the model declares, or None.
        documents: documents in the data (None when the data could not be read); train / heldout: documents per side of
            the split.
        data: the data as named in the spec (``"embedded"`` or a path).
        problems: ``(field, message)`` for each input a plan or a run would refuse: ``"model"``, ``"data"``, or a spec
            field the model refuses (``"seq_len"``, ``"lora.targets"``); empty when none.
    """

    model: str | None
    max_positions: int | None
    documents: int | None
    train: int
    heldout: int
    data: str
    problems: tuple[tuple[str, str], ...] = ()
    heldout_fraction: float = 0.2

    @property
    def ok(self) -> bool:
        """True when nothing was refused."""
        return not self.problems

    def data_summary(self) -> str:
        """``"483 documents: 386 train / 97 held-out (20 %; each document by a hash of its id, 20 % expected)"``;
        "" when unread. The split is per document by a hash (core.data), so the share is near the fraction, not it."""
        if self.documents is None:
            return ""
        share = f"{100 * self.heldout / self.documents:.0f} %" if self.documents else "none"
        return (f"{self.documents:,} documents: {self.train:,} train / {self.heldout:,} held-out ({share}; each "
                f"document by a hash of its id, {100 * self.heldout_fraction:g} % expected)")


def check_inputs(spec: RunSpec) -> InputsChecked:
    """Everything a plan or a run would refuse about the spec's inputs, checked without weights or a run folder: the
    model is found and its config read, the spec fits the config (sequence length, LoRA target names), the data file
    is read and split (:func:`core.data.check_data`). The model and the data are checked apart, so a missing model does
    not hide a bad data file. Fast (a config and a text file), for a form to check as the user types.

    Returns:
        an :class:`InputsChecked`; its ``problems`` name each field to fix (never raised: a form shows them all).
    """
    from core.data import check_data
    from core.models import declared_max_positions, load_config, resolve_model
    from core.plan.meta import linear_module_names
    from core.spec import config_problems

    problems: list[tuple[str, str]] = []
    model: str | None = None
    max_positions: int | None = None
    try:
        source = resolve_model(spec.model)
        config = load_config(source)
        max_positions = declared_max_positions(source, config)
        problems += [(e.field, e.message) for e in config_problems(
            spec, max_positions, linear_module_names(config) if spec.adapters else None)]
        model = {"embedded": "the embedded SmolLM2-135M", "local_dir": f"the folder {source.path}",
                 "hf_cache": f"{source.name} from the Hugging Face cache",
                 "config_only": f"{source.name}: a config only (planned, not run)"}.get(source.kind, str(source.path))
    except SpecError as exc:
        problems.append((exc.field, exc.message))
    except GpuAcceptError as exc:  # ModelNotFoundError, an unreadable config
        problems.append(("model", str(exc)))
    try:
        split = check_data(spec.data, spec.heldout_fraction)
    except GpuAcceptError as exc:  # DataError
        problems.append(("data", str(exc)))
        return InputsChecked(model=model, max_positions=max_positions, documents=None, train=0, heldout=0,
                             data=spec.data, problems=tuple(problems), heldout_fraction=spec.heldout_fraction)
    return InputsChecked(model=model, max_positions=max_positions, documents=len(split.train) + len(split.heldout)
                         + split.dropped_duplicates, train=len(split.train), heldout=len(split.heldout),
                         data=spec.data, problems=tuple(problems), heldout_fraction=spec.heldout_fraction)


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
    stopped, and how the record is written. A subclass sets ``run_dir``, ``_log`` (an :class:`EventWriter`),
    ``results`` (each stage's result by name: ``probe``...), ``stopped``, ``log_error``, ``record_path``, ``verdict`` and ``signed``."""

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
            self.device = _run_device(spec, self.ctx.devices)
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
        yield self.emit(StageFinished("plan", status=StageStatus.judged(self.plan_fits), result=self.ctx.plan,
                                      summary=_plan_summary(self.ctx.plan, self.traced)))
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
        self.results["probe"] = probe
        yield self.emit(StageFinished("probe", status=probe.status, result=probe, summary=probe.summary))
        return probe

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
        self.results["train_eval"] = te
        yield self.emit(StageFinished("train_eval", status=te.status, result=te, summary=te.summary))
        return te

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
        self.results["resume"] = resume
        yield self.emit(StageFinished("resume", status=resume.status, result=resume, summary=resume.summary))
        return resume

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


def cluster_stage(run: StagedRun, cluster: Any, path: Path | None) -> Generator[Event, None, Path | None]:
    """Several nodes: every node shares its record; the node holding rank 0 writes the cluster record
    (core/record/cluster.py) beside its own, ``cluster.toml``. Returns its path on that node, None elsewhere."""
    from core.record.cluster import cluster_record
    from core.record.written import write_record

    probe = run.results.get("probe")
    holds = probe is not None and any(d.rank == 0 for d in probe.devices)
    text = path.read_text(encoding="utf-8") if path is not None else None
    try:
        shared = cluster.share(text, holds)
    except GpuAcceptError as exc:
        yield Message("record", text=f"the cluster record was not written: {exc}")
        return None
    if shared is None:  # another node writes it
        return None
    rank0 = next((i for i, (_, h) in enumerate(shared) if h), 0)
    out = write_record(cluster_record([t for t, _ in shared], rank0), run.run_dir / "cluster.toml")
    missing = cluster.nnodes - len(shared)
    yield Message("record", text=f"cluster record: {out} ({len(shared)} node records"
                                 + (f"; {missing} node(s) stopped before writing one" if missing else "") + ")")
    return out


def node_agreement(spec: RunSpec) -> Any:
    """The gate the nodes of a several-node run pass together (core/cluster/agree.py ``NodeAgreement``), or None on
    one node."""
    t = spec.torchrun
    return agreement(t.rdzv_endpoint, t.rdzv_id, t.nnodes, spec.spec_hash())


def agreement(endpoint: str, run_id: str, nnodes: int, spec_hash: str) -> Any:
    """The nodes' agreement at the rendezvous ``endpoint`` (its port + 1) for the run ``run_id`` of ``nnodes`` nodes
    running the spec of ``spec_hash``, or None on one node (gpuaccept's recipe and a user's command alike).

    Raises:
        GpuAcceptError: the store cannot be reached or held."""
    if nnodes < 2:
        return None
    from core.cluster.agree import NodeAgreement

    return NodeAgreement(endpoint, run_id, nnodes, spec_hash=spec_hash)


def stopped_before_start(cluster: Any, exc: GpuAcceptError) -> None:
    """This node could not start its run (``exc``): the other nodes stop at their next gate with its reason, and
    none waits for a record from it."""
    if cluster is not None:
        quietly(cluster.stop, str(exc))
        quietly(cluster.share, None, False, 0.0)
        quietly(cluster.close)


def quietly(call: Callable[..., Any], *args: Any) -> None:
    """``call(*args)``, its named error dropped: telling the other nodes is best effort once this one stopped."""
    try:
        call(*args)
    except GpuAcceptError:
        pass


def gate(run: StagedRun, cluster: Any, stage: str, goes_on: bool, why: str = "") -> Generator[Event, None, None]:
    """Before ``stage`` on several nodes: post whether this node goes on and wait for every node's word; when another
    node stops, this one stops too, the record saying which node stopped and why (``stage`` not run).

    Raises:
        GpuAcceptError: another node stopped, or not every node came within the wait.
    """
    if cluster is None:
        return
    from core.cluster.agree import stopped_by

    yield run.emit(Message("pipeline", text=f"waiting for every node of {cluster.nnodes} before the {stage} stage"))
    try:
        others = cluster.gate(stage, goes_on, why)
    except GpuAcceptError as exc:  # another spec on a node, a node that never came: the record keeps why
        raise run.refused(stage, str(exc)) from None
    if others and goes_on:
        raise run.refused(stage, f"another node stopped, so this one stops too: {stopped_by(others)}")


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


def traced_summary(traced: dict[str, Any] | None) -> str:
    """One line on the traced plan: its peak against the analytic tensor total and the line that differs most."""
    if not traced:
        return "traced plan: not run"
    if traced.get("status") != "estimated":
        return f"traced plan: {traced.get('status')} ({traced.get('reason', '')})"
    a, t = traced["analytic_tensor_bytes"], traced["peak_bytes"]
    rel = f" ({(t - a) / a:+.1%})" if a else ""
    row = traced["lines"][traced["most_different"]]
    return (f"traced plan (estimate, fake tensors): peak {t / 2**30:.3f} GiB of tensors vs analytic {a / 2**30:.3f} "
            f"GiB{rel} without overhead; differs most: {traced['most_different']} (analytic "
            f"{row['analytic_bytes'] / 2**30:.3f}, traced {row['traced_bytes'] / 2**30:.3f} GiB)")


#: what the one-time conversion of the embedded model is, in the wait's words
CONVERTING = "converting the embedded model from GGUF to safetensors (once)"
#: the code the conversion's child runs
CONVERT_CODE = "from core.models import ensure_embedded_cache; ensure_embedded_cache()"


def convert_in_child(log_path: Path, stage: str = "probe",
                     cancelled: Callable[[], bool] | None = None) -> Generator[Event, None, None]:
    """Convert the embedded model in a child process: its progress bars go to ``log_path``, never to the terminal.
    Yields a :class:`core.events.Waiting` as it starts and then every second (the screen shows the seconds; about
    80 s on a 2-core CPU), so the conversion is never a wait without a sign of life.

    Raises:
        StageError: the conversion failed (the log is named).
        StageCancelled: ``cancelled`` said stop (the child's process group is killed).
    """
    import subprocess
    import sys
    import time

    from core.errors import StageCancelled, StageError
    from core.events import Waiting
    from core.interpreter import python_env
    from core.procgroup import end_group

    since = time.time()
    with open(log_path, "wb") as log, open(os.devnull, "rb") as devnull:
        child = subprocess.Popen(
            [sys.executable, "-P", "-c", CONVERT_CODE], stdin=devnull, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=python_env(os.environ),
        )
        try:
            while child.poll() is None:
                yield Waiting(stage, run="model", pid=child.pid, what=CONVERTING, since=since)
                if cancelled is not None and cancelled():
                    raise StageCancelled(f"{stage} cancelled while {CONVERTING}")
                try:
                    child.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            end_group(child)
    if child.returncode != 0:
        raise StageError(f"converting the embedded model failed (see {log_path})")


def convert_blocking(log_path: Path) -> None:
    """:func:`convert_in_child` run to its end without showing its waits (where no screen follows them).

    Raises:
        StageError: the conversion failed (the log is named).
    """
    for _ in convert_in_child(log_path):
        pass


def recipe_unrunnable(spec: RunSpec) -> tuple[str, str] | None:
    """The first setting of ``spec`` gpuaccept's own recipe does not run (it plans them all): (the setting, what it
    asks), or None."""
    beyond = spec.beyond_own_recipe()
    if beyond is not None:
        return beyond
    if spec.training and spec.optimizer_kind.library in ("torchao", "galore_torch"):
        return "optimizer", f"{spec.optimizer_kind.label} ({spec.optimizer_kind.library} is not installed here)"
    return None


def check_runnable(spec: RunSpec, ctx: PlanContext, device: str, allow_unfit: bool = False) -> None:
    """Refuse, before a run directory exists, a run that cannot start here (``allow_unfit``: all but a plan that does
    not fit, which the user asked to probe anyway).

    Raises:
        GpuAcceptError: a config without weights, a plan that does not fit, a CUDA device torch cannot see, fp16
            training on the CPU, the paged 8-bit optimizer on the CPU, a variant without bitsandbytes installed; each
            says what to change.
    """
    from core.plan.fit import plan_fits

    spec.method.check_run(spec)  # what the method plans but this version's recipe does not run
    planned_only = recipe_unrunnable(spec)
    if planned_only:
        raise GpuAcceptError(f"{planned_only[0]}: {planned_only[1]} is planned (gpuaccept plan), not run by gpuaccept's own "
                             "recipe in this version (Trainer, standard cross-entropy, SFT); run your own trainer on it "
                             "in command mode (gpuaccept run --command ...), which measures what it does")
    if spec.strategy not in RUNNABLE_STRATEGIES:
        why = {"zero1": "Trainer runs ZeRO stages 1 and 2 through DeepSpeed, which is not installed here",
               "zero2": "Trainer runs ZeRO stages 1 and 2 through DeepSpeed, which is not installed here",
               "tp": "this version runs tensor parallelism only in the plan"}[spec.strategy]
        raise GpuAcceptError(f"strategy: {spec.strategy} can be planned (gpuaccept plan --strategy {spec.strategy}), "
                             f"not run: {why}; run with strategy single, ddp or zero3 (fsdp)")
    if spec.strategy == "device_map" and spec.training:
        raise GpuAcceptError("strategy: device_map is probed for inference in this version (layers split over the "
                             "devices, one process); training with it is planned only: gpuaccept plan --strategy "
                             "device_map, or train with ddp or zero3")
    if spec.torchrun.nnodes > 1 and spec.training and spec.resume.check and spec.strategy != "ddp":
        raise GpuAcceptError(f"resume.check: across nodes the kill-and-resume check runs under ddp, where each node "
                             f"keeps a whole checkpoint of its own; under {spec.strategy} Trainer gathers the full "
                             "state to rank 0's node only, so another node has nothing to resume from: run with "
                             "--no-resume-check (resume.check = false) on every node, or --strategy ddp")
    optimizer = spec.optimizer_kind
    if spec.strategy == "zero3" and device == "cpu" and spec.training and not optimizer.traceable:
        raise GpuAcceptError(f"optimizer: the CPU zero3 probe (torch FSDP2 outside Trainer) runs torch's own "
                             f"optimizers, not {spec.optimizer}: choose adamw or sgd, or probe zero3 on CUDA devices")
    if optimizer.needs_cuda and device == "cpu" and spec.training:
        raise GpuAcceptError(f"optimizer: {spec.optimizer} keeps its states in CUDA unified memory, paged between a GPU "
                             "and the host; on the CPU there is nothing to page (bitsandbytes would run the unpaged "
                             "optimizer instead): run an unpaged optimizer here (adamw_8bit), or this one on a CUDA "
                             "device")
    if spec.strategy in ("ddp", "zero3") and not spec.training:
        raise GpuAcceptError(f"strategy: inference runs in one process; {spec.strategy} is for training (every rank "
                             "would evaluate the same held-out blocks): use strategy single")
    if not ctx.source.runnable:
        raise GpuAcceptError(f"{spec.model} has no weights: it can be planned (gpuaccept plan), not run; "
                             "give a model directory with weights")
    if not allow_unfit and not plan_fits(ctx.plan):
        raise GpuAcceptError("the plan does not fit on the device; lower batch_size or seq_len (or use LoRA)")
    if device.startswith("cuda") and not _cuda_visible():
        raise GpuAcceptError(f"devices: {device} is not visible to torch here (no CUDA device or driver); "
                             "use --devices cpu or auto, or plan it with `gpuaccept plan`")
    if spec.dtype == "fp16" and device == "cpu" and spec.training:
        raise GpuAcceptError("dtype: fp16 training needs a CUDA device; on the CPU use fp32 or bf16")
    missing = attention_unavailable(spec.attn_implementation, device)
    if missing:
        raise GpuAcceptError(f"attn_implementation: {missing}")
    needs_bnb = f"mode: {spec.mode}" if spec.method.quantised else (
        f"optimizer: {spec.optimizer}" if spec.training and optimizer.needs_bitsandbytes else None)
    if needs_bnb and importlib.util.find_spec("bitsandbytes") is None:
        raise GpuAcceptError(f"{needs_bnb} runs on bitsandbytes, which is not installed here: pip install -e "
                             "\".[qlora]\" (make run and make test install it), or plan it only (gpuaccept plan)")


def attention_unavailable(attention: str, device: str) -> str | None:
    """Why ``attention`` cannot run on ``device`` here (a kernel whose package is missing, or a CUDA-only kernel on the
    CPU), or None. It can still be planned: the plan counts flash_attention_2 as a fused kernel, like sdpa."""
    import importlib.util

    if attention != "flash_attention_2":
        return None
    if importlib.util.find_spec("flash_attn") is None:
        return ("flash_attention_2 needs the flash_attn package, which is not installed here (pip install flash-attn, "
                "on a CUDA box); use sdpa, whose fused kernels save the same tensors (the plan is the same)")
    if not device.startswith("cuda"):
        return "flash_attention_2 runs on CUDA devices only; use sdpa on the CPU"
    return None


def runnable_reason(spec: RunSpec, ctx: PlanContext, allow_unfit: bool = False) -> str | None:
    """Why ``spec`` cannot run here (:func:`check_runnable`'s refusal), or None: for a screen to say it before Next
    (``allow_unfit``: whatever else refuses it; a plan that does not fit can still be probed anyway)."""
    try:
        check_runnable(spec, ctx, _run_device(spec, ctx.devices), allow_unfit=allow_unfit)
    except GpuAcceptError as exc:
        return str(exc)
    return None


#: Strategies the probe, training and resume stages run (the others are planned only; see check_runnable).
RUNNABLE_STRATEGIES = ("single", "ddp", "zero3", "device_map")


def rank_devices(spec: RunSpec, devices: list[Any], device: str) -> list[str]:
    """The device of each rank on this node, in local-rank order: the planned devices under torchrun (``cpu:r`` for
    CPU ranks, ``cuda:i``), else the one device the single process runs on."""
    if spec.local_world_size(len(devices)) > 1 or spec.torchrun.nnodes > 1 or spec.strategy == "device_map":
        return [d.name for d in devices]
    return [device]


def _run_device(spec: RunSpec, devices: list[Any]) -> str:
    """The device the single-device probe and training run on: the first planned device."""
    names = parse_devices(spec.devices)
    if names == ["cpu"] or not devices or devices[0].kind == "cpu":
        return "cpu"
    return devices[0].name


def _cuda_visible() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _plan_summary(plan: Any, traced: dict[str, Any] | None = None) -> str:
    from core.plan.fit import fit_verdicts

    parts = []
    from core.plan.memory import component_label

    for d, fit in zip(plan.devices, fit_verdicts(plan, traced)):
        verdict = {True: "fits", False: "does not fit", None: "fit unknown"}[fit.fits]
        peak = d.peak_phase.name.replace("_", " ") if d.peak_phase else ""
        # the peak the fit is judged by, split as the probe compares it: its tensors (`gpuaccept diff`'s "planned
        # tensors", the record's probe.plan_comparison planned_bytes) and the overhead line
        overhead = d.lines["overhead"].bytes
        parts.append(f"{d.device.name}: plan peak {fit.bytes / 2**30:.2f} GiB (tensors "
                     f"{(fit.bytes - overhead) / 2**30:.2f} GiB + {component_label('overhead', d.device.kind)} "
                     f"{overhead / 2**30:.2f} GiB) of {d.device.capacity_text()}, {verdict} ({fit.untraced_note}; "
                     f"the analytic peak is in the {peak})")
    return "; ".join(parts)
