"""Kill and resume of the user's job: "a checkpoint exists" is not "it resumes".

The uninterrupted run (the probe stage's) is the reference. Its checkpoints, by step, give c (the
``kill_after_checkpoint``-th) and the next one n; the kill lands at step ``k = c + max(1, (n - c) // 2)``:

1. **interrupted**: the training command again, into a fresh ``{out}``. A Trainer-based script holds after optimizer
   step k on every rank (the hook's ``GPUACCEPT_HOLD_AT_STEP``: exact on any machine's speed); another script is
   killed as soon as its metrics show step k (checked every 20 ms: a script that writes checkpoint n within that time
   is caught by the ``kill_point`` check, never passed; the check's kill missed its point, so the interrupted run is
   started again, :data:`KILL_ATTEMPTS` in all, each miss kept in ``resume-interrupted-attempt-<i>/`` and named). Then
   SIGKILL to every process of it, every rank (:func:`core.command.process.kill_job`).
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
first: the training command again (``command.resume_twins`` times, all but the first nudged by one ulp), uninterrupted, each
into its own ``{out}``; they and the reference started alike, from step 0, so every pair of the three is a sample of
the noise, and the bound of every tolerance check is the tier's multiple of their spread (the losses of the steps
compared; per tensor at the reference's last checkpoint; each number of a JSON state).

Across nodes (``command.nnodes`` > 1) one node is lost between the checkpoints instead of the whole job
(:mod:`core.command.nodeloss`): every node runs each run together, the lost node's command is held and killed, the
others' fail waiting for it, and every node resumes from its own newest checkpoint complete on every node.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from core.child.inject.jitter import NUDGE_ENV
from core.cluster.agree import stopped_by
from core.command.configplan import run_words
from core.command.nodeloss import CommandNodes, survived_evidence
from core.command.reports import failure_lines
from core.command.resumechecks import (
    KillPlan,
    Resize,
    checkpoint_checks,
    compare_final,
    compare_steps,
    dcp_world_check,
    kill_checks,
    late_checkpoints,
    required_files,
    resize_of,
)
from core.command.run import RunOutcome, run_command
from core.commandspec import CommandSpec, with_nproc
from core.criteria import Judgement
from core.errors import StageError
from core.events import Event, Message
from core.protocol.manifest import verify_manifest, write_manifest
from core.stages.checkpoint import Checkpoint, Files, is_complete, may_load, missing
from core.stages.compare import (
    Check,
    TrainableSet,
    span,
    trainable_check,
    verdict,
)
from core.stages.nodeloss import LOSS_GRACE_S
from core.stages.noise import Family, Tier
from core.status import StageStatus

#: how many times a script killed from outside (at the step its metrics show) is run again, into a fresh folder, when
#: its kill came after the next checkpoint was complete: the check's kill missed its point (the script saved within
#: the time between its metrics line and the kill), which says nothing of its resume; each miss is kept and named
KILL_ATTEMPTS = 3
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
    required_files: list[str] = field(default_factory=list)  # the file names checkpoint c must hold
    seconds: float = 0.0
    #: the criteria it was judged by (core/criteria.py ``judge_resume_tier``), with the numbers
    criteria: list[Judgement] = field(default_factory=list)


@dataclass
class _Progress:
    """The check as it goes: its checks and what its runs left; :meth:`finish` makes the result (a check that stops
    early finishes there too). ``plan`` is set once the twin, if any, has run: a result stopped before names no
    kill."""

    started: float
    tier: Tier
    required: Files
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
                             runs=self.runs, required_files=list(self.required.values()), seconds=time.perf_counter() - self.started,
                             findings=self.findings, twin_final_step=self.twin_final)


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
    yield Message("resume", text=f"{count} twin runs: the training command again, uninterrupted (all but the first "
                                 "nudged by one ulp); their spread is the run-to-run noise the comparison is bounded by"
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
    progress = _Progress(time.perf_counter(), tier,
                         required_files(spec, trainer, world, runs.ranks if nodes is not None else None))
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

    folder = runs.run_dir / "resume-interrupted"
    attempts = 1 if trainer else KILL_ATTEMPTS  # the hook holds a Trainer at its step: its kill cannot come late
    missed: list[str] = []
    for attempt in range(1, attempts + 1):
        interrupted = yield from run_command(spec, "interrupted", argv_i, out_i, folder, "resume", total=k,
                                             hold_at_step=k if trainer else None, kill_when=at_kill_point,
                                             cancelled=runs.cancelled, backend=runs.backend)
        if interrupted.kill is not None:
            seen = max((s.step for s in interrupted.steps_seen()), default=0)
            yield Message("resume", text=f"interrupted run killed at step {seen} ({interrupted.kill.evidence()})")
        kill, point, ckpt = kill_checks(interrupted, trainer is not None, world, plan, progress.required)
        late = late_checkpoints(interrupted, plan.c, progress.required)
        if not late or kill.status != StageStatus.PASS or attempt == attempts:
            break
        aside = folder.with_name(f"{folder.name}-attempt-{attempt}")
        folder.rename(aside)  # every artefact of the missed kill is kept, beside the next attempt
        progress.runs[f"interrupted-attempt-{attempt}"] = _summary(interrupted, moved=(folder, aside))
        missed.append(f"attempt {attempt} was killed after {', '.join(x.name for x in late)} was complete "
                      f"({aside.name}/)")
        yield Message("resume", text=f"the kill came late: {missed[-1]}; the script saved its next checkpoint "
                                     "within the time between its metrics line and the kill; the interrupted run "
                                     f"again (attempt {attempt + 1} of {attempts})")
    progress.runs["interrupted"] = _summary(interrupted)
    if missed:
        point = replace(point, evidence=f"{point.evidence} (attempt {len(missed) + 1} of {attempts}: "
                                        f"{'; '.join(missed)})")
    progress.checks += [kill, point]
    return interrupted, ckpt if kill.status == StageStatus.PASS else None


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
        kill, point, ckpt = kill_checks(interrupted, True, len(ranks), plan, progress.required)
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
    newest = [x for x in o.checkpoints if is_complete(x.path, progress.required)]
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


def _missing_text(o: RunOutcome, plan: KillPlan, required: Files) -> str:
    ckpt = next((x for x in o.checkpoints if x.step == plan.c), None)
    if ckpt is None:
        return f"checkpoint-{plan.c} itself"
    return (f"{', '.join(missing(ckpt.path, required))} from {ckpt.name} (a node resumes from its own disk: "
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
    gate = checkpoint_checks(interrupted, ckpt, plan.c, progress.required, progress.manifest,
                              runs.trainer is not None,
                              runs.resize.resumed if runs.resize is not None else runs.world,
                              runs.ranks if runs.nodes is not None else None)
    if runs.resize is not None and runs.trainer is None:
        gate.append(dcp_world_check(ckpt.path, runs.resize))
    progress.checks += gate
    return may_load(gate, incomplete=True)


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
        progress.checks.append(trainable_check(TrainableSet.of_trainer(trainer),
                                               TrainableSet.of_trainer(resumed.trainer)))
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


def _summary(o: RunOutcome, moved: tuple[Path, Path] | None = None) -> RunSummary:
    """The run in the record's words; ``moved``: its folder was renamed (old, new), its paths follow it."""
    killed = o.kill.evidence() if o.kill is not None else ""
    log, out = str(o.log_path), str(o.out_dir)
    if moved is not None:
        log, out = (p.replace(str(moved[0]), str(moved[1]), 1) for p in (log, out))
    return RunSummary(o.argv, o.exit_code, killed, o.seconds, log, out)


# ------------------------------------------------------------------------------------------- the step comparison


