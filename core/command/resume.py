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

Where the tier measures the noise (:mod:`core.stages.noise`: on CUDA, or under the test jitter), a **twin** runs
first: the training command again, uninterrupted, into its own ``{out}``; the bound of every tolerance check is
``NOISE_MULTIPLE`` times the twin's distance from the reference (the losses of the steps compared; per tensor at the
reference's last checkpoint; each number of a JSON state).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.command.reports import Checkpoint, StepRecord, failure_lines, last_lines
from core.command.run import RunOutcome, run_command
from core.command.spec import CommandSpec, substitute
from core.events import Event, Message
from core.protocol.manifest import verify_manifest, write_manifest
from core.stages.noise import Tier, judge_losses, judge_tensors, loss_noise
from core.stages.resume import (
    Check,
    UntrustedCheckpoint,
    _span,
    compare_optimizers,
    safe_load,
    world_size_check,
)

#: files Trainer writes that a resume never loads: a pickle of TrainingArguments (not weights-only loadable) and
#: peft's model card
TRAINER_UNLOADED = ("training_args.bin", "README.md")
#: the checks of the checkpoint left by the kill that stop the resume when they fail: nothing unsafe or written at
#: another world size is loaded
LOADING_GUARDS = ("manifest", "safe_loading", "world_size", "trainer_state")
#: suffixes of the files read as pickles (``torch.load``)
PICKLES = (".pt", ".pth", ".bin", ".pkl", ".ckpt")


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

    status: str
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
    #: the last step of the twin run (None: no twin ran)
    twin_final_step: int | None = None
    runs: dict[str, RunSummary] = field(default_factory=dict)
    #: what the check's runs did that must be read (a process left running after it exited, a metrics line refused)
    findings: list[str] = field(default_factory=list)
    required_files: list[str] = field(default_factory=list)
    seconds: float = 0.0


def trainer_files(trainer: dict[str, Any], world: int) -> list[str]:
    """The files a Trainer checkpoint must hold to resume (transformers' ``_save_checkpoint``): the adapter (a
    PeftModel) or the model's weights, optimizer, scheduler, trainer state, one RNG state per process, and the
    GradScaler with fp16."""
    weights = "adapter_model.safetensors" if trainer.get("peft") else "model.safetensors"
    files = [weights, "optimizer.pt", "scheduler.pt", "trainer_state.json"]
    files += [f"rng_state_{r}.pth" for r in range(world)] if world > 1 else ["rng_state.pth"]
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
    return CommandResume(status="not_applicable", summary=why)


def run_twin(spec: CommandSpec, reference: RunOutcome, run_dir: Path, values: dict[str, str],
             cancelled: Callable[[], bool] | None = None, backend: Any = None) -> Generator[Event, None, RunOutcome]:
    """The twin of the resume check (:mod:`core.stages.noise`): the training command again, uninterrupted, into its
    own ``{out}`` (``run_dir/resume-twin``).

    Raises:
        StageCancelled: the user stopped it; every process of the command was killed."""
    out = run_dir / "resume-twin" / "out"
    yield Message("resume", text="twin run: the training command again, uninterrupted; its distance from the "
                                 "uninterrupted run is the run-to-run noise the comparison is bounded by")
    return (yield from run_command(spec, "twin", substitute(spec.words(), {**values, "{out}": str(out)}), out,
                                   run_dir / "resume-twin", "resume", total=reference.last_step() or 0,
                                   cancelled=cancelled, backend=backend))


def resume_stage(spec: CommandSpec, reference: RunOutcome, run_dir: Path, values: dict[str, str], tier: Tier,
                 cancelled: Callable[[], bool] | None = None, backend: Any = None, twin: RunOutcome | None = None,
                 ) -> Generator[Event, None, CommandResume]:
    """Kill the command after checkpoint c, resume it, compare with ``reference`` (see the module docstring).

    Args:
        values: the placeholders other than ``{out}`` and ``{checkpoint}`` (``{train_data}``, ``{model}``).
        tier: how the loss and tensor comparisons are judged (:func:`core.stages.noise.required_tier`): bit-exact, or
            bounded by a twin run's distance from the reference (the twin then runs first: :func:`run_twin`).
        twin: the twin already run (the same command and reference: several resumes judged by one measurement of
            the noise); None runs it here when the tier needs one.

    Raises:
        StageCancelled: the user stopped it; every process of the command was killed.
        StageError: a run could not start.
    """
    started = time.perf_counter()
    checks: list[Check] = []
    trainer = reference.trainer
    world = reference.hook.world_size
    required = list(spec.checkpoint_files) or (trainer_files(trainer, world) if trainer else [])
    ckpts = reference.checkpoints
    # the steps checkpointed: what is on disk, and what a Trainer saved (save_total_limit deletes the older folders)
    saved = sorted({x.step for x in ckpts} | {int(e.get("step", 0)) for e in reference.hook.saves if e.get("rank", 0) == 0})
    need = spec.kill_after_checkpoint + 1
    if len(saved) < need or not ckpts:
        return _finish(started, [Check("checkpoints", "fail", _too_few(spec, reference, saved, need),
                                       kind="completeness")], tier, required=required)
    if trainer is None and not reference.steps:
        return _finish(started, [Check("metrics", "fail", f"the uninterrupted run wrote no per-step metrics "
                                       f"({reference.metrics_source}{_rejected(reference)}): from outside, the kill "
                                       "is placed by the step the metrics show and the resumed run is compared with "
                                       "them step by step, so nothing was killed: have the script write JSON lines "
                                       "with step and loss and name the file (command.metrics), or train with "
                                       "transformers' Trainer")], tier, required=required)
    c, n, final = saved[spec.kill_after_checkpoint - 1], saved[spec.kill_after_checkpoint], ckpts[-1].step
    k = c + max(1, (n - c) // 2)
    kept = "" if len(saved) == len(ckpts) else f" ({', '.join(x.name for x in ckpts)} kept: Trainer's save_total_limit " \
                                                "removed the others)"
    checks.append(Check("checkpoints", "pass" if final > c else "fail",
                        f"the uninterrupted run wrote {len(saved)} checkpoints (steps {_span(saved)}){kept}: resume "
                        f"from step {c}, kill at step {k} (before the next, {n}), compare at step {final}"
                        + ("" if final > c else ": no checkpoint after c is left to compare with"),
                        kind="completeness"))
    if final <= c:
        return _finish(started, checks, tier, required=required)

    # 0. the twin: the training command again, uninterrupted (its distance from the reference is the noise)
    runs: dict[str, RunSummary] = {}
    if not tier.exact and twin is None:
        twin = yield from run_twin(spec, reference, run_dir, values, cancelled, backend)
    if twin is not None and not tier.exact:
        runs["twin"] = _summary(twin)
        if twin.exit_code != 0:
            why = "timed out" if twin.timed_out else f"exit status {twin.exit_code}"
            checks.append(Check("twin_run", "fail", f"the twin run (the training command again) failed ({why}): "
                                                    f"{failure_lines(twin.log_path)} (see {twin.log_path}); no noise "
                                                    "bound could be measured"))
            return _finish(started, checks, tier, runs=runs, required=required)
    else:
        twin = None

    # 1. the interrupted run, killed between checkpoint c and the next
    out_i = run_dir / "resume-interrupted" / "out"
    argv_i = substitute(spec.words(), {**values, "{out}": str(out_i)})
    how = "held by the Trainer hook after step" if trainer else "killed when its metrics show step"
    yield Message("resume", text=f"interrupted run: {how} {k}, after checkpoint {c} and before {n}; SIGKILL to every "
                                 "process of it")

    def at_kill_point(o: RunOutcome) -> bool:
        if trainer:
            return len(o.hook.held) >= world
        return any(s.step >= k for s in o.steps_seen())

    interrupted = yield from run_command(spec, "interrupted", argv_i, out_i, run_dir / "resume-interrupted",
                                         "resume", total=k, hold_at_step=k if trainer else None,
                                         kill_when=at_kill_point, cancelled=cancelled, backend=backend)
    runs["interrupted"] = _summary(interrupted)
    seen = max((s.step for s in interrupted.steps_seen()), default=0)
    if interrupted.kill is not None:
        yield Message("resume", text=f"interrupted run killed at step {seen} ({interrupted.kill.evidence()})")
    kill, point, ckpt = _kill_checks(interrupted, trainer is not None, world, c, n, k, required)
    checks += [kill, point]
    if kill.status != "pass" or ckpt is None:
        return _finish(started, checks, tier, c, n, k, final, runs=runs, required=required)

    # 2. the checkpoint it left, before anything loads it
    manifest = write_manifest(ckpt.path, run_dir / "resume-interrupted" / f"manifest-{ckpt.name}.json")
    gate = _checkpoint_checks(interrupted, ckpt, c, required, manifest, trainer, world)
    checks += gate
    # a checkpoint that cannot be loaded safely, or at another world size, is never resumed; an incomplete one is (the
    # user's resume is what is accepted: what it does without the missing part is evidence too)
    if any(ch.status != "pass" for ch in gate if ch.name in LOADING_GUARDS):
        return _finish(started, checks, tier, c, n, k, final, manifest=manifest, runs=runs, required=required)

    # 3. the resumed run, from checkpoint c
    out_r = run_dir / "resume-resumed" / "out"
    argv_r = substitute(spec.resume_words(), {**values, "{out}": str(out_r), "{checkpoint}": str(ckpt.path)})
    yield Message("resume", text=f"resumed run from {ckpt.name} to its end (step {reference.last_step() or final}), "
                                 "compared with the uninterrupted run")
    resumed = yield from run_command(spec, "resumed", argv_r, out_r, run_dir / "resume-resumed", "resume",
                                     total=reference.last_step() or final, cancelled=cancelled, backend=backend)
    runs["resumed"] = _summary(resumed)
    bad = verify_manifest(ckpt.path, manifest)
    checks.append(Check("manifest_after", "fail" if bad else "pass",
                        f"after the resumed run, the checkpoint's files changed: {', '.join(bad)}" if bad else
                        f"after the resumed run, the sha256 of the {len(manifest)} files still match"))
    if resumed.exit_code != 0:
        why = "timed out" if resumed.timed_out else f"exit status {resumed.exit_code}"
        checks.append(Check("resumed_run", "fail", f"the resume command failed ({why}): "
                                                   f"{failure_lines(resumed.log_path)} (see {resumed.log_path})"))
        return _finish(started, checks, tier, c, n, k, final, manifest=manifest, runs=runs, required=required)

    # 4. compared with the reference
    not_compared: list[str] = []
    step_checks, comparison = compare_steps(reference.steps, interrupted.steps, resumed.steps, c, tier, not_compared,
                                            resumed.trainer, twin.steps if twin is not None else None)
    checks += step_checks
    if trainer:
        checks.append(trainable_check(trainer, resumed.trainer))
    checks += compare_final(reference, resumed, final, tier, not_compared, trainer is not None, twin)
    return _finish(started, checks, tier, c, n, k, final, comparison, manifest, not_compared, runs, required,
                   [f"{o.name} run: {p}" for o in (twin, interrupted, resumed) if o is not None for p in o.problems],
                   twin.last_step() if twin is not None else None)


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


def _kill_checks(o: RunOutcome, trainer: bool, world: int, c: int, n: int, k: int, required: list[str]
                 ) -> tuple[Check, Check, Checkpoint | None]:
    """``kill``: the run was killed (it had not ended) and no process of it is left; ``kill_point``: where it was
    killed is after checkpoint c and before checkpoint n was complete. Returns them and checkpoint c, if there."""
    if o.kill is None:
        why = "timed out" if o.timed_out else f"exited with status {o.exit_code}{o.exit_note}"
        return (Check("kill", "fail", f"the interrupted run {why} before step {k} ({last_lines(o.log_path, 3)}); "
                                      "nothing was killed"),
                Check("kill_point", "fail", "no kill"), None)
    kill = Check("kill", "pass" if o.kill.clean else "fail", o.kill.evidence())
    ckpt = next((x for x in o.checkpoints if x.step == c), None)
    later = [x for x in o.at_kill if x.step > c and (complete(x, required) if required else True)]
    if trainer:
        ranks = sorted(o.hook.held)
        where = f"every rank ({', '.join(map(str, ranks))}) held after step {k}" if len(ranks) == world else \
            f"held on ranks {ranks} of {world}"
        ok = len(ranks) == world and all(int(e.get("step", 0)) == k for e in o.hook.held.values())
    else:
        seen = max((s.step for s in o.steps_seen()), default=0)
        where = f"killed when its metrics showed step {seen}"
        ok = seen >= k
    if later:
        ok = False
        where += f"; but {', '.join(x.name for x in later)} was already complete at the kill (the kill came after the " \
                 "next checkpoint: from outside a script is killed when its metrics show the step, and this one " \
                 "saved within that time; save less often than every step)"
    if ckpt is None:
        ok = False
        where += f"; no checkpoint of step {c} in its output folder"
    return kill, Check("kill_point", "pass" if ok else "fail", f"{where}: after checkpoint {c}, before {n}"), ckpt


def _checkpoint_checks(o: RunOutcome, ckpt: Checkpoint, c: int, required: list[str], manifest: dict[str, str],
                       trainer: dict[str, Any] | None, world: int) -> list[Check]:
    checks = []
    listed, skipped = o.checkpoints, o.skipped_checkpoints
    newest = [x for x in listed if complete(x, required)] if required else listed
    partial = [f"{x.name} is partial (missing {', '.join(missing_files(x.path, required))})"
               for x in listed if required and x.step > c and not complete(x, required)]
    top = newest[-1] if newest else None
    checks.append(Check("checkpoint_selection", "pass" if top is not None and top.step == c else "fail",
                        (f"resume from {top.name}, the newest complete checkpoint" if top else
                         "no complete checkpoint") + (f" (expected step {c})" if top is None or top.step != c else "")
                        + ("; skipped " + "; ".join(partial + skipped) if partial or skipped else ""),
                        kind="completeness"))
    if not required:
        checks.append(Check("checkpoint_complete", "fail", "the script is not Trainer-based, so gpuaccept does not know "
                                                           "what its checkpoint must hold: list the files in "
                                                           "command.checkpoint_files (weights, optimizer, scheduler, "
                                                           "RNG, progress)", kind="completeness"))
    else:
        missing = missing_files(ckpt.path, required)
        checks.append(Check("checkpoint_complete", "fail" if missing else "pass",
                            f"missing from {ckpt.name}: {', '.join(missing)}" if missing else
                            f"{ckpt.name} holds {', '.join(required)}", kind="completeness"))
    checks.append(Check("manifest", "pass" if manifest else "fail",
                        f"sha256 of {len(manifest)} files taken right after the kill" if manifest else
                        f"{ckpt.name} holds no file"))
    checks.append(safe_loading(ckpt.path, trainer is not None, world))
    if trainer is not None:
        import json

        try:
            state = json.loads((ckpt.path / "trainer_state.json").read_text(encoding="utf-8")).get("global_step")
        except (OSError, ValueError):
            state = None
        checks.append(Check("trainer_state", "pass" if state == c else "fail",
                            f"trainer_state.json global_step = {state} (expected {c})"))
        checks.append(world_size_check(ckpt.path, world))
    return checks


def safe_loading(ckpt: Path, trainer: bool, world: int) -> Check:
    """Every pickle of the checkpoint that a resume loads loads with ``torch.load`` with ``weights_only=True``: for Trainer
    the optimizer, scheduler, RNG states and GradScaler (it never loads ``training_args.bin``); for another script
    every file with a pickle's suffix (:data:`PICKLES`), since gpuaccept cannot know which ones it loads."""
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.suffix in PICKLES)
    if trainer:
        files = [p for p in files if p.name not in TRAINER_UNLOADED]
    refused = []
    for f in files:
        try:
            safe_load(f)
        except UntrustedCheckpoint as exc:
            refused.append(str(exc))
    names = ", ".join(str(f.relative_to(ckpt)) for f in files)
    if refused:
        return Check("safe_loading", "fail", "; ".join(refused))
    if not files:
        return Check("safe_loading", "pass", f"{ckpt.name} holds no pickle ({', '.join(PICKLES)}): nothing for "
                                             "torch.load to run")
    return Check("safe_loading", "pass", f"{names} load with weights_only=True" + (
        " (training_args.bin, a pickle of TrainingArguments Trainer never loads on resume, not loaded)" if trainer
        and (ckpt / "training_args.bin").is_file() else ""))


def _by_rank(steps: list[StepRecord]) -> dict[tuple[int, int], StepRecord]:
    return {(s.rank, s.step): s for s in steps}


def compare_steps(ref_steps: list[StepRecord], interrupted: list[StepRecord], resumed: list[StepRecord], c: int,
                  tier: Tier, not_compared: list[str], resumed_trainer: dict[str, Any] | None = None,
                  twin_steps: list[StepRecord] | None = None) -> tuple[list[Check], list[dict[str, Any]]]:
    """The step-by-step checks: ``global_steps`` (the resumed run logged exactly the reference's steps after c, on
    every rank; a resumed Trainer started at global step c), ``reproducible`` (before its kill the interrupted run
    equals the reference: the command gives the same run twice), then for the resumed run ``learning_rate`` and
    ``sample_ids`` (exact, where the metrics hold them) and ``loss`` (every step and rank within the bound: bit-exact,
    or ``multiple`` x the twin's largest loss difference over the compared steps, :mod:`core.stages.noise`).

    Returns:
        (the checks, one row per resumed step of rank 0: step, learning_rate, loss_reference, loss_resumed,
        difference, and loss_twin with a twin)."""
    if not ref_steps:
        return [Check("loss", "fail", "the uninterrupted run wrote no per-step metrics (none found: "
                                      "command.metrics), so nothing shows the resumed run continues as it did; "
                                      "write JSON lines with step and loss, or train with transformers' Trainer",
                      kind="tolerance", tier=tier.name)], []
    ref = _by_rank(ref_steps)
    want = sorted(key for key in ref if key[1] > c)
    got = sorted(_by_rank(resumed))
    start = f"; the resumed Trainer began at global step {resumed_trainer.get('global_step')}" if resumed_trainer \
        else ""
    ok = got == want and (resumed_trainer is None or resumed_trainer.get("global_step") == c)
    checks = [Check("global_steps", "pass" if ok else "fail",
                    f"resumed steps {_span(sorted({s for _, s in got}))}, expected {_span(sorted({s for _, s in want}))}"
                    f" (every step the uninterrupted run logged after {c}, {len({r for r, _ in want})} rank(s)){start}")]
    before = [(s, ref[(s.rank, s.step)]) for s in interrupted if (s.rank, s.step) in ref]
    pairs = [(s, ref[(s.rank, s.step)]) for s in resumed if (s.rank, s.step) in ref]
    noise, why_not = _noise(ref, twin_steps, [key for key in ref if any((s.rank, s.step) == key for s, _ in
                                                                        before + pairs)], tier)
    if why_not:
        checks.append(Check("loss", "fail", why_not, kind="tolerance", tier=tier.name))
        return checks, []
    if before:
        checks.append(_reproducible(before, tier, noise))
    else:
        not_compared.append("the interrupted run before the kill: it logged no step the uninterrupted run logged")
    for key, label in (("learning_rate", "learning rate"), ("sample_ids", "sample ids")):
        have = [(a, b) for a, b in pairs if getattr(a, key) is not None and getattr(b, key) is not None]
        if not have:
            not_compared.append(f"{label}: the metrics hold none" + (
                " (sample ids: a metrics line's sample_ids, or the Trainer hook's batch digests)" if key == "sample_ids"
                else ""))
            continue
        diff = sorted({a.step for a, b in have if getattr(a, key) != getattr(b, key)})
        checks.append(Check(key, "fail" if diff else "pass",
                            f"{label} of the resumed run differs at steps {_span(diff)}" if diff else
                            f"{label} of the resumed run equal at {len(have)} step(s)"))
    judged, bad = judge_losses([(a.step, a.loss, b.loss) for a, b in pairs], noise, tier)
    checks.append(Check("loss", "fail" if bad or not pairs else "pass",
                        (f"resumed loss outside the bound at steps {_span(bad)}; " if bad else "")
                        + (judged.describe(tier, "resumed losses (every rank)") if pairs else
                           "the resumed run logged no step the uninterrupted run logged"),
                        kind="tolerance", tier=tier.name, largest_difference=judged.distance, noise=judged.noise,
                        bound=judged.bound))
    twins = _by_rank(twin_steps or [])
    rows = [{"step": s.step, "learning_rate": s.learning_rate, "loss_reference": ref[(0, s.step)].loss,
             "loss_resumed": s.loss, "difference": abs(s.loss - ref[(0, s.step)].loss),
             **({"loss_twin": twins[(0, s.step)].loss} if (0, s.step) in twins else {})}
            for s in resumed if s.rank == 0 and (0, s.step) in ref]
    return checks, rows


def _noise(ref: dict[tuple[int, int], StepRecord], twin_steps: list[StepRecord] | None, keys: list[tuple[int, int]],
           tier: Tier) -> tuple[float | None, str]:
    """(the twin's largest loss difference from the reference over the (rank, step) ``keys`` compared, "") for a twin
    tier; (None, "") for an exact one; (None, why) when the twin did not log them."""
    if tier.exact:
        return None, ""
    twins = _by_rank(twin_steps or [])
    missing = sorted({step for rank, step in keys if (rank, step) not in twins})
    if twin_steps is None or missing:
        return None, (f"the twin run logged no loss at steps {_span(missing)}, so no noise bound could be measured"
                      if twin_steps is not None else "no twin run to measure the noise with")
    return loss_noise([(twins[key].loss, ref[key].loss) for key in keys]), ""


def _reproducible(before: list[tuple[StepRecord, StepRecord]], tier: Tier, noise: float | None) -> Check:
    """The interrupted run, before its kill, equals the uninterrupted one (loss within the bound, learning rate and
    samples exact): the command gives the same run twice. If not, no comparison after a resume can tell a bad resume
    from a run that differs anyway."""
    judged, bad = judge_losses([(a.step, a.loss, b.loss) for a, b in before], noise, tier)
    other = sorted({a.step for a, b in before if (a.learning_rate, a.sample_ids) != (b.learning_rate, b.sample_ids)
                    and a.learning_rate is not None and b.learning_rate is not None})
    steps = sorted({a.step for a, _ in before})
    if bad or other:
        return Check("reproducible", "fail",
                     f"before any kill, the interrupted run differs from the uninterrupted one at steps "
                     f"{_span(sorted(set(bad) | set(other)))} ({judged.describe(tier, 'losses')}): the command does "
                     "not give the same run twice, so no resume can be shown to continue it; seed everything it draws "
                     "(e.g. transformers.set_seed before building the model and its adapters) or make it "
                     "deterministic", kind="tolerance", tier=tier.name, largest_difference=judged.distance,
                     noise=judged.noise, bound=judged.bound)
    return Check("reproducible", "pass", f"before the kill, the interrupted run equals the uninterrupted one at steps "
                                         f"{_span(steps)} (learning rate and samples exactly; "
                                         f"{judged.describe(tier, 'losses')})",
                 kind="tolerance", tier=tier.name, largest_difference=judged.distance, noise=judged.noise,
                 bound=judged.bound)


def trainable_check(reference: dict[str, Any], resumed: dict[str, Any] | None) -> Check:
    """The resumed Trainer trains exactly the reference's tensors (the sha256 of their sorted names, and their
    parameters; exact)."""
    if resumed is None:
        return Check("trainable_set", "fail", "the resumed run reported no Trainer")
    same = (reference.get("trainable_names_sha256"), reference.get("trainable_parameters")) == \
        (resumed.get("trainable_names_sha256"), resumed.get("trainable_parameters"))
    return Check("trainable_set", "pass" if same else "fail",
                 f"{resumed.get('trainable_tensors')} trainable tensors, {resumed.get('trainable_parameters'):,} "
                 f"parameters" + (", as in the uninterrupted run" if same else
                                  f"; the uninterrupted run trained {reference.get('trainable_tensors')} / "
                                  f"{reference.get('trainable_parameters'):,}"))


def compare_final(reference: RunOutcome, resumed: RunOutcome, step: int, tier: Tier, not_compared: list[str],
                  trainer: bool = False, twin: RunOutcome | None = None) -> list[Check]:
    """At the reference's last checkpoint (step ``step``), the resumed run's checkpoint of the same step, file by
    file: every ``.safetensors`` file's tensors (``final_weights``, bound), every optimizer file (progress exact,
    moments bound: :func:`core.stages.resume.compare_optimizers`), every other pickle (RNG, scheduler, progress; exact)
    and, for a script that is not Trainer-based, every JSON file (numbers within the bound, the rest exact) as
    ``states``. The bounds are the tier's (:mod:`core.stages.noise`): bit-exact, or from the ``twin``'s checkpoint of
    the same step. A Trainer checkpoint's JSON files are its configs (peft writes ``target_modules`` from a set, in no
    fixed order) and its trainer state (timings, paths; its steps are compared above); they and other files (text)
    are listed in ``not_compared``."""
    a = next((x for x in reference.checkpoints if x.step == step), None)
    b = next((x for x in resumed.checkpoints if x.step == step), None)
    if a is None or b is None:
        have = ", ".join(x.name for x in resumed.checkpoints) or "none"
        return [Check("final_checkpoint", "fail", f"the resumed run wrote no checkpoint of step {step} to compare with "
                                                  f"the uninterrupted run's (it wrote {have})")]
    t = None
    if twin is not None and not tier.exact:
        t = next((x for x in twin.checkpoints if x.step == step), None)
        if t is None:
            have = ", ".join(x.name for x in twin.checkpoints) or "none"
            return [Check("final_checkpoint", "fail", f"the twin run wrote no checkpoint of step {step} to measure the "
                                                      f"noise with (it wrote {have})")]
    names = sorted(str(p.relative_to(a.path)) for p in a.path.rglob("*") if p.is_file())
    missing = [n for n in names if not (b.path / n).is_file() or (t is not None and not (t.path / n).is_file())]
    checks = [Check("final_checkpoint", "fail" if missing else "pass",
                    f"{b.name} of the resumed (or twin) run lacks {', '.join(missing)}" if missing else
                    f"{b.name} of both runs holds the same {len(names)} files")]
    weights = [n for n in names if n.endswith(".safetensors") and n not in missing]
    if weights:
        checks.append(_compare_safetensors(a.path, b.path, weights, tier, t.path if t is not None else None))
    else:
        not_compared.append(f"weights as tensors: {a.name} holds no .safetensors file (a pickle's tensors, if any, "
                            "are compared exactly under states)")
    if not any("optim" in Path(n).name and Path(n).suffix in PICKLES for n in names):
        not_compared.append(f"the optimizer's state: {a.name} of the uninterrupted run holds no optimizer file (no "
                            "*optim*.pt), so its moments and step counts were not compared")
    states: list[str] = []
    other: list[str] = []
    for n in names:
        if n in missing or n.endswith(".safetensors"):
            continue
        if n.endswith(".json") and not trainer:
            states.append(n)
        elif Path(n).suffix in PICKLES and Path(n).name not in TRAINER_UNLOADED:
            if "optim" in Path(n).name:
                for ch in compare_optimizers(a.path / n, b.path / n, tier, t.path / n if t is not None else None):
                    checks.append(Check(ch.name, ch.status, f"{n}: {ch.evidence}", ch.kind, ch.tier,
                                        ch.largest_difference, ch.noise, ch.bound))
            else:
                states.append(n)
        else:
            other.append(n)
    if other:
        not_compared.append(f"in {b.name}: {', '.join(other)} (not a tensor or JSON state: text, Trainer's own state "
                            "with its timings and paths, or its pickled TrainingArguments; the steps are compared "
                            "step by step above)")
    if states:
        checks.append(_compare_states(a.path, b.path, states, tier, t.path if t is not None else None))
    return checks


def _compare_safetensors(a: Path, b: Path, names: list[str], tier: Tier, t: Path | None = None) -> Check:
    """``final_weights``: every tensor of the ``.safetensors`` files ``names`` of the resumed run's checkpoint ``b``
    against the reference's ``a``, bounded by the twin's ``t`` (:func:`core.stages.noise.judge_tensors`)."""
    from safetensors.torch import load_file

    ref: dict[str, Any] = {}
    res: dict[str, Any] = {}
    twin: dict[str, Any] | None = {} if t is not None else None
    for n in names:
        ref.update({f"{n}:{k}": v for k, v in load_file(str(a / n)).items()})
        res.update({f"{n}:{k}": v for k, v in load_file(str(b / n)).items()})
        if twin is not None and t is not None:
            twin.update({f"{n}:{k}": v for k, v in load_file(str(t / n)).items()})
    try:
        judged = judge_tensors(ref, res, twin, tier)
    except ValueError as exc:
        return Check("final_weights", "fail", f"{', '.join(names)}: {exc}", kind="tolerance", tier=tier.name)
    return Check("final_weights", "pass" if judged.ok else "fail",
                 judged.describe(tier, f"tensors of {', '.join(names)}"), kind="tolerance", tier=tier.name,
                 largest_difference=judged.distance, noise=judged.noise, bound=judged.bound)


def _compare_states(a: Path, b: Path, names: list[str], tier: Tier, t: Path | None = None) -> Check:
    """The other pickles (RNG, scheduler, progress), loaded with ``weights_only=True``, equal exactly; JSON files
    equal, their numbers within the bound (:func:`first_difference`: bit-exact, or ``multiple`` x the twin's
    difference from the reference at the same place)."""
    import json

    differ = []
    for n in names:
        try:
            if n.endswith(".json"):
                x, y = (json.loads((d / n).read_text(encoding="utf-8")) for d in (b, a))
                z = json.loads((t / n).read_text(encoding="utf-8")) if t is not None else None
            else:
                x, y, z = safe_load(b / n), safe_load(a / n), None
        except UntrustedCheckpoint as exc:
            differ.append(str(exc))
            continue
        except (OSError, ValueError) as exc:
            differ.append(f"{n}: unreadable ({exc})")
            continue
        where = first_difference(x, y, twin=z, multiple=tier.multiple if n.endswith(".json") else 0.0)
        if where is not None:
            differ.append(f"{n} differs at {where or 'the top'}")
    return Check("states", "fail" if differ else "pass",
                 "; ".join(differ) if differ else f"{', '.join(names)} equal"
                 + (" (exact)" if tier.exact else f" (pickles exact, JSON numbers within {tier.multiple:g} x the "
                                                  "twin's difference at the same place)"))


def first_difference(x: Any, y: Any, path: str = "", twin: Any = None, multiple: float = 0.0) -> str | None:
    """The path of the first place two loaded pickles (or JSON documents) differ ("" at the top), or None when
    equal: dicts by key, lists and tuples by position, tensors by value (``torch.equal``), numpy arrays by value,
    floats within ``multiple`` x ``|twin - y|`` at the same place (``twin`` None or ``multiple`` 0: exact), anything
    else by ``==``."""
    import torch

    if isinstance(x, float) and isinstance(y, (int, float)) and not isinstance(y, bool) and multiple \
            and isinstance(twin, (int, float)) and not isinstance(twin, bool):
        return None if abs(x - y) <= multiple * abs(twin - y) or x == y else path
    if isinstance(x, dict) and isinstance(y, dict):
        if x.keys() != y.keys():
            return f"{path} (keys {sorted(map(str, x.keys() ^ y.keys()))[:3]})"
        for k in x:
            found = first_difference(x[k], y[k], f"{path}.{k}" if path else str(k),
                                     twin.get(k) if isinstance(twin, dict) else None, multiple)
            if found is not None:
                return found
        return None
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        if len(x) != len(y):
            return f"{path} (lengths {len(x)} vs {len(y)})"
        for i, (u, v) in enumerate(zip(x, y)):
            other = twin[i] if isinstance(twin, (list, tuple)) and i < len(twin) else None
            found = first_difference(u, v, f"{path}[{i}]", other, multiple)
            if found is not None:
                return found
        return None
    if torch.is_tensor(x) and torch.is_tensor(y):
        return None if x.shape == y.shape and x.dtype == y.dtype and bool(torch.equal(x, y)) else path
    if hasattr(x, "shape") and hasattr(x, "tobytes") and hasattr(y, "tobytes"):  # numpy
        return None if x.shape == y.shape and x.tobytes() == y.tobytes() else path
    try:
        return None if bool(x == y) else path
    except (TypeError, ValueError, RuntimeError):
        return path


def _finish(started: float, checks: list[Check], tier: Tier, c: int | None = None, n: int | None = None,
            k: int | None = None, final: int | None = None, comparison: list[dict[str, Any]] | None = None,
            manifest: dict[str, str] | None = None, not_compared: list[str] | None = None,
            runs: dict[str, RunSummary] | None = None, required: list[str] | None = None,
            findings: list[str] | None = None, twin_final: int | None = None) -> CommandResume:
    status = "pass" if checks and all(ch.status == "pass" for ch in checks) else "fail"
    failed = [ch.name for ch in checks if ch.status != "pass"]
    extra = f"; not compared: {'; '.join(not_compared)}" if not_compared else ""
    summary = (f"killed at step {k} after checkpoint {c}, resumed from it, compared up to step {final}: "
               f"{len(checks)} checks passed ({tier.name}){extra}" if status == "pass" else
               f"failed: {', '.join(failed)}: " + "; ".join(ch.evidence for ch in checks if ch.status != "pass")[:600])
    return CommandResume(status=status, summary=summary, checks=checks, checkpoint_step=c, next_checkpoint_step=n,
                         kill_step=k, final_checkpoint_step=final, tier=tier, comparison=comparison or [],
                         manifest=manifest or {}, not_compared=not_compared or [], runs=runs or {},
                         required_files=required or [], seconds=time.perf_counter() - started,
                         findings=findings or [], twin_final_step=twin_final)
