"""The checks of command mode's resume (:mod:`core.command.resume` runs the runs and calls them): each looks at one
run, one checkpoint or a comparison, and returns :class:`core.stages.compare.Check` rows.

- the kill (:func:`kill_checks`): the interrupted run held (Trainer) or was seen (metrics) at step k, every process of
  it gone, and what the kill left;
- the checkpoint left (:func:`checkpoint_checks`, over :func:`core.stages.checkpoint.gate_checks`, the rules both
  subjects share): selection, completeness (Trainer's files or ``command.checkpoint_files``), the sha256 manifest,
  safe loading, Trainer's state, the world size (a DCP checkpoint may be resumed at another: :class:`Resize`);
- the comparison: step by step (:func:`compare_steps`, over :data:`core.stages.compare.COMMAND_RULES`), the
  trainable set (:func:`core.stages.compare.trainable_check`, the recipe's too) and the last checkpoints file by file (:func:`compare_final`, over
  :func:`core.stages.states.compare_final_files`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.command.reports import StepRecord, last_lines
from core.command.run import RunOutcome
from core.commandspec import CommandSpec, launcher_nnodes, launcher_nproc, launcher_world
from core.stages.checkpoint import (
    Checkpoint,
    Files,
    gate_checks,
    is_complete,
    listed_files,
    select_checkpoint,
    trainer_files,
)
from core.stages.compare import (
    COMMAND_RULES,
    Check,
    ResumeSeries,
    StepPoint,
    StepSeries,
    compare_series,
)
from core.stages.noise import Family, Tier, resized_tier
from core.stages.states import Noisy, compare_final_files, dcp_as_files, is_dcp
from core.status import StageStatus


@dataclass(frozen=True)
class KillPlan:
    """Where the check kills and compares, from the uninterrupted run's checkpoints: resume from checkpoint ``c``,
    kill at step ``k``, before the next checkpoint ``n``, compare at the last one, ``final``."""

    c: int
    n: int
    k: int
    final: int


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


def required_files(spec: CommandSpec, trainer: dict[str, Any] | None, world: int, ranks: list[int] | None = None,
                   ) -> dict[str, str]:
    """What the command's checkpoint must hold to resume: ``command.checkpoint_files`` as its user listed them, else
    Trainer's set for what the Trainer hook reported (a PeftModel: the adapter; fp16: the GradScaler;
    :func:`core.stages.checkpoint.trainer_files`, with ``world`` and ``ranks`` as there), else none (gpuaccept cannot
    know: ``checkpoint_complete`` says so)."""
    if spec.checkpoint_files:
        return listed_files(spec.checkpoint_files)
    if trainer:
        return trainer_files(bool(trainer.get("peft")), bool((trainer.get("arguments") or {}).get("fp16")), world,
                             ranks)
    return {}


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


def kill_checks(o: RunOutcome, trainer: bool, world: int, plan: KillPlan, files: Files
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
    where, ok = held_at(o, world, plan.k) if trainer else seen_at(o, plan.k)
    later = late_checkpoints(o, plan.c, files)
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


def late_checkpoints(o: RunOutcome, c: int, files: Files) -> list[Checkpoint]:
    """The checkpoints after ``c`` already complete when the kill was decided (every one listed, where no file is
    named): a kill that came after the next checkpoint."""
    return [x for x in o.at_kill if x.step > c and (is_complete(x.path, files) if files else True)]


def held_at(o: RunOutcome, world: int, k: int) -> tuple[str, bool]:
    """Where a Trainer-based run was held (every rank after step ``k``), in words, and whether that is the kill
    point."""
    ranks = sorted(o.hook.held)
    where = f"every rank ({', '.join(map(str, ranks))}) held after step {k}" if len(ranks) == world else \
        f"held on ranks {ranks} of {world}"
    return where, len(ranks) == world and all(int(e.get("step", 0)) == k for e in o.hook.held.values())


def seen_at(o: RunOutcome, k: int) -> tuple[str, bool]:
    """Where another script was killed (the last step its metrics showed), in words, and whether it reached ``k``."""
    seen = max((s.step for s in o.steps_seen()), default=0)
    return f"killed when its metrics showed step {seen}", seen >= k


def checkpoint_checks(o: RunOutcome, ckpt: Checkpoint, c: int, files: Files, manifest: dict[str, str],
                      trainer: bool, world: int, ranks: list[int] | None = None) -> list[Check]:
    """The checks of checkpoint c before anything loads it (:func:`core.stages.checkpoint.gate_checks`, the
    recipe's too): the newest complete checkpoint the interrupted run left (matching ``command.checkpoints``, with
    what the listing skipped) is c, it holds ``files``, its manifest, safe loading, and for a Trainer its state and
    world size (``ranks``, several nodes: this node's, whose RNG states its checkpoint holds)."""
    selection = select_checkpoint(o.checkpoints, files, o.skipped_checkpoints)
    return gate_checks(selection, ckpt.path, c, files, manifest, trainer, world, ranks)


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
    """The step-by-step checks (:func:`core.stages.compare.compare_series` under :data:`core.stages.compare.COMMAND_RULES`):
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


def compare_final(reference: RunOutcome, resumed: RunOutcome, step: int, tier: Tier, not_compared: list[str],
                  trainer: bool = False, twins: Sequence[RunOutcome] = (), kin: Family | None = None,
                  scratch: Path | None = None) -> list[Check]:
    """At the reference's last checkpoint (step ``step``), the resumed run's checkpoint of the same step, file by
    file (:func:`core.stages.states.compare_final_files`; the bounds are the tier's, :mod:`core.stages.noise`:
    bit-exact, or from the spread of the noise family ``kin``, the reference and the ``twins``, at their checkpoints
    of the same step; peft writes ``target_modules`` from a set, in no fixed order: a Trainer's JSON files are not
    compared). A torch.distributed.checkpoint (DCP) folder, whose shards follow the world size that wrote it, is
    compared as its whole state (:func:`core.stages.states.dcp_as_files`, written under ``scratch``)."""
    found = _final_folders(reference, resumed, step, tier, twins)
    if isinstance(found, Check):
        return [found]
    a, b, twin_folders = found[0].path, found[1].path, found[2]
    if scratch is not None and is_dcp(a):
        a, b, twin_folders = dcp_as_files((a, b, twin_folders), scratch)
    fam = Noisy([a if m == "reference" else twin_folders[int(m.rsplit("-", 1)[1]) - 1] for m in kin.members],
                kin) if kin is not None and twin_folders else None
    return compare_final_files(a, b, fam, tier, not_compared, trainer)


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

