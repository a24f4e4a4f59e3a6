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

import json
import re
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from core import killpoints
from core.errors import StageError
from core.events import ChildStarted, Event, FirstStepWait, Message, Progress, lead_events
from core.protocol.events import ChildEvent, KillPoint, ManifestChecked, RngRestored, Started, Step, Trainable
from core.protocol.job import WorkerJob, worker_job
from core.protocol.manifest import verify_manifest, write_manifest
from core.protocol.rng import rng_digest
from core.spec import RunSpec
from core.stages.childproc import (
    KILL_SETTLE_S,
    SINGLE,
    ChildJob,
    Launch,
    check_exit,
    child_groups,
    groups_left_after_kill,
    kill_group,
    start_child,
    watch,
)
from core.stages.compare import (
    RECIPE_RULES,
    Check,
    ResumeSeries,
    StepPoint,
    StepSeries,
    compare_series,
    span,
    verdict,
)
from core.stages.nodeloss import NodeLoss, Survived, node_rank, node_ranks, span_ranks
from core.stages.noise import Family, Tier, required_tier
from core.stages.states import compare_optimizers, compare_scalers, compare_weights, pickles_load_safely, safe_load
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


def required_files(spec: RunSpec, world_size: int = 1, ranks: Sequence[int] | None = None) -> dict[str, str]:
    """Checkpoint files that must exist, by component (Trainer's names). Under torchrun (``world_size`` > 1) Trainer
    writes one RNG state per process, ``rng_state_<rank>.pth``; the weights, optimizer (DDP: rank 0's, the same on
    every rank; FSDP: a full state dict gathered to rank 0), scheduler and trainer state once. ``ranks``: the ranks
    whose RNG states this checkpoint holds (several nodes: one node's; None: every rank of ``world_size``)."""
    files = {
        "adapter weights" if spec.adapters else "model weights": (
            "adapter_model.safetensors" if spec.adapters else "model.safetensors"
        ),
        "optimizer": "optimizer.pt",
        "scheduler": "scheduler.pt",
        "trainer state": "trainer_state.json",
    }
    if world_size > 1:
        files.update({f"RNG state of rank {r}": f"rng_state_{r}.pth"
                      for r in (range(world_size) if ranks is None else ranks)})
    else:
        files["RNG state"] = "rng_state.pth"
    if spec.dtype == "fp16":
        files["GradScaler"] = "scaler.pt"
    return files


def completeness(spec: RunSpec, ckpt: Path, world_size: int = 1, ranks: Sequence[int] | None = None) -> Check:
    """Every component a resume needs is in ``ckpt`` (case R6): fail, naming each missing component and its file.

    Trainer itself loads the optimizer and scheduler only when both files exist and only logs a missing RNG state; this
    check fails instead of warning.
    """
    files = required_files(spec, world_size, ranks)
    missing = [f"{comp} ({name})" for comp, name in files.items() if not (ckpt / name).is_file()]
    if missing:
        return Check("checkpoint_complete", StageStatus.FAIL, "missing: " + ", ".join(missing), kind="completeness")
    return Check("checkpoint_complete", StageStatus.PASS,
                 "present: " + ", ".join(f"{comp} ({name})" for comp, name in files.items()), kind="completeness")


def safe_loading(spec: RunSpec, ckpt: Path, world_size: int = 1, ranks: Sequence[int] | None = None) -> Check:
    """Every pickle the resume will load (optimizer, scheduler, RNG state, GradScaler) loads with
    ``weights_only=True`` (case R8); otherwise fail and name the file, and the resume is not run
    (:func:`pickles_load_safely` over the recipe's pickles)."""
    names = [name for name in required_files(spec, world_size, ranks).values() if name.endswith((".pt", ".pth"))]
    return pickles_load_safely(ckpt, [ckpt / name for name in names])


def compare_rng(restored: dict[str, str] | None, saved: dict[str, str], resumed: list[dict[str, Any]],
                ref: dict[int, dict[str, Any]], c: int) -> list[Check]:
    """Exact checks of the random generators (python, numpy, torch CPU, CUDA), by sha256 digest:

    - ``rng_restored``: right after Trainer restored them, they equal ``rng_state.pth`` of checkpoint-c;
    - ``rng_continues``: at the start of every resumed step they equal the uninterrupted run's at the same step.

    Trainer only logs when ``rng_state.pth`` is missing or named for another world size; a run whose generators were
    not restored draws other dropout masks and other shuffles from there on.

    Args:
        restored: digest reported by the resumed run right after the restore (None: no restore happened).
        saved: digest of the checkpoint's ``rng_state.pth``.
        resumed: the resumed run's step events (``step``, ``rng``: digest at the start of the step).
        ref: the reference's step events by step.
    """
    ranks = sorted({int(k.split("@rank")[1]) for k in saved if "@rank" in k})
    files = (f"rng_state_{ranks[0]}..{ranks[-1]}.pth" if len(ranks) > 1 else f"rng_state_{ranks[0]}.pth" if ranks
             else "rng_state.pth")
    if restored is None:
        first = Check("rng_restored", StageStatus.FAIL, "the resumed run never restored an RNG state (Trainer's "
                                                        "_load_rng_state did not run or found no file)")
    else:
        diff = sorted(k for k in saved.keys() | restored.keys() if saved.get(k) != restored.get(k))
        first = Check("rng_restored", StageStatus.judged(not diff),
                      f"right after restore, generators {', '.join(sorted(restored))} equal {files} of "
                      f"checkpoint-{c} (sha256)" if not diff else
                      f"after restore, {', '.join(diff)} differ from {files} of checkpoint-{c}")
    pairs: list[tuple[int, Any, Any]] = [(e["step"], e.get("rng"), ref.get(e["step"], {}).get("rng"))
                                         for e in resumed]
    missing = [step for step, a, b in pairs if a is None or b is None]
    differ = [step for step, a, b in pairs if a is not None and b is not None and a != b]
    steps = [step for step, _, _ in pairs]
    if not pairs or missing:
        second = Check("rng_continues", StageStatus.FAIL,
                       f"no RNG digest at the start of steps {span(missing) or 'any'}")
    elif differ:
        which = sorted(k for k in pairs[0][1] if any(a.get(k) != b.get(k) for st, a, b in pairs if st in differ))
        second = Check("rng_continues", StageStatus.FAIL, f"generators {', '.join(which)} differ from the "
                                                          f"uninterrupted run's at the start of steps {span(differ)}")
    else:
        states = {json.dumps(r.get("rng"), sort_keys=True) for r in ref.values() if r.get("rng")}
        same = f"at the start of each of steps {span(steps)}, every generator equals the uninterrupted run's"
        if len(states) > 1:
            second = Check("rng_continues", StageStatus.PASS, f"{same}; the generators advanced during training "
                                                              f"({len(states)} distinct states over {len(ref)} steps)")
        else:  # equal, but it would be equal for a state never restored too: proves nothing here, and says so
            second = Check("rng_continues", StageStatus.NOT_APPLICABLE,
                           f"{same}, but nothing drew random numbers during training (no dropout): the states never "
                           "changed, so this check cannot tell a restored state from a fresh one (rng_restored can)")
    return [first, second]


@dataclass(frozen=True)
class Selection:
    """The checkpoint a resume should start from: the newest complete one; ``skipped`` names newer partial ones."""

    checkpoint: Path | None
    skipped: list[str]


def select_checkpoint(spec: RunSpec, output_dir: Path, world_size: int = 1, ranks: Sequence[int] | None = None
                      ) -> Selection:
    """The newest ``checkpoint-N`` in ``output_dir`` that holds every component (:func:`completeness`) and whose
    ``trainer_state.json`` says global step N; newer partial ones (a kill during the write) are skipped with the reason.

    transformers' ``get_last_checkpoint`` takes the highest step whatever it holds; Trainer writes a checkpoint in place
    (weights, then optimizer and scheduler, GradScaler, RNG state, trainer state last), so a kill mid-write leaves a
    partial directory with the highest step.
    """
    skipped: list[str] = []
    for ckpt in sorted(output_dir.glob("checkpoint-*"), key=_step_of, reverse=True):
        if not ckpt.is_dir() or _step_of(ckpt) < 0:
            continue
        complete = completeness(spec, ckpt, world_size, ranks)
        if complete.status != StageStatus.PASS:
            skipped.append(f"{ckpt.name} is partial ({complete.evidence})")
            continue
        try:
            step = json.loads((ckpt / "trainer_state.json").read_text(encoding="utf-8")).get("global_step")
        except (OSError, ValueError) as exc:
            skipped.append(f"{ckpt.name}: trainer_state.json unreadable ({exc})")
            continue
        if step != _step_of(ckpt):
            skipped.append(f"{ckpt.name}: trainer_state.json says global step {step}")
            continue
        return Selection(ckpt, skipped)
    return Selection(None, skipped)


def checkpoint_world_size(ckpt: Path) -> int | None:
    """How many processes wrote ``ckpt``, from Trainer's RNG files: ``rng_state.pth`` = 1, ``rng_state_<r>.pth`` =
    the highest r + 1; None when it holds neither."""
    ranks = [int(m.group(1)) for p in ckpt.glob("rng_state_*.pth") if (m := re.fullmatch(r"rng_state_(\d+)\.pth", p.name))]
    if ranks:
        return max(ranks) + 1
    return 1 if (ckpt / "rng_state.pth").is_file() else None


def world_size_check(ckpt: Path, resume_world: int, ranks: Sequence[int] | None = None) -> Check:
    """The resume runs at the world size the checkpoint was written at (exact). Trainer resumes at another world size
    with only a log line: each rank's RNG file is missing or another rank's, the sampler splits the data into other
    shards and the global batch changes, so the run that continues is not the one that was checkpointed.

    ``ranks`` (several nodes): this node's ranks of the run that wrote it; its checkpoint holds their RNG states and
    only theirs (each node keeps its own), and the resume restarts the same world."""
    if ranks is not None and tuple(ranks) != tuple(range(resume_world)):
        held = sorted(int(m.group(1)) for p in ckpt.glob("rng_state_*.pth")
                      if (m := re.fullmatch(r"rng_state_(\d+)\.pth", p.name)))
        ok = held == sorted(ranks)
        return Check("world_size", StageStatus.judged(ok),
                     f"{ckpt.name} on this node holds the RNG states of ranks {held} of this node's ranks "
                     f"{list(ranks)}, written at world size {resume_world}; resumed at {resume_world}"
                     + ("" if ok else ": it was not written by this node's ranks; the resume was not started"))
    written = checkpoint_world_size(ckpt)
    files = "rng_state.pth" if written == 1 else f"rng_state_0..{(written or 1) - 1}.pth"
    if written is None:
        return Check("world_size", StageStatus.FAIL, f"{ckpt.name} holds no RNG state, so the world size it was "
                                                     "written at is unknown; the resume was not started")
    if written != resume_world:
        return Check("world_size", StageStatus.FAIL,
                     f"refused: {ckpt.name} was written by {written} process(es) ({files}) and this resume would run "
                     f"{resume_world}; resume at world size {written} (the RNG state per rank, the data shard of each "
                     "rank and the global batch depend on it), or start a new run; the resume was not started")
    return Check("world_size", StageStatus.PASS, f"{ckpt.name} was written by {written} process(es) ({files}); resumed "
                                                 f"at {resume_world}")


def _rank_digests(digests: dict[int, dict[str, str]], world: int = 1) -> dict[str, str]:
    """One digest mapping for several ranks' generators (``<generator>@rank<r>``); one process's (``world`` 1) as it
    is."""
    if world == 1 and list(digests) in ([0], []):
        return digests.get(0, {})
    return {f"{k}@rank{r}": v for r in sorted(digests) for k, v in digests[r].items()}


def planned_kill(spec: RunSpec, short: bool = False) -> str:
    """The spec's kill in the one wording of :mod:`core.killpoints` (its place with the micro-batch count, and unless
    ``short`` what is on disk then): what the log, the result, the screen's progress line and timeline say."""
    r = spec.resume
    return killpoints.describe(r.kill_at, r.kill_step(), r.kill_checkpoint_step(), short, spec.grad_accum)


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
    saved_rng = _rank_digests({r: rng_digest(safe_load(ckpt / (f"rng_state_{r}.pth" if world > 1 else "rng_state.pth")))
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
    yield Message("resume", text=f"{spec.resume.twins} twin runs from {origin} to step {end}, uninterrupted (the "
                                 "second nudged by one ulp): their spread is the run-to-run noise the comparison is "
                                 "bounded by")
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


def kill_checks(spec: RunSpec, interrupted: ChildJob, held: dict[int, KillPoint], local: int, lost: bool = False,
                ) -> tuple[int, list[Check]]:
    """SIGKILL every process group of the held interrupted run (:func:`core.stages.childproc.kill_group`) and check
    the kill: ``kill`` (no process of its groups is left, polled up to :data:`KILL_SETTLE_S` s) and ``kill_point``
    (where it held is where the spec placed the kill, on every one of the ``local`` ranks of this node). ``lost``:
    this node is the one lost of several (:mod:`core.stages.nodeloss`).

    Returns:
        (the process group id killed, [kill, kill_point])."""
    kill_event = held[min(held)]
    groups = child_groups(interrupted)
    pgid = kill_group(interrupted)
    alive = groups_left_after_kill(groups)
    what = (f"process group {pgid}" if len(groups) == 1 else
            f"process groups {pgid} (torchrun) and {', '.join(map(str, groups[1:]))} (its ranks)")
    killed = Check("kill", StageStatus.judged(not alive),
                   ("node loss, this node: " if lost else "") + f"SIGKILL to {what} {kill_position(kill_event)}; "
                   + (f"a process of group{'s' * (len(alive) > 1)} {', '.join(map(str, alive))} is still alive "
                      f"{KILL_SETTLE_S:.0f} s later" if alive else
                      f"no process of the group{'s' * (len(groups) > 1)} is left"))
    point = kill_point_check(spec, kill_event)
    if local > 1:
        apart = [r for r, e in held.items() if (e.step, e.where, e.micro_done) !=
                 (kill_event.step, kill_event.where, kill_event.micro_done)]
        if apart:
            point = Check("kill_point", StageStatus.FAIL,
                          f"ranks {apart} held at another point than rank 0: "
                          + "; ".join(f"rank {r} {kill_position(held[r])}" for r in apart))
        else:
            point = Check("kill_point", point.status, f"all {local} ranks: {point.evidence}")
    return pgid, [killed, point]


def survivor_checks(spec: RunSpec, survived: Survived, ranks: tuple[int, ...]) -> list[Check]:
    """``kill`` and ``kill_point`` on a surviving node: the lost node's kill where the spec placed it (its own word),
    and how this node's ranks ended after it (on their own, or SIGKILLed after the grace), none left."""
    event = KillPoint(**survived.told["event"])
    who = f"node {survived.told['node']} ({survived.told['host']})"
    ended = (f"this node's ranks {span_ranks(ranks)} ended on their own {survived.seconds:.1f} s later (torchrun exit code "
             f"{survived.exit_code})" if survived.exit_code is not None else
             f"this node's ranks {span_ranks(ranks)} were still waiting {survived.seconds:.0f} s later and were SIGKILLed, "
             "as a scheduler ends the job step of a node it lost")
    left = (f"; a process of group{'s' * (len(survived.alive) > 1)} {', '.join(map(str, survived.alive))} is still "
            "alive" if survived.alive else "; no process of this node's run is left")
    kill = Check("kill", StageStatus.judged(not survived.alive),
                 f"node loss: every process of {who}'s run SIGKILLed {kill_position(event)}; {ended}{left}")
    point = kill_point_check(spec, event)
    return [kill, Check("kill_point", point.status, f"{who}: {point.evidence}")]


def checkpoint_checks(spec: RunSpec, output_dir: Path, ckpt: Path, manifest: dict[str, str], world: int,
                      resume_world: int, ranks: Sequence[int] | None = None, nodes: NodeLoss | None = None,
                      ) -> tuple[list[Check], bool]:
    """The checks of the interrupted run's checkpoint ``ckpt`` (checkpoint-c) before anything loads it: the newest
    complete one is c (``checkpoint_selection``), it holds every component (``checkpoint_complete``), its files match
    the ``manifest`` taken after the kill, every pickle loads with ``weights_only=True``, its trainer state says step
    c, and it was written at the resume's world size.

    Several nodes (``nodes``; ``ranks``: this node's, whose RNG states its checkpoint holds): the checkpoint resumed
    from is the newest complete on every node (:meth:`core.stages.nodeloss.NodeLoss.agree`).

    Returns:
        (the checks, True when the resumed run may start: every check that guards loading passed)."""
    c = spec.resume.kill_checkpoint_step()
    own_ranks = ranks if nodes is not None else None
    selection = select_checkpoint(spec, output_dir, world, own_ranks)
    if nodes is not None:
        agreed, others = nodes.agree(_step_of(selection.checkpoint) if selection.checkpoint is not None else None)
        newer = [] if selection.checkpoint is None or agreed == _step_of(selection.checkpoint) else [
            f"{selection.checkpoint.name} is complete on this node, not on every node"]
        selection = Selection(output_dir / f"checkpoint-{agreed}" if agreed is not None else None,
                              selection.skipped + newer + others)
    checks = [selection_check(selection, c)]
    complete = completeness(spec, ckpt, world, own_ranks)
    checks.append(complete)
    if complete.status != StageStatus.PASS or selection.checkpoint != ckpt:
        return checks, False
    bad = verify_manifest(ckpt, manifest)
    checks.append(Check("manifest", StageStatus.judged(not bad),
                        ("sha256 mismatch: " + ", ".join(bad)) if bad else f"sha256 of {len(manifest)} files verified"))
    safe = safe_loading(spec, ckpt, world, own_ranks)
    checks.append(safe)
    state = json.loads((ckpt / "trainer_state.json").read_text(encoding="utf-8"))
    checks.append(Check("trainer_state", StageStatus.judged(state.get("global_step") == c),
                        f"trainer_state.json global_step = {state.get('global_step')} (expected {c})"))
    sized = world_size_check(ckpt, resume_world, own_ranks)
    checks.append(sized)
    return checks, not bad and safe.status == StageStatus.PASS and sized.status == StageStatus.PASS


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
    checks.append(compare_trainable(getattr(reference, "trainable", {}),
                                    {"names": trainable.names, "parameters": trainable.parameters}
                                    if trainable is not None else {}))
    restored_by_rank = {e.rank or 0: e.digest for e in resumed.events if isinstance(e, RngRestored)}
    restored = _rank_digests(restored_by_rank, world) if len(restored_by_rank) == (local or world) else None
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


def loaded_manifest_check(events: list[ChildEvent], ranks: int, files: int) -> Check:
    """``manifest_at_load``: every rank of the resumed run verified the checkpoint's sha256 manifest in its own process
    right before Trainer loaded it and again after its run (core.protocol.manifest); a change names the file and when it was
    seen."""
    seen = {(e.rank or 0, e.when): e for e in events if isinstance(e, ManifestChecked)}
    changed = [f"{', '.join(e.bad)} ({e.when.replace('_', ' ')}{f', rank {r}' if ranks > 1 else ''})"
               for (r, _), e in sorted(seen.items()) if e.bad]
    if changed:
        return Check("manifest_at_load", StageStatus.FAIL,
                     "the checkpoint changed after its manifest: " + "; ".join(changed))
    started = sorted({e.rank or 0 for e in events if isinstance(e, Started)}) or [0]
    missing = [f"{when.replace('_', ' ')}{f' (rank {r})' if ranks > 1 else ''}" for r in started
               for when in ("before_load", "after_load") if (r, when) not in seen]
    if missing:
        return Check("manifest_at_load", StageStatus.FAIL, "the resumed process did not verify the checkpoint "
                                                           + ", ".join(missing))
    return Check("manifest_at_load", StageStatus.PASS, f"sha256 of {files} files verified in the resumed process"
                 f"{'es' if ranks > 1 else ''} right before loading and after the run")


def kill_position(event: KillPoint) -> str:
    """Where the interrupted run was when it was killed, in words, from its ``kill_point`` event
    (:func:`core.killpoints.position`)."""
    return killpoints.position(event.step, event.where, event.micro_done, event.micro_in_step)


def kill_point_check(spec: RunSpec, event: KillPoint) -> Check:
    """The interrupted run was killed where the spec placed the kill (``resume.kill_at``, by the rule the child
    holds by: :func:`core.killpoints.holds`)."""
    at = spec.resume.kill_at
    expected = killpoints.holds(at, spec.resume.kill_step(), event.step, event.where, event.micro_done,
                                event.micro_in_step)
    return Check("kill_point", StageStatus.judged(expected),
                 f"{at}: killed {kill_position(event)}" + ("" if expected else f"; planned {planned_kill(spec)}"))


def selection_check(selection: Selection, c: int) -> Check:
    """The newest complete checkpoint is checkpoint-c; partial newer ones are named (resume must not take them)."""
    skipped = ("; skipped " + "; ".join(selection.skipped)) if selection.skipped else ""
    if selection.checkpoint is None:
        return Check("checkpoint_selection", StageStatus.FAIL, "no complete checkpoint to resume from" + skipped,
                     kind="completeness")
    name = selection.checkpoint.name
    ok = name == f"checkpoint-{c}"
    return Check("checkpoint_selection", StageStatus.judged(ok),
                 f"resume from {name}, the newest complete checkpoint" + ("" if ok else f" (expected checkpoint-{c})")
                 + skipped, kind="completeness")


def compare_steps(ref: dict[int, dict[str, Any]], interrupted: list[dict[str, Any]], resumed: list[dict[str, Any]],
                  c: int, steps: int, tier: Tier, twins: Sequence[list[dict[str, Any]]] = (),
                  family: Family | None = None) -> list[Check]:
    """The step checks of the recipe's per-step records (``step``, ``epoch``, ``learning_rate``, ``loss``,
    ``sample_ids``; ``rank_losses`` under torchrun): :func:`core.stages.compare.compare_series` under
    :data:`~core.stages.compare.RECIPE_RULES` over :func:`step_series`, the resumed run expected at steps c+1 ..
    ``steps`` (the last step compared).

    - ``reproducible``: the interrupted run up to the kill equals the reference (it is the same run, or its resume from
      the checkpoint before c): epoch, learning rate and samples exactly, losses within the bound. It wrote the
      checkpoint the resume loads: if it is another run, nothing after it can be this run's resume.
    - the resumed run covers steps c+1 .. ``steps`` exactly once (``global_steps``) and equals the reference step by
      step: ``epoch``, ``learning_rate``, ``sample_ids`` exactly, ``loss`` within the bound.

    The loss bound is the tier's: bit-exact, or ``loss_multiple`` x the noise of the ``twins`` (their ``family``)
    over the points compared (:func:`core.stages.noise.pooled_losses`).
    """
    return compare_series(recipe_series(ref.values(), interrupted, resumed, c, steps, twins, family), tier,
                          RECIPE_RULES).checks


def step_series(records: Iterable[dict[str, Any]]) -> StepSeries:
    """The recipe's per-step records (:func:`core.stages.train.merge_rank_steps`: one per step, every rank's loss in
    ``rank_losses`` under torchrun) as a typed series."""
    return StepSeries.of(StepPoint(step=e["step"], loss=e["loss"], learning_rate=e.get("learning_rate"),
                                   sample_ids=None if e.get("sample_ids") is None else tuple(e["sample_ids"]),
                                   epoch=e.get("epoch"),
                                   rank_losses=tuple(e["rank_losses"]) if e.get("rank_losses") else None)
                         for e in records)


def recipe_series(ref: Iterable[dict[str, Any]], interrupted: list[dict[str, Any]], resumed: list[dict[str, Any]],
                  c: int, steps: int, twins: Sequence[list[dict[str, Any]]] = (), family: Family | None = None,
                  ) -> ResumeSeries:
    """The recipe's runs as series: the resumed run expected at steps c+1 .. ``steps``; ``twins`` the twins' steps,
    ``family`` their noise family."""
    return ResumeSeries(reference=step_series(ref), interrupted=step_series(interrupted),
                        resumed=step_series(resumed), c=c, expected=tuple((0, s) for s in range(c + 1, steps + 1)),
                        twins=tuple(step_series(t) for t in twins), family=family)


def compare_trainable(reference: dict[str, Any], resumed: dict[str, Any]) -> Check:
    """The resumed run trains exactly the reference's parameters (names and count; exact). A resume that rebuilt the
    model differently (other LoRA targets, a frozen layer unfrozen) trains another set from the same checkpoint."""
    if not reference.get("names") or not resumed.get("names"):
        return Check("trainable_set", StageStatus.FAIL, "no trainable-parameter list from the "
                     + ("reference" if not reference.get("names") else "resumed") + " run")
    a, b = set(resumed["names"]), set(reference["names"])
    if a == b and resumed["parameters"] == reference["parameters"]:
        return Check("trainable_set", StageStatus.PASS,
                     f"the same {len(a)} trainable tensors, {resumed['parameters']:,} parameters, as the "
                     "uninterrupted run")
    only = sorted(a - b)[:3] + sorted(b - a)[:3]
    return Check("trainable_set", StageStatus.FAIL, f"resumed {len(a)} tensors / {resumed['parameters']:,} parameters "
                                                    f"vs reference {len(b)} / {reference['parameters']:,}; differ: "
                                                    f"{', '.join(only)}")


def _step_of(p: Path) -> int:
    try:
        return int(p.name.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1
