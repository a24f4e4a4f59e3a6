"""Kill-and-resume check: "a checkpoint exists" is not "it resumes" (docs/architecture.md §4).

The train stage's run is the reference. A second run with the same spec (``interrupted``) starts from a copy of the
reference's checkpoint before ``c`` (itself a resume; from step 0 when ``c`` is the first checkpoint or
``resume.interrupted_from = "start"``), holds once step ``kill_step`` is done (after checkpoint ``c``, before the next)
and its process group gets SIGKILL. A third run (``resumed``) starts from ``checkpoint-c`` with Trainer's
``resume_from_checkpoint`` and stops after ``resume.compare_steps`` steps (by default one checkpoint interval: where
the reference keeps a checkpoint). So the check costs about 2.5 checkpoint intervals of training, not a second
training run. Then, step by step against the reference:

- exact: global steps, epoch, learning rate applied, sample ids consumed; optimizer step counts and param-group sizes;
- within the stated tolerance tier: loss per step, final trainable weights, optimizer moments;
- complete, fail not warn: weights or adapter, optimizer, scheduler, RNG, trainer state (GradScaler when fp16);
- the checkpoint's files match the sha256 manifest written right after the kill before anything loads them.

Tensors are read with safetensors or ``torch.load`` with ``weights_only=True`` only (:mod:`core.stages.states`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from core.errors import StageError
from core.events import ChildStarted, Event, FirstStepWait, Message, Progress, lead_events
from core.protocol.events import ChildEvent, KillPoint, RngRestored, Started, Step, Trainable
from core.protocol.job import WorkerJob, worker_job
from core.protocol.manifest import write_manifest
from core.protocol.rng import rng_digest
from core.spec import RunSpec
from core.stages.childproc import (
    SINGLE,
    ChildJob,
    Launch,
    check_exit,
    start_child,
    watch,
)
from core.stages.compare import (
    RECIPE_RULES,
    Check,
    TrainableSet,
    compare_series,
    trainable_check,
    verdict,
)
from core.stages.nodeloss import NodeLoss, node_rank, node_ranks
from core.stages.noise import Family, Tier, required_tier
from core.stages.resumechecks import (
    checkpoint_checks,
    compare_rng,
    kill_checks,
    loaded_manifest_check,
    planned_kill,
    rank_digests,
    recipe_series,
    required_files,
    survivor_checks,
)
from core.stages.states import compare_optimizers, compare_scalers, compare_weights, safe_load
from core.stages.train import StepMean, merge_rank_steps
from core.status import PASSING, StageStatus


@dataclass(frozen=True)
class ResumeResult:
    """Outcome of the kill-and-resume check. ``status``: pass | fail | not_applicable."""

    status: StageStatus
    checks: list[Check] = field(default_factory=list)
    checkpoint_step: int | None = None
    kill_step: int | None = None
    killed_pgid: int | None = None
    tier: Tier | None = None
    comparison: list[dict[str, Any]] = field(default_factory=list)  # per resumed step: reference vs resumed
    manifest: dict[str, str] = field(default_factory=dict)  # file -> sha256 of the resumed-from checkpoint
    extra_steps: int = 0  # steps the check ran beyond the reference (killed + resumed)
    seconds: float = 0.0
    summary: str = ""
    kill_at: str | None = None  # resume.kill_at of the spec (KILL_POINTS)
    kill_planned: str = ""  # the kill point in words, with its step numbers
    interrupted_start: int = 0  # the step the interrupted run started from (a copy of the reference's checkpoint)
    compared_steps: tuple[int, int] | None = None  # first and last step the resumed run trains and compares
    twin_steps: tuple[int, int] | None = None  # first and last step of each twin run (None: no twin ran)


RESUME_CHECKS: dict[str, str] = {
    "kill": "exact", "kill_point": "exact", "reproducible": "tolerance", "checkpoint_selection": "completeness",
    "checkpoint_complete": "completeness", "manifest": "exact", "safe_loading": "exact", "trainer_state": "exact",
    "global_steps": "exact", "epoch": "exact", "learning_rate": "exact", "sample_ids": "exact", "loss": "tolerance",
    "trainable_set": "exact", "rng_restored": "exact", "rng_continues": "exact", "final_weights": "tolerance",
    "optimizer_progress": "exact", "optimizer_moments": "tolerance", "world_size": "exact",
    "manifest_at_load": "exact",
}  # every check a passing resume comparison holds, with its kind; fp16 adds "grad_scaler" (exact)
#: checks a record of an older schema version did not have yet: name -> the first version that holds it
CHECK_SINCE: dict[str, int] = {"manifest_at_load": 3, "reproducible": 5}


def expected_checks(dtype: str, schema_version: int | None = None) -> dict[str, str]:
    """The checks a passing resume comparison must hold for ``dtype``, name -> kind; for a record of
    ``schema_version`` (None: the current one) without the checks added after it (:data:`CHECK_SINCE`)."""
    checks = {**RESUME_CHECKS, **({"grad_scaler": "exact"} if dtype == "fp16" else {})}
    if schema_version is not None:
        checks = {n: k for n, k in checks.items() if CHECK_SINCE.get(n, 1) <= schema_version}
    return checks


@dataclass(frozen=True)
class CheckWork:
    """The resume check's work, in optimizer steps, run by run in the order they run: (run, the step it starts after,
    its last step). Each twin trains from the interrupted run's start to end, the interrupted run from its start to
    the step it is killed in, the resumed run c+1..end. A run's progress is its steps done on top of the runs before it (:meth:`progress`), so
    the stage's bar is proportional to the steps trained and never goes back."""

    runs: tuple[tuple[str, int, int], ...]

    @classmethod
    def of(cls, spec: RunSpec, twins: int) -> CheckWork:
        r = spec.resume
        end = r.compared_until(spec.steps)
        runs = tuple((f"twin-{i}", r.interrupted_start(), end) for i in range(1, twins + 1)) + (
            ("interrupted", r.interrupted_start(), r.last_step_needed()), ("resumed", r.kill_checkpoint_step(), end))
        return cls(runs)

    @property
    def total(self) -> int:
        """Steps over every run."""
        return sum(last - after for _, after, last in self.runs)

    def progress(self, run: str, step: int, loss: float | None = None) -> Progress:
        """The Progress of ``run`` once its optimizer step ``step`` is done: the run's step of its last step, the
        stage's steps done of :attr:`total`, and the run's place among the runs."""
        names = [name for name, _, _ in self.runs]
        i = names.index(run)
        _, after, last = self.runs[i]
        before = sum(b - a for _, a, b in self.runs[:i])
        done = before + min(max(step - after, 0), last - after)
        return Progress("resume", run=run, step=step, total=last, loss=loss, work_done=done, work_total=self.total,
                        part=(i + 1, len(self.runs)))


def not_applicable(spec: RunSpec) -> ResumeResult:
    """The result for inference (nothing is trained, nothing resumes) or when the check is switched off."""
    why = "inference: fixed weights, no training state to resume" if not spec.training else "switched off in the spec"
    return ResumeResult(status=StageStatus.NOT_APPLICABLE, summary=why)


def run_resume_check(
    spec: RunSpec, model_path: Path, run_dir: Path, device: str, reference: Any,
    cancelled: Callable[[], bool] | None = None,
    launch: Launch = SINGLE, resume_launch: Launch | None = None, nodes: NodeLoss | None = None,
) -> Generator[Event, None, ResumeResult]:
    """Run the twins, interrupted and resumed children and compare with ``reference`` (a TrainEvalResult).

    In order: the twins, where the tier measures the noise (:func:`run_twins`, :mod:`core.stages.noise`); the
    interrupted run, killed at its kill point (:func:`run_interrupted`, :func:`kill_checks`); the checkpoint it
    leaves, checked before anything loads it (:func:`checkpoint_checks`); the resumed run (:func:`run_resumed`); the
    comparison with the reference (:func:`compare_runs`).

    Args:
        launch: :func:`core.stages.childproc.launch_options` of the run (torchrun ranks), for both children; one process by
            default. Under torchrun the kill lands once every rank of this node holds at its kill point.
        resume_launch: the resumed child's launch when it differs (a different world size is refused by the
            ``world_size`` check before the resumed child starts).
        nodes: several nodes: this node's part in losing one of them (:mod:`core.stages.nodeloss`); None: one node.

    Raises:
        StageError: a child failed to start or run (not a failed comparison, which is a ``fail`` result).
    """
    import time

    from core.child.inject.jitter import amplitude

    started = time.perf_counter()
    c, k = spec.resume.kill_checkpoint_step(), spec.resume.kill_step()
    tier = required_tier(device, spec.dtype, spec.accept.resume_tier, spec.resume.noise, jittered=amplitude() > 0,
                         twins=spec.resume.twins)
    resume_launch = resume_launch or launch
    # processes writing / resuming the checkpoint: this node's ranks x the nodes (1 x 1 for a single process)
    world = launch.nproc * spec.torchrun.nnodes
    # the training run's job: each run of the check replaces what differs (its role, where it starts and stops)
    base = worker_job(spec, "train", model_path, device, launch.names(device))
    if nodes is not None:  # only the lost node's ranks hold at the kill point
        base = replace(base, kill_node=nodes.lost)

    work = CheckWork.of(spec, twins=tier.twins)

    # 0. the twins: the same training from where the interrupted run starts, uninterrupted, to the last compared
    #    step (their spread is the noise the tolerance checks are bounded by)
    twins = (yield from run_twins(spec, run_dir, base, launch, reference, cancelled, work)) if not tier.exact else []

    # 1. the interrupted run, killed at the kill point (after checkpoint c, before the next is complete)
    interrupted, held = yield from run_interrupted(spec, run_dir, reference, base, launch, cancelled, work, nodes)
    ranks = node_ranks(interrupted) if nodes is not None else tuple(range(world))
    if held:
        pgid, checks = kill_checks(spec, interrupted, held, launch.nproc, lost=nodes is not None)
        if nodes is not None:
            host = next((e.host for e in interrupted.events if isinstance(e, Started)), "?")
            nodes.tell_lost(held[min(held)], host, node_rank(interrupted) or 0)
    else:  # a node that survived the loss of another
        assert nodes is not None
        yield Message("resume", text=f"node {nodes.lost} was lost: waiting for this node's ranks to end")
        survived = nodes.survive(interrupted)
        pgid, checks = survived.pgid, survivor_checks(spec, survived, ranks)

    # 2. which checkpoint to resume from; completeness, manifest and safe loading, before anything loads it
    ckpt = interrupted.output_dir / f"checkpoint-{c}"
    manifest_path = run_dir / "resume-interrupted" / f"manifest-checkpoint-{c}.json"
    manifest = write_manifest(ckpt, manifest_path)
    gate, resumable = checkpoint_checks(spec, interrupted.output_dir, ckpt, manifest, world,
                                        resume_launch.nproc * spec.torchrun.nnodes, ranks, nodes)
    checks.extend(gate)
    if nodes is not None:  # every node restarts, or none: a node left out would hold the others at the rendezvous
        failed = ", ".join(ch.name for ch in gate if ch.status not in PASSING)
        others = nodes.resumable(resumable, f"its checkpoint failed {failed}" if failed else "")
        if others:
            checks.append(Check("nodes_resumable", StageStatus.FAIL,
                                "another node cannot resume, so no node restarts: " + "; ".join(others)))
            resumable = False
    if not resumable:
        return _finish(spec, checks, c, k, pgid, tier, [], manifest, 0, started, twins)
    saved_rng = rank_digests({r: rng_digest(safe_load(ckpt / (f"rng_state_{r}.pth" if world > 1 else "rng_state.pth")))
                               for r in ranks}, world)

    # 3. the resumed run
    job = replace(base, devices=resume_launch.names(device), resume_from=str(ckpt), manifest=str(manifest_path))
    resumed = yield from run_resumed(spec, run_dir, job, resume_launch, cancelled, work)
    checks.append(loaded_manifest_check(resumed.events, resume_launch.nproc, len(manifest)))
    if checks[-1].status != StageStatus.PASS:
        return _finish(spec, checks, c, k, pgid, tier, [], manifest, 0, started, twins)

    # 4. compare
    compared, comparison, extra = compare_runs(spec, reference, interrupted, resumed, saved_rng, world, tier, twins,
                                               len(ranks))
    checks.extend(compared)
    return _finish(spec, checks, c, k, pgid, tier, comparison, manifest, extra, started, twins)


def run_twins(spec: RunSpec, run_dir: Path, base: WorkerJob, launch: Launch, reference: Any,
              cancelled: Callable[[], bool] | None = None, work: CheckWork | None = None,
              ) -> Generator[Event, None, list[ChildJob]]:
    """The twins (:mod:`core.stages.noise`): the reference's training again (``base``: its job), each in a process of
    its own, from where the interrupted run starts (a copy of the reference's checkpoint there, or step 0),
    uninterrupted and never killed, to the last compared step, checkpointed there only; every twin after the first is
    nudged by one ulp before its first step (:attr:`~core.protocol.job.WorkerJob.nudge`).

    Raises:
        StageError: a child failed."""
    end, start = spec.resume.compared_until(spec.steps), spec.resume.interrupted_start()
    origin = f"checkpoint-{start} of the uninterrupted run (a copy), where the interrupted run starts" if start else \
        "step 0"
    yield Message("resume", text=f"{spec.resume.twins} twin runs from {origin} to step {end}, uninterrupted (all "
                                 "but the first nudged by one ulp): their spread is the run-to-run noise the comparison "
                                 "is bounded by")
    work = work or CheckWork.of(spec, twins=spec.resume.twins)
    twins = []
    for i in range(1, spec.resume.twins + 1):
        name, folder = f"twin-{i}", run_dir / f"resume-twin-{i}"
        first = str(copy_reference_checkpoint(Path(reference.output_dir), start, folder / "output")) if start else None
        job = replace(base, role="twin", stop_after_step=end, save_steps=end, resume_from=first, nudge=True if i > 1 else None)
        twins.append((yield from _run_to_end(start_child(name, folder, job, launch), launch, cancelled, work)))
    return twins


def _run_to_end(child: ChildJob, launch: Launch, cancelled: Callable[[], bool] | None, work: CheckWork,
                ) -> Generator[Event, None, ChildJob]:
    """Follow a started child of the check (its ``name`` is the run's) to its end: what it does until its first step
    (:class:`~core.events.FirstStepWait`), then its progress in the check's ``work``.

    Raises:
        StageError: the child failed."""
    yield ChildStarted("resume", run=child.name, pid=child.pid, log_path=str(child.log_path))
    resumes = isinstance(child.job, WorkerJob) and child.job.resume_from is not None
    wait = FirstStepWait("resume", child.name, child.pid, child.name, resumes=resumes)
    yield wait.started()
    mean = StepMean(launch.nproc)
    for event in watch(child, cancelled=cancelled):
        if (waiting := wait.see(event)) is not None:
            yield waiting
        if isinstance(event, Step) and (averaged := mean.add(event)) is not None:
            yield work.progress(child.name, averaged.step, averaged.loss)
    check_exit(child)
    return child


def run_interrupted(spec: RunSpec, run_dir: Path, reference: Any, base: WorkerJob, launch: Launch,
                    cancelled: Callable[[], bool] | None = None, work: CheckWork | None = None,
                    nodes: NodeLoss | None = None,
                    ) -> Generator[Event, None, tuple[ChildJob, dict[int, KillPoint]]]:
    """Start the interrupted run and follow it until every rank of this node holds at its kill point (it is not
    killed here). It starts from a copy of the reference's checkpoint before c (itself a resume) unless c is the
    first checkpoint or ``resume.interrupted_from = "start"``. On several nodes (``nodes``) only the lost node's ranks
    hold; on the others it is followed until the lost node says it was killed, or until it ends.

    Returns:
        (the child, rank -> its :class:`~core.protocol.events.KillPoint`; empty on a node that survived the loss).

    Raises:
        StageError: the run ended (or failed) before its kill point.
    """
    start = spec.resume.interrupted_start()
    first = None
    if start > 0:
        first = str(copy_reference_checkpoint(Path(reference.output_dir), start,
                                              run_dir / "resume-interrupted" / "output"))
    origin = f"checkpoint-{start} of the uninterrupted run" if start else "step 0"
    yield Message("resume", text=f"interrupted run from {origin}: SIGKILL {planned_kill(spec)}" if nodes is None else
                  f"interrupted run from {origin}: node {nodes.lost} is lost {planned_kill(spec)} (SIGKILL to every "
                  "process of its run); the other nodes' ranks run on until they fail waiting for it")
    interrupted = start_child("interrupted", run_dir / "resume-interrupted", replace(
        base, role="interrupted", resume_from=first, kill_step=spec.resume.kill_step(), kill_at=spec.resume.kill_at),
        launch)
    yield ChildStarted("resume", run="interrupted", pid=interrupted.pid, log_path=str(interrupted.log_path))
    work = work or CheckWork.of(spec, twins=0)
    wait = FirstStepWait("resume", "interrupted", interrupted.pid, "interrupted", resumes=start > 0)
    yield wait.started()
    held: dict[int, KillPoint] = {}  # rank -> its kill_point event: kill once every rank of this node holds there

    def all_held(e: ChildEvent) -> bool:
        if isinstance(e, KillPoint):
            held[e.rank or 0] = e
        return len(held) >= launch.nproc

    mean = StepMean(launch.nproc)
    for event in watch(interrupted, stop_when=all_held, cancelled=cancelled,
                       until=nodes.told if nodes is not None else None):
        if (waiting := wait.see(event)) is not None:
            yield waiting
        if isinstance(event, Step) and (averaged := mean.add(event)) is not None:
            yield work.progress("interrupted", averaged.step, averaged.loss)
    if nodes is not None and len(held) < launch.nproc:
        nodes.stop_if_another_stopped(interrupted)
    if nodes is not None and not held and node_rank(interrupted) not in (None, nodes.lost):
        return interrupted, held  # it survived: the caller waits for its end (NodeLoss.survive)
    if len(held) < launch.nproc:
        check_exit(interrupted)
        raise StageError(f"the interrupted run ended before its kill point (see {interrupted.log_path})")
    return interrupted, held


def run_resumed(spec: RunSpec, run_dir: Path, job: WorkerJob, launch: Launch,
                cancelled: Callable[[], bool] | None = None, work: CheckWork | None = None,
                ) -> Generator[Event, None, ChildJob]:
    """Start the resumed run (``job``: from checkpoint-c, with its manifest), follow it to its last compared step.

    Raises:
        StageError: the child failed."""
    c, end = spec.resume.kill_checkpoint_step(), spec.resume.compared_until(spec.steps)
    yield Message("resume", text=f"resumed run from checkpoint-{c} to step {end}, compared with the uninterrupted "
                                 f"run at steps {c + 1}-{end}")
    return (yield from _run_to_end(start_child("resumed", run_dir / "resume-resumed", replace(
        job, role="resumed", stop_after_step=end), launch), launch, cancelled, work or CheckWork.of(spec, twins=0)))


def compare_runs(spec: RunSpec, reference: Any, interrupted: ChildJob, resumed: ChildJob, saved_rng: dict[str, str],
                 world: int, tier: Tier, twins: Sequence[ChildJob] = (), local: int | None = None,
                 ) -> tuple[list[Check], list[dict[str, Any]], int]:
    """Compare the interrupted and resumed runs with the reference: the steps (:func:`compare_steps`), the trainable
    set, the random generators (``saved_rng``: the digests of checkpoint-c's RNG files), the final weights and
    optimizer states (and the GradScaler with fp16) at the last compared step; the tolerance checks bounded by the
    ``twins``' spread where the tier measures noise (:mod:`core.stages.noise`: the reference is one of the family where
    the twins started at step 0, as it did).

    Returns:
        (the checks, one row per resumed step: step, learning_rate, loss_reference, loss_resumed, difference (and
        loss_twin with a twin); the steps the check ran beyond the reference)."""
    c, end = spec.resume.kill_checkpoint_step(), spec.resume.compared_until(spec.steps)
    ref = {s["step"]: s for s in reference.steps}
    intr = merge_rank_steps(interrupted.events)
    res = merge_rank_steps(resumed.events)
    twin_steps = [merge_rank_steps(t.events) for t in twins]
    kin = Family.of(len(twins), with_reference=spec.resume.interrupted_start() == 0) if twins else None
    steps = compare_series(recipe_series(ref.values(), intr, res, c, end, twin_steps, kin), tier, RECIPE_RULES)
    checks = list(steps.checks)
    trainable = next((e for e in lead_events(resumed.events) if isinstance(e, Trainable)), None)
    ref_set = getattr(reference, "trainable", {})
    checks.append(trainable_check(
        TrainableSet.of_names(ref_set["names"], ref_set["parameters"]) if ref_set.get("names") else None,
        TrainableSet.of_names(trainable.names, trainable.parameters) if trainable is not None else None))
    restored_by_rank = {e.rank or 0: e.digest for e in resumed.events if isinstance(e, RngRestored)}
    restored = rank_digests(restored_by_rank, world) if len(restored_by_rank) == (local or world) else None
    checks.extend(compare_rng(restored, saved_rng, res, ref, c))
    final = f"checkpoint-{end}"  # a checkpoint of the reference by construction (ResumeSettings.compare_steps)
    weights_file = required_files(spec).get("adapter weights") or required_files(spec)["model weights"]
    ref_final = Path(reference.output_dir) / final
    res_final = resumed.output_dir / final
    family = [ref_final if m == "reference" else twins[int(m.rsplit("-", 1)[1]) - 1].output_dir / final
              for m in kin.members] if kin is not None else None
    checks.append(compare_weights(ref_final / weights_file, res_final / weights_file, tier,
                                  [f / weights_file for f in family] if family else None, kin))
    checks.extend(compare_optimizers(ref_final / "optimizer.pt", res_final / "optimizer.pt", tier,
                                     [f / "optimizer.pt" for f in family] if family else None, kin))
    if spec.dtype == "fp16":  # case R7: the loss scale must continue, not restart at 2^16
        checks.append(compare_scalers(ref_final / "scaler.pt", res_final / "scaler.pt"))
    return checks, steps.rows, len(intr) + len(res) + sum(len(t) for t in twin_steps)


def checks_passed_words(checks: Sequence[Check]) -> str:
    """``21 checks passed``, or ``20 checks passed, 1 not applicable here`` (a check this run cannot make)."""
    apart = sum(1 for ch in checks if ch.status == StageStatus.NOT_APPLICABLE)
    return f"{len(checks) - apart} checks passed" + (f", {apart} not applicable here" if apart else "")


def _finish(spec: RunSpec, checks: list[Check], c: int, k: int, pgid: int, tier: Tier,
            comparison: list[dict[str, Any]], manifest: dict[str, str], extra_steps: int,
            started: float, twins: Sequence[ChildJob] = ()) -> ResumeResult:
    """The result from the checks so far (a check that stops the comparison early returns here too)."""
    import time

    status, failed = verdict(checks)
    end = spec.resume.compared_until(spec.steps)
    summary = (f"killed {planned_kill(spec, short=True)}, resumed from checkpoint-{c}, compared at steps "
               f"{c + 1}-{end}: {checks_passed_words(checks)} ({tier.name})"
               if status == StageStatus.PASS else f"failed: {', '.join(ch.name for ch in failed)}")
    return ResumeResult(status=status, checks=checks, checkpoint_step=c, kill_step=k, killed_pgid=pgid, tier=tier,
                        comparison=comparison, manifest=manifest, extra_steps=extra_steps,
                        kill_at=spec.resume.kill_at, kill_planned=planned_kill(spec),
                        seconds=time.perf_counter() - started, summary=summary,
                        interrupted_start=spec.resume.interrupted_start(), compared_steps=(c + 1, end),
                        twin_steps=(spec.resume.interrupted_start() + 1, end) if twins else None)


def copy_reference_checkpoint(reference_output: Path, step: int, output: Path) -> Path:
    """Copy the uninterrupted run's ``checkpoint-<step>`` into ``output`` (the interrupted run's output folder), where
    the interrupted run resumes from it: the check then trains from the checkpoint before c, not from step 0.

    Raises:
        StageError: the uninterrupted run kept no such checkpoint.
    """
    import shutil

    source = reference_output / f"checkpoint-{step}"
    if not source.is_dir():
        raise StageError(f"the uninterrupted run kept no checkpoint-{step} in {reference_output} to start the "
                         "interrupted run from; set resume.interrupted_from = \"start\"")
    output.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copytree(source, output / source.name))


