"""Kill and resume of the user's job: "a checkpoint exists" is not "it resumes".

The uninterrupted run (the probe stage's) is the reference. Its checkpoints, by step, give c (the
``kill_after_checkpoint``-th) and the next one n; the kill lands at step ``k = c + max(1, (n - c) // 2)``:

1. **interrupted**: the training command again, into a fresh ``{out}``. A Trainer-based script holds after optimizer
   step k on every rank (the hook's ``GPUACCEPT_HOLD_AT_STEP``: exact on any machine's speed); another script is
   killed as soon as its metrics show step k (checked every 20 ms: a script that writes checkpoint n within that time
   is caught by the ``kill_point`` check, never passed). Then SIGKILL to every process of it, every rank
   (:func:`core.command.process.kill_job`).
2. **the checkpoint left**, checked before anything loads it (a failed manifest, safe-loading, trainer-state or world
   size check stops the resume; an incomplete checkpoint is still resumed, and what follows is evidence too): the newest complete checkpoint is c (a partial newer one
   is named), it holds every component (Trainer's set: weights or adapter, optimizer, scheduler, RNG state per rank,
   trainer state, GradScaler with fp16; for another script the files of ``command.checkpoint_files``), its sha256
   manifest is taken, every pickle the resume loads loads with ``torch.load`` with ``weights_only=True``, Trainer's state says
   step c, and it was written at the world size the resume runs at.
3. **resumed**: the resume command with ``{checkpoint}`` = checkpoint c, into its own ``{out}``, to its end.
4. **compared** with the reference: the steps the resumed run logged (exactly the reference's after c), the learning
   rate and the samples of every step (exact), the loss of every step and rank (within the tier's bound), the
   trainable set (Trainer), the manifest again after the run, and at the reference's last checkpoint every tensor
   file: weights (bound), optimizer progress (exact) and moments (bound), RNG and scheduler states (exact). What could
   not be compared (no learning rate or sample ids in the metrics, a JSON file) is listed, never counted as passed.

Where the tier measures the noise (:mod:`core.stages.noise`: on CUDA, or under the test jitter), **twins** run
first: the training command again (``command.resume_twins`` times, the second nudged by one ulp), uninterrupted, each
into its own ``{out}``; they and the reference started alike, from step 0, so every pair of the three is a sample of
the noise, and the bound of every tolerance check is the tier's multiple of their spread (the losses of the steps
compared; per tensor at the reference's last checkpoint; each number of a JSON state).

Across nodes (``command.nnodes`` > 1) one node is lost between the checkpoints instead of the whole job
(:mod:`core.command.nodeloss`): every node runs each run together, the lost node's command is held and killed, the
others' fail waiting for it, and every node resumes from its own newest checkpoint complete on every node.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from core.child.inject.jitter import NUDGE_ENV
from core.cluster.agree import stopped_by
from core.command.configplan import run_words
from core.command.nodeloss import CommandNodes, survived_evidence
from core.command.reports import Checkpoint, StepRecord, failure_lines, last_lines
from core.command.run import RunOutcome, run_command
from core.command.spec import CommandSpec, launcher_nnodes, launcher_nproc, launcher_world, with_nproc
from core.criteria import Judgement
from core.errors import StageError
from core.events import Event, Message
from core.protocol.manifest import verify_manifest, write_manifest
from core.stages.compare import (
    Check,
    Key,
    ResumeSeries,
    StepPoint,
    StepRules,
    StepSeries,
    StepWords,
    compare_series,
    span,
    verdict,
)
from core.stages.nodeloss import LOSS_GRACE_S
from core.stages.noise import Bounded, Family, Tier, file_rows, judge_tensors, resized_tier
from core.stages.resume import (
    PICKLE_SUFFIXES,
    UntrustedCheckpoint,
    compare_optimizer_states,
    compare_optimizers,
    is_optimizer_state,
    pickles_load_safely,
    safe_load,
    world_size_check,
)
from core.status import StageStatus

#: files Trainer writes that a resume never loads: a pickle of TrainingArguments (not weights-only loadable) and
#: peft's model card
TRAINER_UNLOADED = ("training_args.bin", "README.md")
#: the checks of the checkpoint left by the kill that stop the resume when they fail: nothing unsafe or written at
#: another world size is loaded
LOADING_GUARDS = ("manifest", "safe_loading", "world_size", "trainer_state")
#: why a script without the Trainer hook is not checked across nodes
NO_HOOK_ACROSS_NODES = ("across nodes the check holds the lost node's ranks after a step and resumes each node from "
                        "its own ranks' checkpoint, which it learns from the Trainer hook; this script reported no "
                        "Trainer: check its resume on one node, or run it with transformers' Trainer")
#: why a resume at another world size is not checked across nodes
RESIZE_ACROSS_NODES = ("refused: the resume command runs at another world size than the training, across nodes. The "
                       "check gives each node its own {out} on its own disk, so after losing a node the others hold "
                       "only their own ranks' shards and a restart on fewer nodes has nothing to reshard from; give "
                       "the resume command the training's world size, or check the resize on one node (a job "
                       "restarting on fewer nodes needs its checkpoints on a filesystem every node reads)")
#: suffixes of the files read as pickles (``torch.load``)
PICKLES = PICKLE_SUFFIXES


@dataclass(frozen=True)
class RunSummary:
    """One run of the check: its words, how it ended, its log."""

    argv: list[str]
    exit_code: int | None
    killed: str
    seconds: float
    log: str
    out_dir: str


@dataclass(frozen=True)
class CommandResume:
    """Outcome of the kill-and-resume check. ``status``: pass | fail | not_applicable (switched off)."""

    status: StageStatus
    summary: str
    checks: list[Check] = field(default_factory=list)
    checkpoint_step: int | None = None
    next_checkpoint_step: int | None = None
    kill_step: int | None = None
    final_checkpoint_step: int | None = None
    tier: Tier | None = None
    comparison: list[dict[str, Any]] = field(default_factory=list)
    manifest: dict[str, str] = field(default_factory=dict)
    not_compared: list[str] = field(default_factory=list)
    #: the last step of the twin runs (None: no twin ran)
    twin_final_step: int | None = None
    runs: dict[str, RunSummary] = field(default_factory=dict)
    #: what the check's runs did that must be read (a process left running after it exited, a metrics line refused)
    findings: list[str] = field(default_factory=list)
    required_files: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: the criteria it was judged by (core/criteria.py ``judge_resume_tier``), with the numbers
    criteria: list[Judgement] = field(default_factory=list)


@dataclass(frozen=True)
class KillPlan:
    """Where the check kills and compares, from the uninterrupted run's checkpoints: resume from checkpoint ``c``,
    kill at step ``k``, before the next checkpoint ``n``, compare at the last one, ``final``."""

    c: int
    n: int
    k: int
    final: int


@dataclass
class _Progress:
    """The check as it goes: its checks and what its runs left; :meth:`finish` makes the result (a check that stops
    early finishes there too). ``plan`` is set once the twin, if any, has run: a result stopped before names no
    kill."""

    started: float
    tier: Tier
    required: list[str]
    checks: list[Check] = field(default_factory=list)
    plan: KillPlan | None = None
    runs: dict[str, RunSummary] = field(default_factory=dict)
    manifest: dict[str, str] = field(default_factory=dict)
    comparison: list[dict[str, Any]] = field(default_factory=list)
    not_compared: list[str] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)
    twin_final: int | None = None
    #: across nodes, this node stopped the others (its part of the loss went wrong)
    stopped_nodes: bool = False

    def finish(self) -> CommandResume:
        status, failed = verdict(self.checks)
        p = self.plan
        c, n, k, final = (p.c, p.n, p.k, p.final) if p is not None else (None, None, None, None)
        extra = f"; not compared: {'; '.join(self.not_compared)}" if self.not_compared else ""
        summary = (f"killed at step {k} after checkpoint {c}, resumed from it, compared up to step {final}: "
                   f"{len(self.checks)} checks passed ({self.tier.name}){extra}" if status == StageStatus.PASS else
                   f"failed: {', '.join(ch.name for ch in failed)}: " + "; ".join(ch.evidence for ch in failed)[:600])
        return CommandResume(status=status, summary=summary, checks=self.checks, checkpoint_step=c,
                             next_checkpoint_step=n, kill_step=k, final_checkpoint_step=final, tier=self.tier,
                             comparison=self.comparison, manifest=self.manifest, not_compared=self.not_compared,
                             runs=self.runs, required_files=self.required, seconds=time.perf_counter() - self.started,
                             findings=self.findings, twin_final_step=self.twin_final)


def trainer_files(trainer: dict[str, Any], world: int, ranks: list[int] | None = None) -> list[str]:
    """The files a Trainer checkpoint must hold to resume (transformers' ``_save_checkpoint``): the adapter (a
    PeftModel) or the model's weights, optimizer, scheduler, trainer state, one RNG state per process (``ranks``,
    several nodes: this node's only, each node keeping its own checkpoint), and the GradScaler with fp16."""
    weights = "adapter_model.safetensors" if trainer.get("peft") else "model.safetensors"
    files = [weights, "optimizer.pt", "scheduler.pt", "trainer_state.json"]
    files += [f"rng_state_{r}.pth" for r in (ranks if ranks is not None else range(world))] if world > 1 \
        else ["rng_state.pth"]
    if (trainer.get("arguments") or {}).get("fp16"):
        files.append("scaler.pt")
    return files


def missing_files(ckpt: Path, required: list[str]) -> list[str]:
    """The required files absent from ``ckpt``; a sharded model's weights count as present when its index is there
    (``model.safetensors`` -> ``model.safetensors.index.json``)."""
    out = []
    for name in required:
        if (ckpt / name).is_file():
            continue
        if name.endswith(".safetensors") and (ckpt / f"{name}.index.json").is_file():
            continue
        out.append(name)
    return out


def not_applicable(why: str) -> CommandResume:
    return CommandResume(status=StageStatus.NOT_APPLICABLE, summary=why)


def run_twins(spec: CommandSpec, reference: RunOutcome, run_dir: Path, values: dict[str, str], count: int,
              cancelled: Callable[[], bool] | None = None, backend: Any = None, resize: Resize | None = None,
              nodes: CommandNodes | None = None) -> Generator[Event, None, list[RunOutcome]]:
    """The twins of the resume check (:mod:`core.stages.noise`): the training command again, ``count`` times,
    uninterrupted, each into its own ``{out}`` (``run_dir/resume-twin-<i>``), every one after the first nudged by one
    ulp before its first optimizer step (``GPUACCEPT_NUDGE_ULP``, :mod:`core.child.inject.jitter`); with ``resize``,
    at the resume's world size (its torchrun line starting the resume's processes per node). A twin that fails ends
    the list there (the caller names it).

    Raises:
        StageCancelled: the user stopped it; every process of the command was killed."""
    words = spec.words() if resize is None else with_nproc(spec.words(), resize.nproc)
    yield Message("resume", text=f"{count} twin runs: the training command again, uninterrupted (the second nudged by "
                                 "one ulp); their spread is the run-to-run noise the comparison is bounded by"
                                 if resize is None else
                                 f"{count} twin runs: the training command again at the resume's world size "
                                 f"({resize.resumed}, of {resize.trained}); their distance from the uninterrupted run "
                                 "is what the world size alone moves, the bound of the comparison")
    twins: list[RunOutcome] = []
    for i in range(1, count + 1):
        if nodes is not None:
            nodes.together(f"twin-{i}")
        out = run_dir / f"resume-twin-{i}" / "out"
        twin = yield from run_command(spec, f"twin-{i}", run_words(spec, words, values, out), out,
                                      run_dir / f"resume-twin-{i}", "resume", total=reference.last_step() or 0,
                                      cancelled=cancelled, backend=backend,
                                      env={NUDGE_ENV: "1"} if i > 1 else None)
        twins.append(twin)
        if twin.exit_code != 0:
            break
    return twins


def resume_stage(spec: CommandSpec, reference: RunOutcome, run_dir: Path, values: dict[str, str], tier: Tier,
                 cancelled: Callable[[], bool] | None = None, backend: Any = None,
                 twins: list[RunOutcome] | None = None, nodes: CommandNodes | None = None,
                 ) -> Generator[Event, None, CommandResume]:
    """Kill the command after checkpoint c, resume it, compare with ``reference`` (see the module docstring): the
    plan of the kill (:func:`kill_plan`), the twins where the tier needs them (:func:`_twin_phase`), the interrupted run
    (:func:`_interrupted_phase`), the checkpoint it left (:func:`_gate`), the resumed run (:func:`_resumed_phase`),
    the comparison (:func:`_compare`).

    Args:
        values: the placeholders other than ``{out}`` and ``{checkpoint}`` (``{train_data}``, ``{model}``).
        tier: how the loss and tensor comparisons are judged (:func:`core.stages.noise.required_tier`): bit-exact, or
            bounded by the spread of twin runs (they then run first: :func:`run_twins`).
        twins: the twins already run (the same command and reference: several resumes judged by one measurement of
            the noise); None runs them here when the tier needs them.
        nodes: several nodes: this node's part in losing one of them (:mod:`core.command.nodeloss`); None: one node.

    Raises:
        StageCancelled: the user stopped it; every process of the command was killed.
        StageError: a run could not start.
    """
    resize = resize_of(spec)
    runs = _Runs(spec, reference, run_dir, values, cancelled, backend, nodes, resize)
    trainer, world = reference.trainer, reference.hook.world_size
    progress = _Progress(time.perf_counter(), tier, list(spec.checkpoint_files) or (
        trainer_files(trainer, world, runs.ranks if nodes is not None else None) if trainer else []))
    if nodes is not None and trainer is None:  # the same script on every node: every node stops here alike
        progress.checks.append(Check("nodes", StageStatus.FAIL, NO_HOOK_ACROSS_NODES, kind="completeness"))
        return progress.finish()
    if resize is not None and (nodes is not None or resize.nodes_changed):
        progress.checks.append(Check("world_size", StageStatus.FAIL, RESIZE_ACROSS_NODES))
        return progress.finish()
    if resize is not None and trainer is None:  # DCP may reshard: judged against a twin at the resume's world size
        progress.tier = resize.tier(tier)
    plan = kill_plan(spec, reference, progress.checks)
    if plan is None:
        return _stopped_here(nodes, progress)
    twins, measured = yield from _twin_phase(runs, progress.tier, twins, progress)
    if not measured:
        return _stopped_here(nodes, progress)
    progress.plan = plan
    interrupted, ckpt = yield from (_interrupted_phase(runs, plan, progress) if nodes is None else
                                    _node_loss_phase(runs, nodes, plan, progress))
    if progress.stopped_nodes:  # this node's loss went wrong: the others were told and stop
        return progress.finish()
    resumable = ckpt is not None and _gate(runs, interrupted, ckpt, plan, progress)
    if nodes is not None:  # every node restarts, or none: a node left out would hold the others at the rendezvous
        resumable = _every_node_resumable(nodes, resumable, progress)
    if ckpt is None or not resumable:
        return progress.finish()
    resumed = yield from _resumed_phase(runs, ckpt, plan, progress)
    if resumed is not None:
        _compare(runs, interrupted, resumed, twins, plan, progress)
    return progress.finish()


def _stopped_here(nodes: CommandNodes | None, progress: _Progress) -> CommandResume:
    """The check ends early on this node: the result, after telling the other nodes (across nodes), which would
    otherwise wait for it at the next run's rendezvous."""
    result = progress.finish()
    if nodes is not None:
        nodes.cluster.stop(f"its resume check stopped before the runs every node makes together: {result.summary}")
    return result


@dataclass(frozen=True)
class _Runs:
    """What every run of the check is started with: the command, the uninterrupted run, where, its placeholders."""

    spec: CommandSpec
    reference: RunOutcome
    run_dir: Path
    values: dict[str, str]
    cancelled: Callable[[], bool] | None
    backend: Any
    nodes: CommandNodes | None = None
    resize: Resize | None = None

    @property
    def trainer(self) -> dict[str, Any] | None:
        return self.reference.trainer

    @property
    def world(self) -> int:
        return self.reference.hook.world_size

    def interrupted_words(self) -> tuple[Path, list[str]]:
        """The interrupted run's ``{out}`` and its words (the training command into it)."""
        out = self.run_dir / "resume-interrupted" / "out"
        return out, run_words(self.spec, self.spec.words(), self.values, out)

    @property
    def ranks(self) -> list[int]:
        """This node's ranks in the uninterrupted run (every rank on one node)."""
        return hook_ranks(self.reference)


def hook_ranks(o: RunOutcome) -> list[int]:
    """The ranks a run held on this node: its Trainer hook's ``trainer`` events (none: no Trainer, or none began)."""
    return sorted({int(e.get("rank", 0) or 0) for e in o.hook.trainers})


def kill_plan(spec: CommandSpec, reference: RunOutcome, checks: list[Check]) -> KillPlan | None:
    """Where to kill and compare, from the uninterrupted run's checkpoints (what is on disk, and the steps a Trainer
    saved: ``save_total_limit`` deletes the older folders), with its ``checkpoints`` check (or ``metrics``: a script
    without per-step metrics cannot be killed at a step) appended to ``checks``; None when the check cannot go on."""
    ckpts = reference.checkpoints
    # every rank saves at the same steps (a node without rank 0 has only its own ranks' words)
    saved = sorted({x.step for x in ckpts} | {int(e.get("step", 0)) for e in reference.hook.saves})
    need = spec.kill_after_checkpoint + 1
    if len(saved) < need or not ckpts:
        checks.append(Check("checkpoints", StageStatus.FAIL,
                            _too_few(spec, reference, saved, need), kind="completeness"))
        return None
    if reference.trainer is None and not reference.steps:
        checks.append(Check("metrics", StageStatus.FAIL,
                            f"the uninterrupted run wrote no per-step metrics "
                            f"({reference.metrics_source}{_rejected(reference)}): from outside, the "
                            "kill is placed by the step the metrics show and the resumed run is "
                            "compared with them step by step, so nothing was killed: have the "
                            "script write JSON lines with step and loss and name the file "
                            "(command.metrics), or train with transformers' Trainer"))
        return None
    c, n, final = saved[spec.kill_after_checkpoint - 1], saved[spec.kill_after_checkpoint], ckpts[-1].step
    k = c + max(1, (n - c) // 2)
    kept = "" if len(saved) == len(ckpts) else f" ({', '.join(x.name for x in ckpts)} kept: Trainer's " \
                                                "save_total_limit removed the others)"
    checks.append(Check("checkpoints", StageStatus.judged(final > c),
                        f"the uninterrupted run wrote {len(saved)} checkpoints (steps {span(saved)}){kept}: resume "
                        f"from step {c}, kill at step {k} (before the next, {n}), compare at step {final}"
                        + ("" if final > c else ": no checkpoint after c is left to compare with"),
                        kind="completeness"))
    return KillPlan(c, n, k, final) if final > c else None


def _twin_phase(runs: _Runs, tier: Tier, twins: list[RunOutcome] | None, progress: _Progress,
                ) -> Generator[Event, None, tuple[list[RunOutcome], bool]]:
    """0. The twins, where the tier measures the noise: the ones given, else the training command again, ``tier.twins``
    times. Returns (the twins, empty on an exact tier; False when one failed: no bound is measured)."""
    if tier.exact or (runs.resize is not None and runs.trainer is not None):  # the latter is refused at its checkpoint
        return [], True
    if twins is None:
        twins = yield from run_twins(runs.spec, runs.reference, runs.run_dir, runs.values, tier.twins, runs.cancelled,
                                     runs.backend, runs.resize, runs.nodes)
    for twin in twins:
        progress.runs[twin.name] = _summary(twin)
    failed = next((t for t in twins if t.exit_code != 0), None)
    if failed is None:
        return twins, True
    why = "timed out" if failed.timed_out else f"exit status {failed.exit_code}"
    progress.checks.append(Check("twin_run", StageStatus.FAIL,
                                 f"the {failed.name} run (the training command again) failed ({why}): "
                                 f"{failure_lines(failed.log_path)} (see {failed.log_path}); no noise "
                                 "bound could be measured"))
    return twins, False


def _interrupted_phase(runs: _Runs, plan: KillPlan, progress: _Progress,
                       ) -> Generator[Event, None, tuple[RunOutcome, Checkpoint | None]]:
    """1. The interrupted run, killed between checkpoint c and the next, with its ``kill`` and ``kill_point`` checks.
    Returns (the run, checkpoint c it left; None when the kill failed or left no checkpoint c)."""
    spec, trainer, world, k = runs.spec, runs.trainer, runs.world, plan.k
    out_i, argv_i = runs.interrupted_words()
    how = "held by the Trainer hook after step" if trainer else "killed when its metrics show step"
    yield Message("resume", text=f"interrupted run: {how} {k}, after checkpoint {plan.c} and before {plan.n}; "
                                 "SIGKILL to every process of it")

    def at_kill_point(o: RunOutcome) -> bool:
        if trainer:
            return len(o.hook.held) >= world
        return any(s.step >= k for s in o.steps_seen())

    interrupted = yield from run_command(spec, "interrupted", argv_i, out_i, runs.run_dir / "resume-interrupted",
                                         "resume", total=k, hold_at_step=k if trainer else None,
                                         kill_when=at_kill_point, cancelled=runs.cancelled, backend=runs.backend)
    progress.runs["interrupted"] = _summary(interrupted)
    if interrupted.kill is not None:
        seen = max((s.step for s in interrupted.steps_seen()), default=0)
        yield Message("resume", text=f"interrupted run killed at step {seen} ({interrupted.kill.evidence()})")
    kill, point, ckpt = _kill_checks(interrupted, trainer is not None, world, plan, progress.required)
    progress.checks += [kill, point]
    return interrupted, ckpt if kill.status == StageStatus.PASS else None


@dataclass(frozen=True)
class Resize:
    """A resume at another world size than the training's: the resume command's torchrun line starts ``nproc``
    processes per node, ``resumed`` in all, where the training line started ``trained``."""

    trained: int
    resumed: int
    nproc: int
    #: the resume line runs on another node count than the training's (the twin could not stand for it)
    nodes_changed: bool = False

    def tier(self, tier: Tier) -> Tier:
        """The tier of this resume in place of the device's ``tier`` (:func:`core.stages.noise.resized_tier`)."""
        return resized_tier(tier, self.trained, self.resumed)


def resize_of(spec: CommandSpec) -> Resize | None:
    """The resume's change of world size, from the two torchrun lines (None: the same, or a line gpuaccept cannot
    read: no torchrun, or a count only the node knows)."""
    trained, resumed = launcher_world(spec.words()), launcher_world(spec.resume_words())
    nproc = launcher_nproc(spec.resume_words())
    if trained is None or resumed is None or nproc is None or trained == resumed:
        return None
    return Resize(trained, resumed, nproc, launcher_nnodes(spec.words()) != launcher_nnodes(spec.resume_words()))


def dcp_world_check(ckpt: Path, resize: Resize) -> Check:
    """``world_size`` of a script's checkpoint resumed at another world size: allowed for a torch.distributed.checkpoint
    (DCP) checkpoint, whose ``.metadata`` maps every tensor's shards and which DCP reshards on load (its
    ``load_planner``); refused by name for any other, whose files say nothing of how they would reshard."""
    shards = sorted(p.name for p in ckpt.glob("__*_*.distcp"))
    if is_dcp(ckpt):
        return Check("world_size", StageStatus.PASS,
                     f"{ckpt.name} is a torch.distributed.checkpoint (DCP) checkpoint ({len(shards)} shard file(s): "
                     f"{', '.join(shards[:8])}{', ...' if len(shards) > 8 else ''}), whose .metadata maps every "
                     f"tensor's shards: DCP reshards it on load; written at world size {resize.trained}, resumed at "
                     f"{resize.resumed}")
    return Check("world_size", StageStatus.FAIL,
                 f"refused: the resume command runs at world size {resize.resumed} and the training ran at "
                 f"{resize.trained}, and {ckpt.name} is not a torch.distributed.checkpoint (DCP) checkpoint (no "
                 ".metadata): nothing says how its files would reshard; resume at world size "
                 f"{resize.trained}, or save with torch.distributed.checkpoint, which reshards on load; the resume "
                 "was not started")


def _node_loss_phase(runs: _Runs, nodes: CommandNodes, plan: KillPlan, progress: _Progress,
                     ) -> Generator[Event, None, tuple[RunOutcome, Checkpoint | None]]:
    """1. across nodes: one node lost after step k (:mod:`core.command.nodeloss`), with this node's ``kill`` and
    ``kill_point`` checks. Returns (this node's run, the newest checkpoint complete on every node; None when the loss
    went wrong here or no checkpoint is complete on every node).

    Raises:
        StageError: another node stopped, or the lost node never said it was killed."""
    spec, k, ranks = runs.spec, plan.k, runs.ranks
    out_i, argv_i = runs.interrupted_words()
    nodes.together("interrupted")
    if nodes.is_lost:
        yield Message("resume", text=f"interrupted run: this node is the one lost: its command is held by the Trainer "
                                     f"hook after step {k}, after checkpoint {plan.c} and before {plan.n}, then SIGKILL "
                                     "to every process of it")
        stopped = nodes.stopped_reader()
        interrupted = yield from run_command(spec, "interrupted", argv_i, out_i, runs.run_dir / "resume-interrupted",
                                             "resume", total=k, hold_at_step=k,
                                             kill_when=lambda o: bool(stopped()) or len(o.hook.held) >= len(ranks),
                                             cancelled=runs.cancelled, backend=runs.backend)
        progress.runs["interrupted"] = _summary(interrupted)
        others = nodes.cluster.stopped()
        if others:
            raise StageError(f"another node stopped, so this one stops too: {stopped_by(others)}")
        kill, point, ckpt = _kill_checks(interrupted, True, len(ranks), plan, progress.required)
        kill = replace(kill, evidence=f"node loss, this node: {kill.evidence}")
        point = replace(point, evidence=point.evidence.replace("every rank", "this node's every rank", 1))
        progress.checks += [kill, point]
        if kill.status != StageStatus.PASS or point.status != StageStatus.PASS:
            nodes.cluster.stop(f"the node the check loses was not killed at its kill point: {point.evidence}")
            progress.stopped_nodes = True
            return interrupted, None
        nodes.tell_lost(k, sorted(interrupted.hook.held))
        yield Message("resume", text=f"this node's command killed after step {k} ({interrupted.kill.evidence()})"
                                     if interrupted.kill is not None else "this node's command killed")
    else:
        yield Message("resume", text=f"interrupted run: {nodes.lost_name} is lost after step {k} (SIGKILL to every "
                                     "process of its command); this node's ranks run on until they fail waiting for "
                                     "it")
        interrupted = yield from run_command(spec, "interrupted", argv_i, out_i, runs.run_dir / "resume-interrupted",
                                             "resume", total=k, kill_when=nodes.survivor_kill(),
                                             cancelled=runs.cancelled, backend=runs.backend)
        progress.runs["interrupted"] = _summary(interrupted)
        word = nodes.wait_lost()
        killed = interrupted.kill is not None
        ok = interrupted.exit_code != 0 and (not killed or bool(interrupted.kill and interrupted.kill.clean))
        evidence = survived_evidence(word, interrupted.exit_code, killed, LOSS_GRACE_S, ranks)
        if interrupted.exit_code == 0:
            evidence += ": yet this node's command ended well, as if it did not need the lost node's ranks"
        progress.checks += [Check("kill", StageStatus.judged(ok), evidence),
                            Check("kill_point", StageStatus.PASS,
                                  f"{word.get('node')}: held after step {word.get('step')}: after checkpoint "
                                  f"{plan.c}, before {plan.n}")]
    ran = hook_ranks(interrupted)
    if ran and ran != ranks:
        progress.checks.append(Check("node_ranks", StageStatus.FAIL,
                                     f"this node ran ranks {ran} in the interrupted run and {ranks} in the "
                                     "uninterrupted one: torchrun's rendezvous numbered the nodes otherwise, so its "
                                     "checkpoints hold other ranks' RNG states and data shards than the run it is "
                                     "compared with; give every node a fixed node rank (torchrun's static rendezvous, "
                                     "--node-rank) to check it"))
    return interrupted, _agreed_checkpoint(nodes, interrupted, plan, progress)


def _agreed_checkpoint(nodes: CommandNodes, o: RunOutcome, plan: KillPlan, progress: _Progress) -> Checkpoint | None:
    """The newest checkpoint complete on every node (this node's own files: its ranks' RNG states), which every node
    resumes from; None, with a failed ``checkpoint_selection`` check, when it is not checkpoint c."""
    newest = [x for x in o.checkpoints if complete(x, progress.required)]
    agreed, others = nodes.agree(newest[-1].step if newest else None)
    if agreed == plan.c:
        return next((x for x in o.checkpoints if x.step == agreed), None)
    mine = newest[-1].name if newest else "none"
    progress.checks.append(Check("checkpoint_selection", StageStatus.FAIL,
                                 f"the newest checkpoint complete on every node is "
                                 f"{f'checkpoint-{agreed}' if agreed is not None else 'none'}, not checkpoint-{plan.c} "
                                 f"(this node's: {mine}; {'; '.join(others) or 'every node the same'})"
                                 + ("" if newest else f"; missing here: {_missing_text(o, plan, progress.required)}"),
                                 kind="completeness"))
    return None


def _missing_text(o: RunOutcome, plan: KillPlan, required: list[str]) -> str:
    ckpt = next((x for x in o.checkpoints if x.step == plan.c), None)
    if ckpt is None:
        return f"checkpoint-{plan.c} itself"
    return (f"{', '.join(missing_files(ckpt.path, required))} from {ckpt.name} (a node resumes from its own disk: "
            "the job must save a whole checkpoint on each node, Trainer's save_on_each_node)")


def _every_node_resumable(nodes: CommandNodes, resumable: bool, progress: _Progress) -> bool:
    """Whether every node may restart: this node's word and the others' (:meth:`NodeLoss.resumable`); a
    ``nodes_resumable`` check fails naming the nodes that may not."""
    failed = [ch.name for ch in progress.checks if ch.status == StageStatus.FAIL]
    others = nodes.resumable(resumable, f"its checkpoint failed {', '.join(failed)}" if failed else "it may not resume")
    if others:
        progress.checks.append(Check("nodes_resumable", StageStatus.FAIL,
                                     f"not every node may resume, so none restarts: {'; '.join(others)}"))
    return resumable and not others


def _gate(runs: _Runs, interrupted: RunOutcome, ckpt: Checkpoint, plan: KillPlan, progress: _Progress) -> bool:
    """2. The checkpoint the kill left, before anything loads it: its manifest and checks. True when it may be
    resumed: a checkpoint that cannot be loaded safely, or at another world size, never is; an incomplete one is (the
    user's resume is what is accepted: what it does without the missing part is evidence too)."""
    progress.manifest = write_manifest(ckpt.path, runs.run_dir / "resume-interrupted" / f"manifest-{ckpt.name}.json")
    gate = _checkpoint_checks(interrupted, ckpt, plan.c, progress.required, progress.manifest, runs.trainer,
                              runs.resize.resumed if runs.resize is not None else runs.world,
                              runs.ranks if runs.nodes is not None else None)
    if runs.resize is not None and runs.trainer is None:
        gate.append(dcp_world_check(ckpt.path, runs.resize))
    progress.checks += gate
    return all(ch.status == StageStatus.PASS for ch in gate if ch.name in LOADING_GUARDS)


def _resumed_phase(runs: _Runs, ckpt: Checkpoint, plan: KillPlan, progress: _Progress,
                   ) -> Generator[Event, None, RunOutcome | None]:
    """3. The resumed run, from checkpoint c to its end, and the manifest checked again after it. Returns the run, or
    None when it failed (``resumed_run``)."""
    out_r = runs.run_dir / "resume-resumed" / "out"
    argv_r = run_words(runs.spec, runs.spec.resume_words(), {**runs.values, "{checkpoint}": str(ckpt.path)}, out_r)
    last = runs.reference.last_step() or plan.final
    if runs.nodes is not None:
        runs.nodes.together("resumed")
    yield Message("resume", text=f"resumed run from {ckpt.name} to its end (step {last}), compared with the "
                                 "uninterrupted run" + (" (every node restarts its command together)"
                                                        if runs.nodes is not None else ""))
    resumed = yield from run_command(runs.spec, "resumed", argv_r, out_r, runs.run_dir / "resume-resumed", "resume",
                                     total=last, cancelled=runs.cancelled, backend=runs.backend)
    progress.runs["resumed"] = _summary(resumed)
    manifest = progress.manifest
    bad = verify_manifest(ckpt.path, manifest)
    progress.checks.append(Check("manifest_after", StageStatus.judged(not bad),
                                 f"after the resumed run, the checkpoint's files changed: {', '.join(bad)}" if bad else
                                 f"after the resumed run, the sha256 of the {len(manifest)} files still match"))
    if resumed.exit_code == 0:
        return resumed
    why = "timed out" if resumed.timed_out else f"exit status {resumed.exit_code}"
    progress.checks.append(Check("resumed_run", StageStatus.FAIL,
                                 f"the resume command failed ({why}): "
                                 f"{failure_lines(resumed.log_path)} (see {resumed.log_path})"))
    return None


def _compare(runs: _Runs, interrupted: RunOutcome, resumed: RunOutcome, twins: list[RunOutcome], plan: KillPlan,
             progress: _Progress) -> None:
    """4. Compared with the reference: step by step (:func:`compare_steps`), the trainable set (Trainer), the last
    checkpoint file by file (:func:`compare_final`)."""
    reference, trainer, tier = runs.reference, runs.trainer, progress.tier
    kin = Family.of(len(twins), with_reference=True, resized=runs.resize is not None) if twins else None
    step_checks, progress.comparison = compare_steps(reference.steps, interrupted.steps, resumed.steps, plan.c, tier,
                                                     progress.not_compared, resumed.trainer,
                                                     [t.steps for t in twins], kin)
    progress.checks += step_checks
    if trainer:
        progress.checks.append(trainable_check(trainer, resumed.trainer))
    progress.checks += compare_final(reference, resumed, plan.final, tier, progress.not_compared, trainer is not None,
                                     twins, kin, scratch=runs.run_dir / "resume-resumed" / "dcp-as-torch-save")
    progress.findings = [f"{o.name} run: {p}" for o in (*twins, interrupted, resumed) for p in o.problems]
    progress.twin_final = min((t.last_step() or 0 for t in twins), default=None) if twins else None


def _too_few(spec: CommandSpec, reference: RunOutcome, saved: list[int], need: int) -> str:
    """Why there are too few checkpoints, with what the output folder does hold (a glob that matches nothing)."""
    found = ", ".join(c.name for c in reference.checkpoints) or "none"
    there = sorted(p.name + ("/" if p.is_dir() else "") for p in reference.out_dir.iterdir()) \
        if reference.out_dir.is_dir() else []
    what = (f"; its output folder holds {', '.join(there[:8])}{' ...' if len(there) > 8 else ''}: if those are its "
            "checkpoints, give their glob as command.checkpoints" if there and not reference.checkpoints else "")
    fix = "save more often or train longer" + (", or lower command.kill_after_checkpoint"
                                               if spec.kill_after_checkpoint > 1 else "")
    return (f"the uninterrupted run wrote {len(saved)} checkpoint(s) matching {spec.checkpoints} ({found}){what}; the "
            f"check kills after checkpoint {spec.kill_after_checkpoint} and compares at a later one, so it needs at "
            f"least {need}: {fix}")


def _rejected(o: RunOutcome) -> str:
    """``; N lines read, every one refused: ...`` when the metrics file had lines and none was a step."""
    metrics = o.metrics
    if metrics is None or not metrics.problems:
        return ""
    return (f"; {metrics.lines} line(s) read, none a step: " + "; ".join(metrics.problems[:3])
            + (" ..." if len(metrics.problems) > 3 else ""))


def _summary(o: RunOutcome) -> RunSummary:
    killed = o.kill.evidence() if o.kill is not None else ""
    return RunSummary(o.argv, o.exit_code, killed, o.seconds, str(o.log_path), str(o.out_dir))


def complete(ckpt: Checkpoint, required: list[str]) -> bool:
    return bool(required) and not missing_files(ckpt.path, required)


def _kill_checks(o: RunOutcome, trainer: bool, world: int, plan: KillPlan, required: list[str]
                 ) -> tuple[Check, Check, Checkpoint | None]:
    """``kill``: the run was killed (it had not ended) and no process of it is left; ``kill_point``: where it was
    killed is after checkpoint c and before checkpoint n was complete. Returns them and checkpoint c, if there."""
    if o.kill is None:
        why = "timed out" if o.timed_out else f"exited with status {o.exit_code}{o.exit_note}"
        return (Check("kill", StageStatus.FAIL,
                      f"the interrupted run {why} before step {plan.k} ({last_lines(o.log_path, 3)}); "
                      "nothing was killed"),
                Check("kill_point", StageStatus.FAIL, "no kill"), None)
    kill = Check("kill", StageStatus.judged(o.kill.clean), o.kill.evidence())
    ckpt = next((x for x in o.checkpoints if x.step == plan.c), None)
    where, ok = _held_at(o, world, plan.k) if trainer else _seen_at(o, plan.k)
    later = [x for x in o.at_kill if x.step > plan.c and (complete(x, required) if required else True)]
    if later:
        ok = False
        where += f"; but {', '.join(x.name for x in later)} was already complete at the kill (the kill came after the " \
                 "next checkpoint: from outside a script is killed when its metrics show the step, and this one " \
                 "saved within that time; save less often than every step)"
    if ckpt is None:
        ok = False
        where += f"; no checkpoint of step {plan.c} in its output folder"
    return kill, Check("kill_point", StageStatus.judged(ok), f"{where}: after checkpoint {plan.c}, before {plan.n}"), \
        ckpt


def _held_at(o: RunOutcome, world: int, k: int) -> tuple[str, bool]:
    """Where a Trainer-based run was held (every rank after step ``k``), in words, and whether that is the kill
    point."""
    ranks = sorted(o.hook.held)
    where = f"every rank ({', '.join(map(str, ranks))}) held after step {k}" if len(ranks) == world else \
        f"held on ranks {ranks} of {world}"
    return where, len(ranks) == world and all(int(e.get("step", 0)) == k for e in o.hook.held.values())


def _seen_at(o: RunOutcome, k: int) -> tuple[str, bool]:
    """Where another script was killed (the last step its metrics showed), in words, and whether it reached ``k``."""
    seen = max((s.step for s in o.steps_seen()), default=0)
    return f"killed when its metrics showed step {seen}", seen >= k


def _checkpoint_checks(o: RunOutcome, ckpt: Checkpoint, c: int, required: list[str], manifest: dict[str, str],
                       trainer: dict[str, Any] | None, world: int, ranks: list[int] | None = None) -> list[Check]:
    """The checks of checkpoint c before anything loads it: ``checkpoint_selection``, ``checkpoint_complete``,
    ``manifest``, ``safe_loading``, and for a Trainer ``trainer_state`` and ``world_size`` (``ranks``, several
    nodes: this node's, whose RNG states its checkpoint holds)."""
    checks = [_selection_check(o, c, required), _complete_check(ckpt, required),
              Check("manifest", StageStatus.judged(bool(manifest)),
                    f"sha256 of {len(manifest)} files taken right after the kill" if manifest else
                    f"{ckpt.name} holds no file"),
              safe_loading(ckpt.path, trainer is not None)]
    if trainer is not None:
        checks += [_trainer_state_check(ckpt, c), world_size_check(ckpt.path, world, ranks)]
    return checks


def _selection_check(o: RunOutcome, c: int, required: list[str]) -> Check:
    """``checkpoint_selection``: the newest complete checkpoint the interrupted run left is c; newer partial ones (and
    folders that are not checkpoints) are named."""
    listed, skipped = o.checkpoints, o.skipped_checkpoints
    newest = [x for x in listed if complete(x, required)] if required else listed
    partial = [f"{x.name} is partial (missing {', '.join(missing_files(x.path, required))})"
               for x in listed if required and x.step > c and not complete(x, required)]
    top = newest[-1] if newest else None
    return Check("checkpoint_selection", StageStatus.judged(top is not None and top.step == c),
                 (f"resume from {top.name}, the newest complete checkpoint" if top else "no complete checkpoint")
                 + (f" (expected step {c})" if top is None or top.step != c else "")
                 + ("; skipped " + "; ".join(partial + skipped) if partial or skipped else ""),
                 kind="completeness")


def _complete_check(ckpt: Checkpoint, required: list[str]) -> Check:
    """``checkpoint_complete``: checkpoint c holds every required file; a script that is not Trainer-based and names
    none fails (gpuaccept cannot know what it needs)."""
    if not required:
        return Check("checkpoint_complete", StageStatus.FAIL,
                     "the script is not Trainer-based, so gpuaccept does not know what "
                     "its checkpoint must hold: list the files in "
                     "command.checkpoint_files (weights, optimizer, scheduler, RNG, "
                     "progress)", kind="completeness")
    missing = missing_files(ckpt.path, required)
    return Check("checkpoint_complete", StageStatus.judged(not missing),
                 f"missing from {ckpt.name}: {', '.join(missing)}" if missing else
                 f"{ckpt.name} holds {', '.join(required)}", kind="completeness")


def _trainer_state_check(ckpt: Checkpoint, c: int) -> Check:
    """``trainer_state``: Trainer's ``trainer_state.json`` of checkpoint c says global step c."""
    import json

    try:
        state = json.loads((ckpt.path / "trainer_state.json").read_text(encoding="utf-8")).get("global_step")
    except (OSError, ValueError):
        state = None
    return Check("trainer_state", StageStatus.judged(state == c),
                 f"trainer_state.json global_step = {state} (expected {c})")


def safe_loading(ckpt: Path, trainer: bool) -> Check:
    """Every pickle of the checkpoint that a resume loads loads with ``torch.load`` with ``weights_only=True``
    (:func:`core.stages.resume.pickles_load_safely`, the recipe's check too): for Trainer the optimizer, scheduler,
    RNG states and GradScaler (it never loads ``training_args.bin``); for another script every file with a pickle's
    suffix (:data:`PICKLES`), since gpuaccept cannot know which ones it loads."""
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.suffix in PICKLES)
    if trainer:
        files = [p for p in files if p.name not in TRAINER_UNLOADED]
    unloaded = trainer and (ckpt / "training_args.bin").is_file()
    return pickles_load_safely(ckpt, files, " (training_args.bin, a pickle of TrainingArguments Trainer never loads "
                                            "on resume, not loaded)" if unloaded else "")


# ------------------------------------------------------------------------------------------- the step comparison
class CommandWords(StepWords):
    """The step checks' evidence in command mode's words."""

    no_reference = ("the uninterrupted run wrote no per-step metrics (none found: command.metrics), so nothing shows "
                    "the resumed run continues as it did; write JSON lines with step and loss, or train with "
                    "transformers' Trainer")

    def global_steps(self, got: list[Key], want: list[Key], series: ResumeSeries) -> str:
        start = f"; the resumed Trainer began at global step {series.trainer_start}" if series.resumed_trainer else ""
        return (f"resumed steps {span(sorted({s for _, s in got}))}, expected {span(sorted({s for _, s in want}))} "
                f"(every step the uninterrupted run logged after {series.c}, {len({r for r, _ in want})} rank(s))"
                f"{start}")

    def reproducible(self, steps: list[int], exact: list[int], bad: list[int], judged: Bounded, tier: Tier) -> str:
        if exact or bad:
            return (f"before any kill, the interrupted run differs from the uninterrupted one at steps "
                    f"{span(sorted(set(bad) | set(exact)))} ({judged.describe(tier, 'losses', tier.loss_multiple)}): the command does "
                    "not give the same run twice, so no resume can be shown to continue it; seed everything it draws "
                    "(e.g. transformers.set_seed before building the model and its adapters) or make it "
                    "deterministic")
        return (f"before the kill, the interrupted run equals the uninterrupted one at steps {span(steps)} (learning "
                f"rate and samples exactly; {judged.describe(tier, 'losses', tier.loss_multiple)})")

    def field_equal(self, label: str, compared: int, steps: list[int]) -> str:
        return f"{label} of the resumed run equal at {compared} step(s)"

    def field_absent(self, label: str, name: str) -> str:
        return f"{label}: the metrics hold none" + (
            " (sample ids: a metrics line's sample_ids, or the Trainer hook's batch digests)" if name == "sample_ids"
            else "")

    def loss(self, bad: list[int], unmatched: list[int], judged: Bounded | None, tier: Tier) -> str:
        return ((f"resumed loss outside the bound at steps {span(bad)}; " if bad else "")
                + (f"other ranks than the reference's at steps {span(unmatched)}; " if unmatched else "")
                + (judged.describe(tier, "resumed losses (every rank)", tier.loss_multiple) if judged is not None else
                   "the resumed run logged no step the uninterrupted run logged"))


#: command mode's rules: a user's metrics hold a step and its loss, maybe its learning rate and sample ids (no epoch)
COMMAND_RULES = StepRules(("learning_rate", "sample_ids"), complete=False, words=CommandWords())


def step_series(steps: list[StepRecord]) -> StepSeries:
    """A run's per-step metrics (one record per step and rank) as a typed series."""
    return StepSeries.of(StepPoint(step=s.step, loss=s.loss, rank=s.rank, learning_rate=s.learning_rate,
                                   sample_ids=None if s.sample_ids is None else tuple(s.sample_ids)) for s in steps)


def command_series(ref_steps: list[StepRecord], interrupted: list[StepRecord], resumed: list[StepRecord], c: int,
                   resumed_trainer: dict[str, Any] | None = None, twin_steps: Sequence[list[StepRecord]] = (),
                   family: Family | None = None) -> ResumeSeries:
    """The runs of command mode as series: the resumed run expected at every (rank, step) the uninterrupted run logged
    after c; a resumed Trainer must begin at global step c."""
    reference = step_series(ref_steps)
    return ResumeSeries(reference=reference, interrupted=step_series(interrupted), resumed=step_series(resumed), c=c,
                        expected=tuple(sorted(key for key in reference.by_key() if key[1] > c)),
                        twins=tuple(step_series(t) for t in twin_steps), family=family,
                        resumed_trainer=resumed_trainer is not None,
                        trainer_start=resumed_trainer.get("global_step") if resumed_trainer is not None else None)


def compare_steps(ref_steps: list[StepRecord], interrupted: list[StepRecord], resumed: list[StepRecord], c: int,
                  tier: Tier, not_compared: list[str], resumed_trainer: dict[str, Any] | None = None,
                  twin_steps: Sequence[list[StepRecord]] = (), family: Family | None = None,
                  ) -> tuple[list[Check], list[dict[str, Any]]]:
    """The step-by-step checks (:func:`core.stages.compare.compare_series` under :data:`COMMAND_RULES`):
    ``global_steps`` (the resumed run logged exactly the reference's steps after c, on every rank; a resumed Trainer
    started at global step c), ``reproducible`` (before its kill the interrupted run equals the reference: the
    command gives the same run twice), then for the resumed run ``learning_rate`` and ``sample_ids`` (exact, where
    the metrics hold them; else named in ``not_compared``) and ``loss`` (every step and rank within the bound:
    bit-exact, or the norm of the differences within ``loss_multiple`` x the noise of the twins' ``family``,
    :func:`core.stages.noise.pooled_losses`).

    Returns:
        (the checks, one row per resumed step of rank 0: step, learning_rate, loss_reference, loss_resumed,
        difference, and loss_twin with a twin)."""
    found = compare_series(command_series(ref_steps, interrupted, resumed, c, resumed_trainer, twin_steps, family),
                           tier, COMMAND_RULES)
    not_compared += found.not_compared
    return found.checks, found.rows


def trainable_check(reference: dict[str, Any], resumed: dict[str, Any] | None) -> Check:
    """The resumed Trainer trains exactly the reference's tensors (the sha256 of their sorted names, and their
    parameters; exact)."""
    if resumed is None:
        return Check("trainable_set", StageStatus.FAIL, "the resumed run reported no Trainer")
    same = (reference.get("trainable_names_sha256"), reference.get("trainable_parameters")) == \
        (resumed.get("trainable_names_sha256"), resumed.get("trainable_parameters"))
    return Check("trainable_set", StageStatus.judged(same),
                 f"{resumed.get('trainable_tensors')} trainable tensors, {resumed.get('trainable_parameters'):,} "
                 f"parameters" + (", as in the uninterrupted run" if same else
                                  f"; the uninterrupted run trained {reference.get('trainable_tensors')} / "
                                  f"{reference.get('trainable_parameters'):,}"))


def compare_final(reference: RunOutcome, resumed: RunOutcome, step: int, tier: Tier, not_compared: list[str],
                  trainer: bool = False, twins: Sequence[RunOutcome] = (), kin: Family | None = None,
                  scratch: Path | None = None) -> list[Check]:
    """At the reference's last checkpoint (step ``step``), the resumed run's checkpoint of the same step, file by
    file: every ``.safetensors`` file's tensors (``final_weights``, bound), every optimizer file (progress exact,
    moments bound: :func:`core.stages.resume.compare_optimizers`), every other pickle (RNG, scheduler, progress; exact)
    and, for a script that is not Trainer-based, every JSON file (numbers within the bound, the rest exact) as
    ``states``. The bounds are the tier's (:mod:`core.stages.noise`): bit-exact, or from the spread of the noise
    family ``kin`` (the reference and the ``twins``) at their checkpoints of the same step. A Trainer checkpoint's JSON files are its configs (peft writes ``target_modules`` from a set, in no
    fixed order) and its trainer state (timings, paths; its steps are compared above); they and other files (text)
    are listed in ``not_compared``. A torch.distributed.checkpoint (DCP) folder, whose shards follow the world size
    that wrote it, is compared as its whole state (:func:`dcp_as_files`, written under ``scratch``)."""
    found = _final_folders(reference, resumed, step, tier, twins)
    if isinstance(found, Check):
        return [found]
    if scratch is not None and is_dcp(found[0].path):
        found = dcp_as_files(found, scratch)
    a, b, twin_folders = found
    fam = Noisy([a.path if m == "reference" else twin_folders[int(m.rsplit("-", 1)[1]) - 1] for m in kin.members],
                kin) if kin is not None and twin_folders else None
    return compare_final_files(a, b, fam, tier, not_compared, trainer)


@dataclass(frozen=True)
class Noisy:
    """The noise family's folders (``folders``, in the order of ``kin.members``: the reference's among them where it
    is one), what a tolerance check of the last checkpoint is bounded by."""

    folders: list[Path]
    kin: Family

    def files(self, name: str) -> list[Path]:
        return [f / name for f in self.folders]


def compare_final_files(a: Checkpoint, b: Checkpoint, fam: Noisy | None, tier: Tier, not_compared: list[str],
                        trainer: bool = False) -> list[Check]:
    """:func:`compare_final` on the folders: ``a`` the reference's checkpoint, ``b`` the resumed run's of the same
    step, ``fam`` the noise family's folders (None on an exact tier)."""
    names = sorted(str(p.relative_to(a.path)) for p in a.path.rglob("*") if p.is_file())
    missing = [n for n in names if not (b.path / n).is_file() or
               (fam is not None and not all(f.is_file() for f in fam.files(n)))]
    checks = [Check("final_checkpoint", StageStatus.judged(not missing),
                    f"{b.name} of the resumed (or twin) run lacks {', '.join(missing)}" if missing else
                    f"{b.name} of both runs holds the same {len(names)} files")]
    files = FinalFiles.sort([n for n in names if n not in missing], trainer)
    if files.weights:
        checks.append(_compare_safetensors(a.path, b.path, files.weights, tier, fam))
    for n in files.optimizers:
        checks += [_named(ch, n) for ch in compare_optimizers(a.path / n, b.path / n, tier,
                                                               fam.files(n) if fam is not None else None,
                                                               fam.kin if fam is not None else None)]
    if files.other:
        not_compared.append(f"in {b.name}: {', '.join(files.other)} (not a tensor or JSON state: text, Trainer's own "
                            "state with its timings and paths, or its pickled TrainingArguments; the steps are "
                            "compared step by step above)")
    pickles = [n for n in files.states if not n.endswith(".json")]
    parts = _pickled_parts(a.path, b.path, pickles, fam)
    if isinstance(parts, Check):
        return [*checks, parts]
    for key, (ref_state, res_state, family_states) in parts.optimizers.items():
        checks += [_named(ch, key) for ch in compare_optimizer_states(
            res_state, ref_state, tier, family_states, fam.kin if fam is not None else None)]
    if not files.optimizers and not parts.optimizers:
        not_compared.append(f"the optimizer's state: {a.name} of the uninterrupted run holds no optimizer file (no "
                            "*optim*.pt) and no pickle holds an optimizer's state_dict, so its moments and step "
                            "counts were not compared")
    if parts.weights[0]:
        checks.append(_judged_weights("pickled_weights" if files.weights else "final_weights", parts.weights, tier,
                                      fam.kin if fam is not None else None))
    elif not files.weights:
        not_compared.append(f"weights as tensors: {a.name} holds no .safetensors file and no pickle holds a state "
                            "dict of floating-point tensors")
    states = [n for n in files.states if n.endswith(".json")]
    if states or parts.rest[0]:
        checks.append(_compare_states(a.path, b.path, states, tier, fam, parts.rest))
    return checks


def is_dcp(folder: Path) -> bool:
    """The folder is a torch.distributed.checkpoint (DCP) checkpoint: its ``.metadata`` is there (the coordinator
    writes it last, after every rank's shards)."""
    return (folder / ".metadata").is_file()


def dcp_as_files(found: tuple[Checkpoint, Checkpoint, list[Path]], scratch: Path
                 ) -> tuple[Checkpoint, Checkpoint, list[Path]]:
    """The reference's, the resumed run's and the twins' DCP checkpoints each as one whole ``state.pt``
    (``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``: every tensor gathered from its shards, whatever
    the world size that wrote them) beside the folder's other files (its JSON state), in ``scratch/<run>/<name>``:
    the folders :func:`compare_final_files` compares."""
    import shutil

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    def whole(path: Path, run: str) -> Path:
        folder = scratch / run / path.name
        folder.mkdir(parents=True, exist_ok=True)
        dcp_to_torch_save(path, folder / "state.pt")
        for f in path.iterdir():
            if f.is_file() and f.name != ".metadata" and f.suffix != ".distcp":
                shutil.copy2(f, folder / f.name)
        return folder

    a, b, twins = found
    return (Checkpoint(a.step, whole(a.path, "uninterrupted")), Checkpoint(b.step, whole(b.path, "resumed")),
            [whole(t, f"twin-{i}") for i, t in enumerate(twins, 1)])


def _named(ch: Check, where: str) -> Check:
    """``ch`` with its evidence prefixed by the file (or the pickle's entry) it is about."""
    return dataclasses.replace(ch, evidence=f"{where}: {ch.evidence}")


#: the reference's, the resumed run's and the noise family's (None on an exact tier) of one thing compared
Triple = tuple[Any, Any, Any]


@dataclass
class PickledParts:
    """The pickles of the last checkpoint other than the ``*optim*`` files, taken apart by how each entry is compared
    (a pickle often holds everything: LitGPT's ``lit_model.pth`` is ``{"model", "optimizer", "scheduler", "iter_num",
    "step_count"}``, as many hand-written loops' ``{"model": ..., "optimizer": ...}``):

    - ``weights``: every floating-point tensor of a state dict (a dict of tensors, at the top or one entry down), keyed
      ``file:name`` or ``file[entry]:name``: judged as the weights are, within the tier's bound;
    - ``optimizers``: each ``Optimizer.state_dict()`` (``file`` or ``file[entry]``): its moments within the bound, its
      step counts exactly;
    - ``rest``: everything else (a scheduler's counters, RNG states, the step): equal exactly.
    Each of ``weights`` and ``rest`` holds the reference's and the resumed run's mappings and the noise family's (a
    list, in the order of its members; None on an exact tier).
    """

    weights: tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]] | None]
    optimizers: dict[str, Triple]
    rest: tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]] | None]


def _is_state_dict(obj: Any) -> bool:
    import torch

    return isinstance(obj, dict) and bool(obj) and all(
        isinstance(v, torch.Tensor) and v.is_floating_point() for v in obj.values())


def _entries(name: str, obj: Any) -> list[tuple[str, Any]]:
    """A loaded pickle's top-level entries, each keyed by where it is (``file`` when the pickle is one thing)."""
    if isinstance(obj, dict) and not _is_state_dict(obj) and not is_optimizer_state(obj):
        return [(f"{name}[{k}]", v) for k, v in obj.items()]
    return [(name, obj)]


def _pickled_parts(a: Path, b: Path, names: list[str], fam: Noisy | None) -> PickledParts | Check:
    """The pickles ``names`` of the reference's ``a``, the resumed run's ``b`` and the noise family's checkpoints taken
    apart (:class:`PickledParts`); the failed ``states`` check when one cannot be loaded safely."""
    width = len(fam.folders) if fam is not None else 0
    parts = PickledParts(({}, {}, [{} for _ in range(width)] if fam else None), {},
                         ({}, {}, [{} for _ in range(width)] if fam else None))
    for n in names:
        try:
            loaded = [safe_load(d / n) for d in (a, b)]
            family = [safe_load(f) for f in fam.files(n)] if fam is not None else []
        except UntrustedCheckpoint as exc:
            return Check("states", StageStatus.FAIL, str(exc))
        except (OSError, ValueError, RuntimeError) as exc:
            return Check("states", StageStatus.FAIL, f"{n}: unreadable ({exc})")
        ref_e, res_e = dict(_entries(n, loaded[0])), dict(_entries(n, loaded[1]))
        fam_e = [dict(_entries(n, f)) for f in family]
        for key, ref in ref_e.items():
            res, kin = res_e.get(key), [e.get(key) for e in fam_e]
            if is_optimizer_state(ref) and is_optimizer_state(res):
                parts.optimizers[key] = (ref, res, kin if fam is not None else None)
            elif _is_state_dict(ref) and isinstance(res, dict) and _is_state_dict(res) and ref.keys() == res.keys():
                parts.weights[0].update({f"{key}:{k}": v for k, v in ref.items()})
                parts.weights[1].update({f"{key}:{k}": v for k, v in res.items()})
                for mapping, state in zip(parts.weights[2] or [], kin):
                    if isinstance(state, dict):
                        mapping.update({f"{key}:{k}": v for k, v in state.items()})
            else:
                parts.rest[0][key], parts.rest[1][key] = ref, res
                for mapping, value in zip(parts.rest[2] or [], kin):
                    mapping[key] = value
        for key in res_e.keys() - ref_e.keys():
            parts.rest[1][key] = res_e[key]
    return parts


def _judged_weights(name: str, weights: tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]] | None],
                    tier: Tier, kin: Family | None = None) -> Check:
    """The pickled weights of the resumed run against the reference's, within the tier's bound
    (:func:`core.stages.noise.judge_tensors`)."""
    ref, res, family = weights
    files = sorted({k.split(":")[0] for k in ref})
    try:
        judged = judge_tensors(ref, res, family, tier, kin)
    except ValueError as exc:
        return Check(name, StageStatus.FAIL, f"{', '.join(files)}: {exc}", kind="tolerance", tier=tier.name)
    return Check(name, StageStatus.judged(judged.ok), judged.describe(tier, f"tensors of {', '.join(files)}"),
                 kind="tolerance", tier=tier.name, largest_difference=judged.distance, noise=judged.noise,
                 bound=judged.bound, evidence_rows=judged.evidence)


def _final_folders(reference: RunOutcome, resumed: RunOutcome, step: int, tier: Tier, twins: Sequence[RunOutcome],
                   ) -> tuple[Checkpoint, Checkpoint, list[Path]] | Check:
    """The checkpoints of ``step`` of the reference, the resumed run and (where the tier measures noise) the twins'
    folders; or the failed ``final_checkpoint`` check naming the run that wrote none."""
    a = next((x for x in reference.checkpoints if x.step == step), None)
    b = next((x for x in resumed.checkpoints if x.step == step), None)
    if a is None or b is None:
        have = ", ".join(x.name for x in resumed.checkpoints) or "none"
        return Check("final_checkpoint", StageStatus.FAIL,
                     f"the resumed run wrote no checkpoint of step {step} to compare with "
                     f"the uninterrupted run's (it wrote {have})")
    if tier.exact:
        return a, b, []
    folders = []
    for twin in twins:
        t = next((x for x in twin.checkpoints if x.step == step), None)
        if t is None:
            have = ", ".join(x.name for x in twin.checkpoints) or "none"
            return Check("final_checkpoint", StageStatus.FAIL,
                         f"the {twin.name} run wrote no checkpoint of step {step} to measure the "
                         f"noise with (it wrote {have})")
        folders.append(t.path)
    return a, b, folders


@dataclass(frozen=True)
class FinalFiles:
    """The files of the last checkpoint by how they are compared: ``weights`` (.safetensors, by tensor), ``optimizers``
    (:func:`core.stages.resume.compare_optimizers`), ``states`` (other pickles; a script's JSON files: exact, JSON
    numbers within the bound) and ``other`` (not compared)."""

    weights: list[str]
    optimizers: list[str]
    states: list[str]
    other: list[str]

    @classmethod
    def sort(cls, names: list[str], trainer: bool) -> FinalFiles:
        """``names`` (the files both runs hold) sorted; a Trainer checkpoint's JSON files (configs, trainer state)
        and the pickles Trainer never loads are ``other``."""
        files = cls([], [], [], [])
        for n in names:
            if n.endswith(".safetensors"):
                files.weights.append(n)
            elif n.endswith(".json") and not trainer:
                files.states.append(n)
            elif Path(n).suffix in PICKLES and Path(n).name not in TRAINER_UNLOADED:
                (files.optimizers if "optim" in Path(n).name else files.states).append(n)
            else:
                files.other.append(n)
        return files


def _compare_safetensors(a: Path, b: Path, names: list[str], tier: Tier, fam: Noisy | None = None) -> Check:
    """``final_weights``: every tensor of the ``.safetensors`` files ``names`` of the resumed run's checkpoint ``b``
    against the reference's ``a``, bounded by the noise family's ``fam`` (:func:`core.stages.noise.judge_tensors`)."""
    from safetensors.torch import load_file

    ref: dict[str, Any] = {}
    res: dict[str, Any] = {}
    family: list[dict[str, Any]] | None = [{} for _ in fam.folders] if fam is not None else None
    for n in names:
        ref.update({f"{n}:{k}": v for k, v in load_file(str(a / n)).items()})
        res.update({f"{n}:{k}": v for k, v in load_file(str(b / n)).items()})
        for mapping, f in zip(family or [], fam.files(n) if fam is not None else []):
            mapping.update({f"{n}:{k}": v for k, v in load_file(str(f)).items()})
    try:
        judged = judge_tensors(ref, res, family, tier, fam.kin if fam is not None else None)
    except ValueError as exc:
        return Check("final_weights", StageStatus.FAIL, f"{', '.join(names)}: {exc}", kind="tolerance", tier=tier.name)
    members = [(m, f) for m, f in zip(fam.kin.members, fam.folders) if m != "reference"] if fam is not None else []
    files = [row for n in names for row in file_rows(
        [("reference", a / n), ("resumed", b / n), *((m, f / n) for m, f in members)], "safetensors", f"{n}:")]
    return Check("final_weights", StageStatus.judged(judged.ok),
                 judged.describe(tier, f"tensors of {', '.join(names)}"), kind="tolerance", tier=tier.name,
                 largest_difference=judged.distance, noise=judged.noise, bound=judged.bound,
                 evidence_rows={**(judged.evidence or {}), "files": files})


def _compare_states(a: Path, b: Path, names: list[str], tier: Tier, fam: Noisy | None = None,
                    rest: tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]] | None] | None = None) -> Check:
    """``states``: the script's JSON files ``names`` equal, their numbers within the bound (:func:`first_difference`:
    bit-exact, or ``multiple`` x the noise family's spread at the same place); and ``rest``, the
    pickles' entries that are neither weights nor an optimizer's state (RNG, scheduler, progress:
    :class:`PickledParts`), equal exactly."""
    import json

    differ = []
    for n in names:
        try:
            x, y = (json.loads((d / n).read_text(encoding="utf-8")) for d in (b, a))
            z = [json.loads(f.read_text(encoding="utf-8")) for f in fam.files(n)] if fam is not None else None
        except (OSError, ValueError) as exc:
            differ.append(f"{n}: unreadable ({exc})")
            continue
        where = first_difference(x, y, family=z, multiple=tier.multiple, pairs=fam.kin.pairs if fam else ())
        if where is not None:
            differ.append(f"{n} differs at {where or 'the top'}")
    ref, res, _ = rest if rest is not None else ({}, {}, None)
    for key in sorted(ref.keys() | res.keys()):
        if key not in ref or key not in res:
            differ.append(f"{key} is in {'the resumed' if key in res else 'the uninterrupted'} run's checkpoint only")
            continue
        where = first_difference(res[key], ref[key])
        if where is not None:
            differ.append(f"{key} differs at {where or 'the top'}")
    compared = names + sorted({k.split("[")[0] for k in ref})
    return Check("states", StageStatus.judged(not differ),
                 "; ".join(differ) if differ else f"{', '.join(compared)} equal"
                 + (" (exact)" if tier.exact else f" (pickled states exact, JSON numbers within {tier.multiple:g} x "
                                                  "the twins' spread at the same place)"))


def first_difference(x: Any, y: Any, path: str = "", family: Sequence[Any] | None = None, multiple: float = 0.0,
                     pairs: Sequence[tuple[int, int]] = ()) -> str | None:
    """The path of the first place two loaded pickles (or JSON documents) differ ("" at the top), or None when
    equal: dicts by key, lists and tuples by position, tensors by value (``torch.equal``), numpy arrays by value,
    floats within ``multiple`` x the root mean square of ``|family[i] - family[j]|`` over ``pairs`` at the same place
    (``family`` None or ``multiple`` 0: exact), anything else by ``==``."""
    if multiple and family and pairs and isinstance(x, float) and _is_number(y) and all(map(_is_number, family)):
        noise = math.sqrt(sum((family[i] - family[j]) ** 2 for i, j in pairs) / len(pairs))
        return None if abs(x - y) <= multiple * noise or x == y else path
    if isinstance(x, dict) and isinstance(y, dict):
        if x.keys() != y.keys():
            return f"{path} (keys {sorted(map(str, x.keys() ^ y.keys()))[:3]})"
        return next((found for k in x if (found := first_difference(
            x[k], y[k], f"{path}.{k}" if path else str(k), _at(family, k, dict), multiple, pairs)) is not None), None)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        if len(x) != len(y):
            return f"{path} (lengths {len(x)} vs {len(y)})"
        return next((found for i, (u, v) in enumerate(zip(x, y)) if (found := first_difference(
            u, v, f"{path}[{i}]", _at(family, i, (list, tuple)), multiple, pairs)) is not None), None)
    return None if _leaf_equal(x, y) else path


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _at(family: Sequence[Any] | None, key: Any, kind: Any) -> list[Any] | None:
    """Each member's value at ``key`` (None when a member has none there: the place is then compared exactly)."""
    if not family:
        return None
    out = []
    for member in family:
        if not isinstance(member, kind):
            return None
        if isinstance(member, dict):
            if key not in member:
                return None
            out.append(member[key])
        else:
            if key >= len(member):
                return None
            out.append(member[key])
    return out


def _leaf_equal(x: Any, y: Any) -> bool:
    """Two leaves of loaded states are equal: tensors by shape, dtype and value, numpy arrays by shape and bytes,
    anything else by ``==`` (what cannot be compared is not equal)."""
    import torch

    if torch.is_tensor(x) and torch.is_tensor(y):
        return x.shape == y.shape and x.dtype == y.dtype and bool(torch.equal(x, y))
    if hasattr(x, "shape") and hasattr(x, "tobytes") and hasattr(y, "tobytes"):  # numpy
        return bool(x.shape == y.shape and x.tobytes() == y.tobytes())
    try:
        return bool(x == y)
    except (TypeError, ValueError, RuntimeError):
        return False
