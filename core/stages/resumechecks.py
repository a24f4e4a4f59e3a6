"""The checks of the recipe's resume (:mod:`core.stages.resume` runs the runs and calls them): each looks at one run,
one checkpoint or a comparison, and returns :class:`core.stages.compare.Check` rows.

- the kill (:func:`kill_checks`, :func:`kill_point_check`; across nodes :func:`survivor_checks`);
- the checkpoint left (:func:`checkpoint_checks`, over :func:`core.stages.checkpoint.gate_checks`, the rules both
  subjects share): the recipe's files (:func:`required_files`), and across nodes the checkpoint every node holds;
- the comparison: step by step (:func:`compare_steps` over :data:`core.stages.compare.RECIPE_RULES`), the random
  generators (:func:`compare_rng`), the manifest at load
  (:func:`loaded_manifest_check`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from core import killpoints
from core.protocol.events import ChildEvent, KillPoint, ManifestChecked, Started
from core.spec import RunSpec
from core.stages.checkpoint import (
    Checkpoint,
    Selection,
    gate_checks,
    list_checkpoints,
    may_load,
    select_checkpoint,
    trainer_files,
)
from core.stages.childproc import KILL_SETTLE_S, ChildJob, child_groups, groups_left_after_kill, kill_group
from core.stages.compare import RECIPE_RULES, Check, ResumeSeries, StepPoint, StepSeries, compare_series, span
from core.stages.nodeloss import NodeLoss, Survived, span_ranks
from core.stages.noise import Family, Tier
from core.status import StageStatus


def planned_kill(spec: RunSpec, short: bool = False) -> str:
    """The spec's kill in the one wording of :mod:`core.killpoints` (its place with the micro-batch count, and unless
    ``short`` what is on disk then): what the log, the result, the screen's progress line and timeline say."""
    r = spec.resume
    return killpoints.describe(r.kill_at, r.kill_step(), r.kill_checkpoint_step(), short, spec.grad_accum)


def required_files(spec: RunSpec, world_size: int = 1, ranks: Sequence[int] | None = None) -> dict[str, str]:
    """The files the recipe's checkpoint must hold, by component: Trainer's set for the spec's adapters and dtype
    (:func:`core.stages.checkpoint.trainer_files`; ``world_size`` and ``ranks`` as there)."""
    return trainer_files(bool(spec.adapters), spec.dtype == "fp16", world_size, ranks)


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


def rank_digests(digests: dict[int, dict[str, str]], world: int = 1) -> dict[str, str]:
    """One digest mapping for several ranks' generators (``<generator>@rank<r>``); one process's (``world`` 1) as it
    is."""
    if world == 1 and list(digests) in ([0], []):
        return digests.get(0, {})
    return {f"{k}@rank{r}": v for r in sorted(digests) for k, v in digests[r].items()}


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
    """The checks of the interrupted run's checkpoint ``ckpt`` (checkpoint-c) before anything loads it
    (:func:`core.stages.checkpoint.gate_checks`, command mode's too): the newest complete one is c, it holds every
    component, its files match the ``manifest`` taken after the kill, every pickle loads with ``weights_only=True``,
    its trainer state says step c, and it was written at the resume's world size.

    Several nodes (``nodes``; ``ranks``: this node's, whose RNG states its checkpoint holds): the checkpoint resumed
    from is the newest complete on every node (:meth:`core.stages.nodeloss.NodeLoss.agree`).

    Returns:
        (the checks, True when the resumed run may start: every check passed that guards loading, selection and
        completeness: :func:`core.stages.checkpoint.may_load`)."""
    c = spec.resume.kill_checkpoint_step()
    own_ranks = ranks if nodes is not None else None
    files = required_files(spec, world, own_ranks)
    selection = select_checkpoint(list_checkpoints(output_dir)[0], files)
    if nodes is not None:
        agreed, others = nodes.agree(selection.step)
        newer = [] if selection.checkpoint is None or agreed == selection.step else [
            f"{selection.checkpoint.name} is complete on this node, not on every node"]
        selection = Selection(Checkpoint(agreed, output_dir / f"checkpoint-{agreed}") if agreed is not None else None,
                              selection.skipped + newer + others)
    checks = gate_checks(selection, ckpt, c, files, manifest, True, resume_world, own_ranks)
    return checks, may_load(checks, incomplete=False)


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


