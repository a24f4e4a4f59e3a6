"""The checks of the recipe's resume (:mod:`core.stages.resume` runs the runs and calls them): each looks at one run,
one checkpoint or a comparison, and returns :class:`core.stages.compare.Check` rows.

- the kill (:func:`kill_checks`, :func:`kill_point_check`; across nodes :func:`survivor_checks`);
- the checkpoint left (:func:`checkpoint_checks`): which one a resume picks (:func:`select_checkpoint`), complete
  (:func:`required_files`), safe to load, written at the world size resumed at (:func:`world_size_check`, which command
  mode shares);
- the comparison: step by step (:func:`compare_steps` over :data:`core.stages.compare.RECIPE_RULES`), the random
  generators (:func:`compare_rng`), the trainable set (:func:`compare_trainable`), the manifest at load
  (:func:`loaded_manifest_check`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core import killpoints
from core.protocol.events import ChildEvent, KillPoint, ManifestChecked, Started
from core.protocol.manifest import verify_manifest
from core.spec import RunSpec
from core.stages.childproc import KILL_SETTLE_S, ChildJob, child_groups, groups_left_after_kill, kill_group
from core.stages.compare import RECIPE_RULES, Check, ResumeSeries, StepPoint, StepSeries, compare_series, span
from core.stages.nodeloss import NodeLoss, Survived, span_ranks
from core.stages.noise import Family, Tier
from core.stages.states import pickles_load_safely
from core.status import StageStatus


def planned_kill(spec: RunSpec, short: bool = False) -> str:
    """The spec's kill in the one wording of :mod:`core.killpoints` (its place with the micro-batch count, and unless
    ``short`` what is on disk then): what the log, the result, the screen's progress line and timeline say."""
    r = spec.resume
    return killpoints.describe(r.kill_at, r.kill_step(), r.kill_checkpoint_step(), short, spec.grad_accum)


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

