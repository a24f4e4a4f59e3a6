"""The checkpoint a kill left, checked before anything loads it: one set of rules for both subjects, gpuaccept's
recipe (:mod:`core.stages.resume`) and a user's command (:mod:`core.command.resume`).

- what a run's output folder holds (:func:`list_checkpoints`: the folders matching a glob, by the step in their name);
- what a resumable checkpoint must hold (:func:`trainer_files`: transformers Trainer's set; a script names its own,
  :func:`listed_files`) and whether it does (:func:`missing`, :func:`complete_check`);
- which one a resume starts from (:func:`select_checkpoint`, :func:`selection_check`): the newest complete one;
- whether its pickles load safely (:func:`safe_loading`), its trainer state names its step
  (:func:`trainer_state_check`), and it was written at the world size it is resumed at (:func:`world_size_check`).

Each check returns a :class:`core.stages.compare.Check`; the ``kind`` of selection and completeness is
``completeness``, of the others ``exact``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from core.stages.compare import Check
from core.stages.states import PICKLE_SUFFIXES, TRAINER_UNLOADED, pickles_load_safely
from core.status import StageStatus

#: component -> file name: what a checkpoint must hold to resume (Trainer's names, or a script's own)
Files = Mapping[str, str]


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint of a run: its step (the last number of its name) and its folder."""

    step: int
    path: Path

    @property
    def name(self) -> str:
        return self.path.name


_NUMBER = re.compile(r"(\d+)")


def step_of(name: str) -> int | None:
    """The last number in a checkpoint's name (``checkpoint-12`` -> 12, ``step_000400.pt`` -> 400), or None."""
    numbers = _NUMBER.findall(name)
    return int(numbers[-1]) if numbers else None


def list_checkpoints(out_dir: Path, pattern: str = "checkpoint-*") -> tuple[list[Checkpoint], list[str]]:
    """The checkpoints matching ``pattern`` inside ``out_dir``, by step; and the names skipped (no number in the
    name, or a file: a checkpoint is read as a folder of files). Two checkpoints of one step: the later name wins,
    both are named."""
    found: dict[int, Checkpoint] = {}
    skipped: list[str] = []
    if not out_dir.is_dir():
        return [], skipped
    for path in sorted(out_dir.glob(pattern)):
        step = step_of(path.name)
        if not path.is_dir():
            skipped.append(f"{path.name}: a file, not a folder (checkpoints are read as folders of files)")
            continue
        if step is None:
            skipped.append(f"{path.name}: no step number in its name")
            continue
        if step in found:
            skipped.append(f"{found[step].name} and {path.name} are both step {step}")
        found[step] = Checkpoint(step, path)
    return [found[s] for s in sorted(found)], skipped


def trainer_files(adapter: bool, fp16: bool, world_size: int = 1, ranks: Sequence[int] | None = None) -> dict[str, str]:
    """The files a Trainer checkpoint must hold to resume, by component (transformers' ``Trainer._save_checkpoint``):
    the adapter (a PeftModel) or the model's weights, optimizer, scheduler, trainer state, one RNG state per process
    (``rng_state_<rank>.pth`` under torchrun, ``world_size`` > 1; ``ranks``: the ranks whose RNG states this
    checkpoint holds, several nodes: one node's; None: every rank), and the GradScaler with fp16. The weights,
    optimizer (DDP: rank 0's, the same on every rank; FSDP: a full state dict gathered to rank 0), scheduler and
    trainer state are written once."""
    files = {"adapter weights" if adapter else "model weights":
             "adapter_model.safetensors" if adapter else "model.safetensors",
             "optimizer": "optimizer.pt", "scheduler": "scheduler.pt", "trainer state": "trainer_state.json"}
    if world_size > 1:
        files.update({f"RNG state of rank {r}": f"rng_state_{r}.pth"
                      for r in (range(world_size) if ranks is None else ranks)})
    else:
        files["RNG state"] = "rng_state.pth"
    if fp16:
        files["GradScaler"] = "scaler.pt"
    return files


def listed_files(names: Iterable[str]) -> dict[str, str]:
    """The files a script's checkpoint must hold as its user listed them (``command.checkpoint_files``): each file is
    its own component."""
    return {name: name for name in names}


def _named(component: str, name: str) -> str:
    return name if component == name else f"{component} ({name})"


def missing(ckpt: Path, files: Files) -> list[str]:
    """The components of ``files`` absent from ``ckpt``, each as ``component (file)``; a sharded model's weights
    count as present when its index is there (``model.safetensors`` -> ``model.safetensors.index.json``, as
    ``save_pretrained`` writes a model over its shard size)."""
    out = []
    for component, name in files.items():
        if (ckpt / name).is_file():
            continue
        if name.endswith(".safetensors") and (ckpt / f"{name}.index.json").is_file():
            continue
        out.append(_named(component, name))
    return out


def is_complete(ckpt: Path, files: Files) -> bool:
    """``ckpt`` holds every one of ``files`` (none named: gpuaccept cannot tell, and it is not)."""
    return bool(files) and not missing(ckpt, files)


#: why a checkpoint with no file named is not called complete
NO_FILES_NAMED = ("the script is not Trainer-based, so gpuaccept does not know what its checkpoint must hold: list "
                  "the files in command.checkpoint_files (weights, optimizer, scheduler, RNG, progress)")


def complete_check(ckpt: Path, files: Files) -> Check:
    """``checkpoint_complete``: every component a resume needs is in ``ckpt`` (case R6): fail, naming each missing
    component and its file; fail too when no file is named (a script's checkpoint whose files its user did not list).

    Trainer itself loads the optimizer and scheduler only when both files exist and only logs a missing RNG state;
    this check fails instead of warning."""
    if not files:
        return Check("checkpoint_complete", StageStatus.FAIL, NO_FILES_NAMED, kind="completeness")
    absent = missing(ckpt, files)
    if absent:
        return Check("checkpoint_complete", StageStatus.FAIL, "missing: " + ", ".join(absent), kind="completeness")
    return Check("checkpoint_complete", StageStatus.PASS,
                 "present: " + ", ".join(_named(c, n) for c, n in files.items()), kind="completeness")


def trainer_global_step(ckpt: Path) -> int | None:
    """The ``global_step`` of Trainer's ``trainer_state.json`` in ``ckpt`` (None: no such file, or unreadable)."""
    try:
        step = json.loads((ckpt / "trainer_state.json").read_text(encoding="utf-8")).get("global_step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def trainer_state_check(ckpt: Path, c: int) -> Check:
    """``trainer_state``: Trainer's ``trainer_state.json`` of checkpoint c says global step c."""
    state = trainer_global_step(ckpt)
    return Check("trainer_state", StageStatus.judged(state == c),
                 f"trainer_state.json global_step = {state} (expected {c})")


@dataclass(frozen=True)
class Selection:
    """The checkpoint a resume should start from: the newest complete one; ``skipped`` names newer partial ones (and
    what the listing skipped)."""

    checkpoint: Checkpoint | None
    skipped: list[str]

    @property
    def step(self) -> int | None:
        return self.checkpoint.step if self.checkpoint is not None else None


def select_checkpoint(listed: Sequence[Checkpoint], files: Files, skipped: Sequence[str] = ()) -> Selection:
    """The newest of ``listed`` that holds every one of ``files`` (:func:`missing`) and, when Trainer's state is one
    of them, whose ``trainer_state.json`` says its step; newer partial ones (a kill during the write) are skipped with
    the reason. With no file named (a script's checkpoint whose files gpuaccept does not know) the newest listed.

    transformers' ``get_last_checkpoint`` takes the highest step whatever it holds; Trainer writes a checkpoint in
    place (weights, then optimizer and scheduler, GradScaler, RNG state, trainer state last), so a kill mid-write
    leaves a partial folder with the highest step."""
    passed = list(skipped)
    for ckpt in sorted(listed, key=lambda x: x.step, reverse=True):
        if not files:
            return Selection(ckpt, passed)
        absent = missing(ckpt.path, files)
        if absent:
            passed.append(f"{ckpt.name} is partial (missing: {', '.join(absent)})")
            continue
        if "trainer_state.json" in files.values():
            step = trainer_global_step(ckpt.path)
            if step != ckpt.step:
                passed.append(f"{ckpt.name}: trainer_state.json says global step {step}")
                continue
        return Selection(ckpt, passed)
    return Selection(None, passed)


def selection_check(selection: Selection, c: int) -> Check:
    """``checkpoint_selection``: the newest complete checkpoint is checkpoint c; partial newer ones are named (a
    resume must not take them)."""
    skipped = ("; skipped " + "; ".join(selection.skipped)) if selection.skipped else ""
    if selection.checkpoint is None:
        return Check("checkpoint_selection", StageStatus.FAIL, "no complete checkpoint to resume from" + skipped,
                     kind="completeness")
    ok = selection.checkpoint.step == c
    return Check("checkpoint_selection", StageStatus.judged(ok),
                 f"resume from {selection.checkpoint.name}, the newest complete checkpoint"
                 + ("" if ok else f" (expected step {c})") + skipped, kind="completeness")


def safe_loading(ckpt: Path, trainer: bool) -> Check:
    """``safe_loading``: every pickle of ``ckpt`` a resume loads loads with ``torch.load`` with ``weights_only=True``
    (case R8; :func:`core.stages.states.pickles_load_safely`), else fail naming the file (the resume is not run).
    Under Trainer (``trainer``) every pickle but those it never loads on resume (``training_args.bin``:
    :data:`core.stages.states.TRAINER_UNLOADED`); for another script every file with a pickle's suffix
    (:data:`core.stages.states.PICKLE_SUFFIXES`), since gpuaccept cannot know which ones it loads."""
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.suffix in PICKLE_SUFFIXES)
    if trainer:
        files = [p for p in files if p.name not in TRAINER_UNLOADED]
    unloaded = trainer and (ckpt / "training_args.bin").is_file()
    return pickles_load_safely(ckpt, files, " (training_args.bin, a pickle of TrainingArguments Trainer never loads "
                                            "on resume, not loaded)" if unloaded else "")


def checkpoint_world_size(ckpt: Path) -> int | None:
    """How many processes wrote ``ckpt``, from Trainer's RNG files: ``rng_state.pth`` = 1, ``rng_state_<r>.pth`` =
    the highest r + 1; None when it holds neither."""
    ranks = rng_ranks(ckpt)
    if ranks:
        return max(ranks) + 1
    return 1 if (ckpt / "rng_state.pth").is_file() else None


def rng_ranks(ckpt: Path) -> list[int]:
    """The ranks whose RNG states ``ckpt`` holds (``rng_state_<r>.pth``), sorted."""
    return sorted(int(m.group(1)) for p in ckpt.glob("rng_state_*.pth")
                  if (m := re.fullmatch(r"rng_state_(\d+)\.pth", p.name)))


def world_size_check(ckpt: Path, resume_world: int, ranks: Sequence[int] | None = None) -> Check:
    """``world_size``: the resume runs at the world size the checkpoint was written at (exact). Trainer resumes at
    another world size with only a log line: each rank's RNG file is missing or another rank's, the sampler splits the
    data into other shards and the global batch changes, so the run that continues is not the one that was
    checkpointed.

    ``ranks`` (several nodes): this node's ranks of the run that wrote it; its checkpoint holds their RNG states and
    only theirs (each node keeps its own), and the resume restarts the same world."""
    if ranks is not None and tuple(ranks) != tuple(range(resume_world)):
        held = rng_ranks(ckpt)
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


#: the checks of the checkpoint a kill left whose failure stops the resume: nothing changed since the kill, unsafe to
#: unpickle, of another step or written at another world size is loaded
LOADING_GUARDS = ("manifest", "safe_loading", "trainer_state", "world_size")
#: with these, the resume of an incomplete checkpoint (or not the newest complete one) does not start either
SELECTION_GUARDS = ("checkpoint_selection", "checkpoint_complete")


def gate_checks(selection: Selection, ckpt: Path, c: int, files: Files, manifest: Mapping[str, str], trainer: bool,
                resume_world: int, ranks: Sequence[int] | None = None) -> list[Check]:
    """The checks of checkpoint ``ckpt`` (step ``c``) before anything loads it, in the order a person reads them:
    ``checkpoint_selection`` (the newest complete one is c: ``selection``), ``checkpoint_complete`` (every one of
    ``files``), ``manifest`` (the sha256 ``manifest`` taken right after the kill holds its files, and they still
    match it), ``safe_loading``, and under Trainer (``trainer``) ``trainer_state`` (it says step c) and
    ``world_size`` (written at ``resume_world``; ``ranks``: several nodes, this node's)."""
    from core.protocol.manifest import verify_manifest

    bad = verify_manifest(ckpt, dict(manifest)) if manifest else []
    checks = [selection_check(selection, c), complete_check(ckpt, files),
              Check("manifest", StageStatus.judged(bool(manifest) and not bad),
                    ("sha256 mismatch: " + ", ".join(bad)) if bad else
                    f"sha256 of {len(manifest)} files taken right after the kill" if manifest else
                    f"{ckpt.name} holds no file"),
              safe_loading(ckpt, trainer)]
    if trainer:
        checks += [trainer_state_check(ckpt, c), world_size_check(ckpt, resume_world, ranks)]
    return checks


def may_load(checks: Sequence[Check], incomplete: bool) -> bool:
    """Whether the resume may start after the gate's ``checks``: every loading guard passed (:data:`LOADING_GUARDS`);
    unless ``incomplete`` (a user's resume of whatever its checkpoint holds: what it does without the missing part is
    evidence too), the selection and completeness too (:data:`SELECTION_GUARDS`)."""
    guards = LOADING_GUARDS if incomplete else LOADING_GUARDS + SELECTION_GUARDS
    return all(ch.status == StageStatus.PASS for ch in checks if ch.name in guards)
