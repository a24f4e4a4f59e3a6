"""Command mode's pipeline: probe (the uninterrupted run) -> plan (from what ran) -> evaluation -> kill and resume ->
record, as one generator of typed events (:func:`run_command_pipeline`), or stage by stage (:class:`CommandRun`, for
the wizard). The headless CLI and the wizard only consume its events, as for gpuaccept's own recipe.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from core.command.configplan import run_words
from core.command.evaluate import DEFAULT_EVAL_SEQ_LEN, CommandEvaluation, evaluate_stage, holds_weights
from core.command.nodeloss import CommandNodes
from core.command.plan import DeviceComparison, RanSpec, compare, plan_for, spec_from_run
from core.command.probe import CommandProbe, build_probe, rank_peaks, reported_devices
from core.command.reaper import start_reaper, stop_reaper
from core.command.resume import CommandResume, not_applicable, resume_stage
from core.command.run import RunOutcome, run_command
from core.commandspec import CommandSpec
from core.criteria import AcceptCriteria, Judgement
from core.errors import GpuAcceptError, StageCancelled, StageError
from core.events import Event, Message, StageStarted
from core.nodes import agreement, cluster_stage, gate, quietly, stopped_before_start
from core.pipeline import RESERVE_NAME, StagedRun, _reserve, new_run_dir, record_stage
from core.protocol.events import EventWriter
from core.record.verdicts import RecordValueError, StageVerdict
from core.status import StageStatus, Stopped

STAGES = ("probe", "plan", "train_eval", "resume", "record")


@dataclass(frozen=True)
class CommandPlan:
    """The plan stage of command mode. ``status``: pass (the plan of what ran fits every device) | fail |
    not_applicable (no Trainer reported what ran: ``reason``).

    Attributes:
        ran: the RunSpec planned (``spec``) and where each of its settings came from (``sources``).
        ctx: the plan context (:class:`core.prerun.PlanContext`), or None.
        comparisons: each measured rank against its device's plan.
    """

    status: StageStatus
    summary: str
    reason: str = ""
    ran: RanSpec | None = None
    ctx: Any = None
    comparisons: list[DeviceComparison] = field(default_factory=list)
    #: the criteria it was judged by (the verdict engine's rows)
    criteria: list[Judgement] = field(default_factory=list)


class CommandRun(StagedRun):
    """One acceptance of the user's command: its run directory and the result of each stage, run in order.

    The run directory holds ``spec.toml``, ``events.jsonl``, ``data/train.txt`` (when the command takes
    ``{train_data}``), one folder per run of the command (``reference/``, ``resume-interrupted/``, ``resume-resumed/``:
    its ``job.json``, ``command.log``, the Trainer hook's ``hook-events.jsonl``, ``memory.jsonl`` and its ``out/``),
    ``evaluation/`` and ``record.toml``.

    Raises (on construction):
        SpecError, DataError: bad input (the data file is read and split here), before any run directory exists.
        GpuAcceptError: the runs folder cannot hold a run folder.
    """

    def __init__(self, spec: CommandSpec, runs_root: Path = Path("runs"), backend: Any = None,
                 criteria: AcceptCriteria | None = None) -> None:
        import tomli_w

        from core.data import check_data
        from core.record.written import utc_now

        self.spec = spec
        #: the thresholds it is accepted by (core/criteria.py ``COMMAND_CRITERIA``; the defaults: the rules)
        self.criteria = criteria if criteria is not None else AcceptCriteria()
        self.started = utc_now()
        from core.interrupt import interruptible

        with interruptible("the data was read, before any run folder"):  # a signal stops it at once
            split = check_data(spec.data, spec.heldout_fraction) if spec.uses_training_split() or \
                spec.uses_heldout_split() or spec.eval == "perplexity" else None
        self.backend = backend if backend is not None else _nvml_backend()
        self.run_dir = new_run_dir(spec, Path(runs_root), self.started, label=spec.label)
        try:
            (self.run_dir / "spec.toml").write_text(tomli_w.dumps(spec.to_dict()), encoding="utf-8")
            self._log = EventWriter(self.run_dir / "events.jsonl")
            _reserve(self.run_dir / RESERVE_NAME)
            self.values = self._placeholders(split)
        except OSError as exc:
            raise GpuAcceptError(f"runs_dir: the run folder {self.run_dir} was made but {exc.filename or 'a file'} "
                                 f"could not be written ({exc.strerror or exc}); free space or give another "
                                 "--runs-dir") from None
        self.results: dict[str, Any] = {"probe": None, "plan": None, "train_eval": None, "resume": None}
        self.reference: RunOutcome | None = None
        self.stopped: dict[str, Stopped] = {}
        self.record_path: Path | None = None
        self.verdict: str | None = None
        self.signed = False
        self.log_error: str | None = None
        #: ends every process of the jobs (Python or not) if gpuaccept is killed (core/command/reaper.py)
        self._reaper = start_reaper(self.run_dir)

    def close(self) -> None:
        """Close the event log and end the reaper (every run of the command has ended by now)."""
        stop_reaper(self._reaper)
        super().close()

    def _placeholders(self, split: Any) -> dict[str, str]:
        values = {}
        if self.spec.uses_training_split():
            path = self.run_dir / "data" / "train.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n\n".join(d.text for d in split.train) + "\n", encoding="utf-8")
            values["{train_data}"] = str(path)
            values["{train_data_dir}"] = str(path.parent)  # holds train.txt alone: a text dataset's folder
        if self.spec.uses_heldout_split():
            path = self.run_dir / "heldout" / "heldout.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n\n".join(d.text for d in split.heldout) + "\n", encoding="utf-8")
            values["{heldout_data}"] = str(path)
        if self.spec.model:
            values["{model}"] = str(self._model_folder())
        return values

    def _model_folder(self) -> Path:
        """``command.model`` as a folder: the embedded SmolLM2-135M's safetensors cache (converted once, in a child
        process, its log in the run folder), or the folder given."""
        from core.models import embedded_cache_path, embedded_cache_ready
        from core.spec import EMBEDDED_MODEL

        if self.spec.model != EMBEDDED_MODEL:
            return Path(self.spec.model).expanduser().resolve()
        if not embedded_cache_ready():
            from core.prerun import convert_blocking

            convert_blocking(self.run_dir / "convert-embedded.log")
        return embedded_cache_path()

    # ------------------------------------------------------------------ stages
    def probe_stage(self, cancelled: Callable[[], bool] | None = None) -> Generator[Event, None, CommandProbe]:
        """The command once, uninterrupted (the reference of the resume check), measured per device."""
        spec = self.spec
        out = self.run_dir / "reference" / "out"
        argv = run_words(spec, spec.words(), self.values, out)
        yield self.emit(StageStarted("probe", detail="your command, uninterrupted, measured per device (inside when "
                                                     "Trainer-based, always from outside)"))
        yield self.emit(Message("probe", text=shlex.join(argv)))
        from core.monitor.health import preflight

        # every GPU CUDA can use here, read before the command starts; those it used are judged once it ran
        health = preflight(None, getattr(self.backend, "nvml", None))
        yield self.emit(Message("probe", text=health.summary()))
        try:
            outcome = yield from self._stage("probe", run_command(spec, "reference", argv, out,
                                                                  self.run_dir / "reference", "probe",
                                                                  cancelled=cancelled, backend=self.backend))
        except StageCancelled as stop:  # what was measured until the quit stays: the probe, marked cancelled
            so_far = getattr(stop, "outcome", None)
            if so_far is not None:
                probe = build_probe(so_far, self._capacities(so_far))
                self.results["probe"] = dataclasses.replace(
                    probe, status=StageStatus.CANCELLED,
                    summary=f"cancelled after {so_far.seconds:.1f} s and {probe.steps} steps (the quit killed every "
                            f"process of it); measured until then: {_peaks(probe)}")
            raise
        self.reference = outcome
        probe = dataclasses.replace(build_probe(outcome, self._capacities(outcome)), health=health)
        for finding in probe.findings:
            yield self.emit(Message("probe", text=f"finding: {finding}"))
        return (yield from self.finished("probe", probe))

    def _capacities(self, outcome: RunOutcome) -> dict[str, tuple[int | None, str]]:
        from core.plan.devices import detect_devices

        labels = set(reported_devices(outcome).values()) | {k for k in outcome.peaks if k.startswith(("cpu", "cuda"))}
        ranks = sum(1 for d in labels if d.startswith("cpu:"))
        out: dict[str, tuple[int | None, str]] = {d.name: (d.capacity_bytes, d.capacity_source)
                                                  for d in detect_devices("cpu", cpu_ranks=max(ranks, 1))}
        cuda = sorted(d for d in labels if d.startswith("cuda"))
        if cuda:
            try:
                out.update({d.name: (d.capacity_bytes, d.capacity_source) for d in
                            detect_devices(",".join(d.split(":")[1] for d in cuda))})
            except GpuAcceptError:
                pass
        return out

    def plan_stage(self) -> Generator[Event, None, CommandPlan]:
        """The plan of what ran (the Trainer's report; else the trainer's config file the command names:
        :mod:`core.command.configplan`), per device, compared with what was measured there."""
        from core.plan.fit import all_fit, fit_verdicts

        yield self.emit(StageStarted("plan", detail="the memory plan of what your command ran, compared per device"))
        outcome = self.reference
        if outcome is None:
            raise self.refused("plan", "the command did not run, so nothing says what to plan")
        ran, measured = self._what_ran(outcome)
        ctx, why = plan_for(ran)
        if ctx is None:
            result = CommandPlan(StageStatus.NOT_APPLICABLE, f"no plan: {why}", reason=why, ran=ran)
        else:
            comparisons = compare(ctx.plan, measured)
            fits = fit_verdicts(ctx.plan)
            status = StageStatus.judged(all_fit(fits))
            words = "; ".join(f"{c.device}: planned {c.planned_bytes / 2**30:.2f} GiB, measured "
                              f"{c.measured_bytes / 2**30:.2f} GiB (plan error {c.error_pct:+.1f} %: "
                              f"{'above' if c.error_pct >= 0 else 'below'} the measurement)" for c in comparisons)
            fit_words = "; ".join(f"{f.device} {'fits' if f.fits else 'does not fit' if f.fits is False else 'unknown'}"
                                  for f in fits)
            of = "what ran" if ran.made_from == RanSpec.made_from else ran.made_from
            result = CommandPlan(status, f"{ran.spec.mode if ran.spec else ''} plan of {of}: {fit_words}"
                                         + (f"; {words}" if words else ""), ran=ran, ctx=ctx, comparisons=comparisons)
            try:
                (self.run_dir / "plan").mkdir(exist_ok=True)
                (self.run_dir / "plan" / "plan.json").write_text(json.dumps(ctx.plan.to_json(), indent=2),
                                                                 encoding="utf-8")
            except OSError as exc:
                raise StageError(f"plan: {exc}") from None
        return (yield from self.finished("plan", result))

    def _what_ran(self, outcome: RunOutcome) -> tuple[RanSpec, list[dict[str, Any]]]:
        """The spec of what ran and what each rank measured: the Trainer's report and its ranks' peaks (inside); for a
        job measured from outside whose command names a trainer's config, that config and each device's reading of
        the probe (sampled RSS, NVML)."""
        ran = spec_from_run(outcome.trainer, list(outcome.hook.batches.values()),
                            self.run_dir / "plan" / "config.json", outcome.last_step(),
                            (self.spec.nnodes, self.spec.rdzv_endpoint))
        measured = [{"device": device, "rank": rank, **rank_peaks(outcome).get(rank, {})}
                    for rank, device in reported_devices(outcome).items()]
        probe = self.results.get("probe")
        if outcome.trainer is not None or probe is None:
            return ran, measured
        from core.command.configplan import spec_from_config

        rows = [d for d in probe.devices if d.measured_bytes]
        cuda = [d for d in rows if d.device.startswith("cuda")]
        placement: dict[str, Any] = ({"devices": ",".join(d.device.split(":")[1] for d in cuda)} if cuda else
                                     {"devices": "cpu", **({"torchrun_nproc_per_node": len(rows)} if len(rows) > 1
                                                           else {})})
        from_config = spec_from_config(self.spec, {**self.values, "{out}": str(outcome.out_dir)}, placement,
                                       outcome.last_step())
        if from_config is None:
            return ran, measured
        return from_config, [{"device": d.device, "rank": d.rank,
                              ("nvml_used_bytes" if d.device.startswith("cuda") else "peak_rss_bytes"): d.measured_bytes}
                             for d in (cuda or rows)]

    def train_eval_stage(self, cancelled: Callable[[], bool] | None = None
                         ) -> Generator[Event, None, CommandEvaluation]:
        """The final checkpoint against its base on the held-out split (or the user's evaluation command)."""
        outcome = self.reference
        if outcome is None or outcome.exit_code != 0:
            raise self.refused("train_eval", "the command did not end well, so there is no final checkpoint to "
                                              "evaluate")
        if self.spec.eval == "none":
            off = CommandEvaluation(StageStatus.NOT_APPLICABLE, "none", "", "", False, None, None, "", None, "", "",
                                    summary="switched off (command.eval = \"none\")")
            return (yield from self.finished("train_eval", off))
        final = outcome.checkpoints[-1] if outcome.checkpoints else None
        if self.spec.nnodes > 1 and final is not None and not holds_weights(Path(final.path)):
            elsewhere = CommandEvaluation(
                StageStatus.NOT_APPLICABLE, "none", "", "", False, None, None, "", None, "", "",
                summary=f"not evaluated on this node: its {final.name} holds no weights (the command wrote them on "
                        "another node: the one holding rank 0 evaluates them; its record is in the cluster record)")
            return (yield from self.finished("train_eval", elsewhere))
        yield self.emit(StageStarted("train_eval", detail="the final checkpoint against its base on held-out data"))
        result: CommandEvaluation = yield from self._stage("train_eval", evaluate_stage(
            self.spec, final, self.base_model(), self.eval_seq_len(), self.run_dir / "evaluation", cancelled,
            heldout=self.values.get("{heldout_data}", "")))
        return (yield from self.finished("train_eval", result))

    def base_model(self) -> str:
        """The model before training: ``command.model``, else the folder the Trainer's model (or its adapter) was
        loaded from, when it is a folder here; "" when none is known."""
        if self.spec.model:
            return self.values["{model}"]
        trainer = self.reference.trainer if self.reference else None
        for name in ((trainer or {}).get("peft") or {}).get("base_model_name_or_path"), \
                (trainer or {}).get("name_or_path"):
            if name and Path(str(name)).is_dir():
                return str(Path(str(name)).resolve())
        return ""

    def eval_seq_len(self) -> int:
        if self.spec.eval_seq_len:
            return self.spec.eval_seq_len
        widths = [w for b in (self.reference.hook.batches.values() if self.reference else []) for w in b.get("widths", [])]
        return max(widths) if widths else DEFAULT_EVAL_SEQ_LEN

    def tier(self) -> Any:
        """The tier of the resume check (:func:`core.stages.noise.required_tier`): the device the command ran on, its
        compute dtype (the Trainer's bf16 / fp16 flag or parameter dtype; else ``command.dtype``), ``resume_noise``
        and the test jitter."""
        from core.child.inject.jitter import amplitude
        from core.stages.noise import required_tier

        outcome = self.reference
        trainer = outcome.trainer if outcome else None
        device = str((trainer or {}).get("device", "cpu"))
        if trainer is None and outcome is not None and any(k.startswith("cuda") for k in outcome.peaks):
            device = "cuda"
        dtype = self.spec.dtype
        plan = self.results.get("plan")
        if plan is not None and plan.ran is not None and plan.ran.spec is not None:
            dtype = plan.ran.spec.dtype
        return required_tier(device, dtype, self.criteria.resume_tier, self.spec.resume_noise,
                             jittered=amplitude() > 0, twins=self.spec.resume_twins)

    def resume_stage(self, cancelled: Callable[[], bool] | None = None, cluster: Any = None,
                     ) -> Generator[Event, None, CommandResume]:
        """Kill the command after a checkpoint, resume it, compare with the uninterrupted run; across nodes
        (``cluster``: the nodes' agreement) one node is lost (:mod:`core.command.nodeloss`)."""
        outcome = self.reference
        if not self.spec.resume_check:
            result = not_applicable("switched off (command.resume_check = false)")
            yield self.emit(StageStarted("resume", detail="nothing to resume"))
        else:
            if outcome is None or outcome.exit_code != 0:
                raise self.refused("resume", "the uninterrupted run did not end well, so it is no reference")
            yield self.emit(StageStarted("resume", detail="kill your command after a checkpoint, resume it with your "
                                                          "resume command, compare"))
            nodes = None
            if cluster is not None:
                nodes = yield from self._stage("resume", _lost_node(cluster, self.spec.nnodes))
            result = yield from self._stage("resume", resume_stage(self.spec, outcome, self.run_dir, self.values,
                                                                   self.tier(), cancelled, self.backend, nodes=nodes))
            for finding in result.findings:
                yield self.emit(Message("resume", text=f"finding: {finding}"))
        return (yield from self.finished("resume", result))

    def engine(self, stage: str) -> StageVerdict | None:
        """The verdict engine's verdict of ``stage`` over the table the record would hold now
        (:func:`core.command.record.judged_stage`); None where it cannot be judged (never expected of its own tables:
        the record's verdict then says why it kept the stage's own status)."""
        from core.command.record import judged_stage

        try:
            return judged_stage(self, stage)
        except RecordValueError:
            return None

    # ------------------------------------------------------------------ the record
    def current_verdict(self) -> dict[str, Any]:
        """The verdict the record would hold if written now (its tables built and judged as
        :meth:`write_record` would; the environment left out, which no verdict reads)."""
        from core.command.record import build_command_record
        from core.record.written import utc_now

        return cast(dict[str, Any], build_command_record(self, started=self.started, finished=utc_now(),
                                                         env={})["verdict"])

    def write_record(self, signoff: dict[str, Any] | None = None) -> Path:
        """Build ``record.toml`` of kind ``command`` from the stage results and write it atomically.

        Raises:
            GpuAcceptError: the record is already signed.
        """
        from core.command.record import build_command_record
        from core.record.build import environment
        from core.record.written import utc_now

        if self.signed:
            raise GpuAcceptError(f"{self.record_path} is already signed; start a new run to sign again")
        record = build_command_record(self, started=self.started, finished=utc_now(), env=environment())
        return self._write_record_file(record, signoff)


def _lost_node(cluster: Any, nnodes: int) -> Generator[Event, None, CommandNodes]:
    """Agree with the other nodes which one the resume check loses (:meth:`CommandNodes.choose`), and say it."""
    nodes = CommandNodes.choose(cluster, nnodes)
    yield Message("resume", text=f"across {nnodes} nodes the check loses one: {nodes.lost_name}"
                                 + (" (this node)" if nodes.is_lost else ""))
    return nodes


def _peaks(probe: CommandProbe) -> str:
    return ", ".join(f"{d.device} peak {d.measured_bytes / 2**30:.2f} GiB" for d in probe.devices) or "no device"


def _nvml_backend() -> Any:
    """NVML for the GPUs' memory from outside, or None where it does not start (no driver: a CPU box)."""
    from core.monitor.nvml import default_backend

    backend, _ = default_backend()
    return backend if getattr(backend, "name", "") == "nvml" else None


def every_stage(run: CommandRun, cancelled: Callable[[], bool] | None = None, cluster: Any = None,
                ) -> Generator[Event, None, None]:
    """Run the stages of ``run`` in order (the headless pipeline and the wizard's run screen both): probe, plan, then
    evaluation and the resume check only when the command exited 0. A stage that stops (cancelled, an error) stops the
    rest; the reason is a message and stays in ``run.stopped`` for the record. ``cluster`` (several nodes: the nodes'
    agreement, core/cluster/agree.py): every node starts its command together and goes on to the evaluation only when
    every node's command exited 0; a node that stops stops the others."""
    try:
        yield from gate(run, cluster, "probe", True)
        yield from run.probe_stage(cancelled)
        yield from run.plan_stage()
        ended = run.reference is not None and run.reference.exit_code == 0
        yield from gate(run, cluster, "train_eval", ended, "" if ended else "its command did not exit 0")
        if not ended:
            why = "the command did not exit 0; its evaluation and the resume check were not run"
            for stage in ("train_eval", "resume"):
                run.stopped[stage] = Stopped(StageStatus.NOT_RUN, f"not run: {why}")
            raise GpuAcceptError(why)
        yield from run.train_eval_stage(cancelled)
        yield from run.resume_stage(cancelled, cluster)
    except GpuAcceptError as exc:
        if cluster is not None:
            quietly(cluster.stop, str(exc))
        yield run.emit(Message("pipeline", text=f"stopped: {exc}"))


def run_command_pipeline(spec: CommandSpec, runs_root: Path = Path("runs"),
                         cancelled: Callable[[], bool] | None = None,
                         criteria: AcceptCriteria | None = None) -> Generator[Event, None, Path | None]:
    """Run every stage of command mode in order, yielding events; return the record's path (None when it could not be
    written). A command that exits early or fails stops the stages that need its checkpoints; the record is written
    in every case, with what did not run marked so.

    Raises:
        SpecError, DataError, GpuAcceptError: bad input, before the run directory is created.
    """
    from core.models import embedded_cache_ready
    from core.spec import EMBEDDED_MODEL

    if spec.model == EMBEDDED_MODEL and not embedded_cache_ready():
        yield Message("probe", text="converting the embedded model from GGUF to safetensors (once, ~16 s)")
    cluster = agreement(spec.rdzv_endpoint, spec.rdzv_id, spec.nnodes, spec.spec_hash())
    try:
        run = CommandRun(spec, runs_root, criteria=criteria)
    except GpuAcceptError as exc:
        stopped_before_start(cluster, exc)
        raise
    try:
        yield from every_stage(run, cancelled, cluster)
    finally:
        run.close()
    path = yield from record_stage(run)
    if cluster is not None:
        yield from cluster_stage(run, cluster, path)
        quietly(cluster.close)
    return path
