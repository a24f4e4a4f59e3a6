"""The saved states of two runs compared, for both subjects (gpuaccept's recipe, core/stages/resume.py; a user's
command, core/command/resume.py): what a resume must have restored, read back from the checkpoints it wrote.

- :func:`safe_load`: every pickle is read with ``torch.load(weights_only=True)``; anything else is refused, named
  (:class:`UntrustedCheckpoint`), never executed.
- :func:`compare_weights`, :func:`compare_optimizers`, :func:`compare_optimizer_states`: the final weights and the
  optimizer's moments within the tier's bound (:mod:`core.stages.noise`: bit-exact, or the twins' spread), its step
  counts exactly; :func:`compare_scalers`: the fp16 GradScaler exactly.
- :func:`compare_final_files`: two checkpoint folders file by file, whatever wrote them (Trainer's, a hand-written
  loop's pickles and JSON, a torch.distributed.checkpoint made whole by :func:`dcp_as_files`).

Every tolerance check keeps what it is computed from (``evidence_rows``: its tensors' distances, its noise family,
the files it read: :func:`core.stages.noise.file_rows`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from core.stages.compare import Check
from core.stages.noise import Family, Tier, file_rows, judge_tensors, optimizer_state_tensors
from core.status import StageStatus

#: suffixes of the files read as pickles (``torch.load``)
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".ckpt")


class UntrustedCheckpoint(Exception):
    """A checkpoint file that cannot be loaded with ``torch.load(weights_only=True)`` (it needs arbitrary code)."""


def safe_load(path: Path) -> Any:
    """``torch.load(path, weights_only=True)`` under transformers' allow-list of numpy RNG types (as Trainer loads
    ``rng_state.pth``); nothing else is ever used to read a checkpoint pickle.

    Raises:
        UntrustedCheckpoint: the file holds objects the weights-only unpickler refuses (a pickle of arbitrary
            objects) or is not a torch file; the message names the file.
    """
    import pickle

    import torch

    try:
        from transformers.trainer_pt_utils import safe_globals
    except ImportError:  # an older transformers: torch's own allow-list only
        import contextlib

        safe_globals = contextlib.nullcontext
    try:
        with safe_globals():
            return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UntrustedCheckpoint(f"{path.name}: refused, it cannot be loaded with weights_only=True ({first[:160]})") \
            from None


def pickles_load_safely(ckpt: Path, files: list[Path], note: str = "") -> Check:
    """``safe_loading``, one check for both modes: every one of ``files`` (the pickles of checkpoint ``ckpt`` a resume
    loads: the recipe's by name, command mode's by suffix) loads with :func:`safe_load`; a refused file fails the check,
    named. ``note`` ends a passing evidence (what was left unloaded, and why)."""
    refused = []
    for f in files:
        try:
            safe_load(f)
        except UntrustedCheckpoint as exc:
            refused.append(str(exc))
    if refused:
        return Check("safe_loading", StageStatus.FAIL, "; ".join(refused))
    if not files:
        return Check("safe_loading", StageStatus.PASS, f"{ckpt.name} holds no pickle ({', '.join(PICKLE_SUFFIXES)}): "
                                                       "nothing for torch.load to run")
    return Check("safe_loading", StageStatus.PASS, f"{', '.join(str(f.relative_to(ckpt)) for f in files)} load with "
                                                   f"weights_only=True{note}")


def compare_weights(ref_file: Path, res_file: Path, tier: Tier, family_files: Sequence[Path] | None = None,
                    kin: Family | None = None) -> Check:
    """``final_weights``: the final trainable weights of the resumed run against the reference's (safetensors, no
    pickle), per tensor, bounded by the spread of the noise family (``family_files``, in the order of
    ``kin.members``), or bit-exact (:func:`core.stages.noise.judge_tensors`)."""
    from safetensors.torch import load_file

    family_files = list(family_files or ()) if not tier.exact else []
    for f in [ref_file, res_file, *family_files]:
        if not f.is_file():
            return Check("final_weights", StageStatus.FAIL, f"{f} missing", kind="tolerance", tier=tier.name)
    a, b = load_file(str(res_file)), load_file(str(ref_file))
    family = [load_file(str(f)) for f in family_files] or None
    try:
        judged = judge_tensors(b, a, family, tier, kin)
    except ValueError as exc:
        return Check("final_weights", StageStatus.FAIL, str(exc), kind="tolerance", tier=tier.name)
    files = file_rows(_run_files(ref_file, res_file, family_files, kin), "safetensors")
    return Check("final_weights", StageStatus.judged(judged.ok), judged.describe(tier, f"tensors of {res_file.name}"),
                 kind="tolerance", tier=tier.name, largest_difference=judged.distance, noise=judged.noise,
                 bound=judged.bound, evidence_rows={**(judged.evidence or {}), "files": files})


def _run_files(ref_file: Path, res_file: Path, family_files: Sequence[Path], kin: Family | None
               ) -> list[tuple[str, Path]]:
    """(member, file) of the reference, the resumed run and each twin of the noise family (the reference once)."""
    twins = [(m, f) for m, f in zip(kin.members, family_files) if m != "reference"] if kin is not None else []
    return [("reference", ref_file), ("resumed", res_file), *twins]


def compare_optimizers(ref_file: Path, res_file: Path, tier: Tier, family_files: Sequence[Path] | None = None,
                       kin: Family | None = None) -> list[Check]:
    """Optimizer step counts and param-group sizes (``optimizer_progress``, exact), moments (``optimizer_moments``:
    per state tensor, bounded by the noise family's spread (``family_files``, in the order of ``kin.members``) or
    bit-exact; bitsandbytes' 8-bit states dequantised: :func:`core.stages.noise.optimizer_state_tensors`); loaded
    with ``weights_only=True``."""
    family_files = list(family_files or ()) if not tier.exact else []
    for f in [ref_file, res_file, *family_files]:
        if not f.is_file():
            return [Check("optimizer_state", StageStatus.FAIL, f"{f} missing")]
    try:
        a, b = safe_load(res_file), safe_load(ref_file)
        family = [safe_load(f) for f in family_files] or None
    except UntrustedCheckpoint as exc:
        return [Check("optimizer_state", StageStatus.FAIL, str(exc))]
    files = file_rows(_run_files(ref_file, res_file, family_files, kin), "optimizer")
    return [replace(c, evidence_rows={**c.evidence_rows, "files": files}) if c.evidence_rows is not None else c
            for c in compare_optimizer_states(a, b, tier, family, kin)]


def is_optimizer_state(obj: Any) -> bool:
    """``obj`` is a ``torch.optim.Optimizer.state_dict()``: a dict with ``state`` and ``param_groups``."""
    return isinstance(obj, dict) and isinstance(obj.get("state"), dict) and isinstance(obj.get("param_groups"), list)


def compare_optimizer_states(a: dict[str, Any], b: dict[str, Any], tier: Tier,
                             family: Sequence[dict[str, Any]] | None = None, kin: Family | None = None
                             ) -> list[Check]:
    """:func:`compare_optimizers` on loaded optimizer state dicts: ``a`` the resumed run's, ``b`` the reference's,
    ``family`` the noise family's, in the order of ``kin.members`` (None on an exact tier)."""
    sizes_a = [len(g["params"]) for g in a["param_groups"]]
    sizes_b = [len(g["params"]) for g in b["param_groups"]]
    steps_a = sorted({float(s["step"]) for s in a["state"].values() if "step" in s})
    steps_b = sorted({float(s["step"]) for s in b["state"].values() if "step" in s})
    exact_ok = sizes_a == sizes_b and steps_a == steps_b and a["state"].keys() == b["state"].keys()
    checks = [Check("optimizer_progress", StageStatus.judged(exact_ok),
                    f"param-group sizes {sizes_a} vs {sizes_b}; optimizer step counts {steps_a} vs {steps_b}"
                    + ("" if exact_ok else ": the optimizer did not continue from the checkpoint's state"))]
    ta, tb = optimizer_state_tensors(a["state"]), optimizer_state_tensors(b["state"])
    tt = [optimizer_state_tensors(t["state"]) for t in family] if family is not None else None
    if ta.keys() != tb.keys():
        checks.append(Check("optimizer_moments", StageStatus.FAIL,
                            f"state tensors differ in name: {sorted(ta.keys() ^ tb.keys())[:3]}", kind="tolerance",
                            tier=tier.name))
        return checks
    if not ta:  # nothing compared is no evidence: a layout this check cannot read must not pass
        checks.append(Check("optimizer_moments", StageStatus.FAIL, "no state tensor found in the optimizer state to "
                                                                    "compare (an empty state, or a layout this check "
                                                                    "does not read)", kind="tolerance", tier=tier.name))
        return checks
    try:
        judged = judge_tensors(tb, ta, tt, tier, kin)
    except ValueError as exc:
        checks.append(Check("optimizer_moments", StageStatus.FAIL, str(exc), kind="tolerance", tier=tier.name))
        return checks
    checks.append(Check("optimizer_moments", StageStatus.judged(judged.ok),
                        judged.describe(tier, "optimizer state tensors (8-bit states dequantised)"
                                        if any(k.endswith(("state1", "state2")) for k in ta) else "optimizer state tensors"),
                        kind="tolerance", tier=tier.name, largest_difference=judged.distance, noise=judged.noise,
                        bound=judged.bound, evidence_rows=judged.evidence))
    return checks


def compare_scalers(ref_file: Path, res_file: Path) -> Check:
    """Case R7 (fp16): the GradScaler state of the resumed run equals the reference's at the same step (scale, growth
    tracker; exact: both runs took the same overflow decisions), loaded with ``weights_only=True``. A restarted scale
    (2^16 after a resume) is caught here."""
    for f in (ref_file, res_file):
        if not f.is_file():
            return Check("grad_scaler", StageStatus.FAIL,
                         f"{f.name} missing in {f.parent.name}: the loss scale was not saved")
    try:
        a, b = safe_load(res_file), safe_load(ref_file)
    except UntrustedCheckpoint as exc:
        return Check("grad_scaler", StageStatus.FAIL, str(exc))
    keys = ("scale", "growth_tracker")
    got = {k: float(a.get(k, float("nan"))) for k in keys}
    want = {k: float(b.get(k, float("nan"))) for k in keys}
    return Check("grad_scaler", StageStatus.judged(got == want),
                 f"resumed scale {got['scale']:g}, growth tracker {got['growth_tracker']:g}; reference "
                 f"{want['scale']:g}, {want['growth_tracker']:g}")


#: files Trainer writes that a resume never loads: a pickle of TrainingArguments (not weights-only loadable) and
#: peft's model card
TRAINER_UNLOADED = ("training_args.bin", "README.md")


@dataclass(frozen=True)
class Noisy:
    """The noise family's folders (``folders``, in the order of ``kin.members``: the reference's among them where it
    is one), what a tolerance check of the last checkpoint is bounded by."""

    folders: list[Path]
    kin: Family

    def files(self, name: str) -> list[Path]:
        return [f / name for f in self.folders]


def compare_final_files(a: Path, b: Path, fam: Noisy | None, tier: Tier, not_compared: list[str],
                        trainer: bool = False) -> list[Check]:
    """The last checkpoints of two runs compared file by file: ``a`` the reference's checkpoint folder, ``b`` the
    resumed run's of the same step, ``fam`` the noise family's folders (None on an exact tier): every
    ``.safetensors`` file's tensors (``final_weights``, bound), every optimizer file (progress exact, moments bound:
    :func:`compare_optimizers`), every other pickle taken apart (:class:`PickledParts`: weights bound, an optimizer's
    state as the optimizer, the rest exact) and, for a script that is not Trainer-based (``trainer`` False), every
    JSON file (numbers within the bound, the rest exact) as ``states``. A Trainer checkpoint's JSON files are its
    configs and its trainer state (timings, paths; its steps are compared step by step); they and other files (text)
    are listed in ``not_compared``."""
    names = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    missing = [n for n in names if not (b / n).is_file() or
               (fam is not None and not all(f.is_file() for f in fam.files(n)))]
    checks = [Check("final_checkpoint", StageStatus.judged(not missing),
                    f"{b.name} of the resumed (or twin) run lacks {', '.join(missing)}" if missing else
                    f"{b.name} of both runs holds the same {len(names)} files")]
    files = FinalFiles.sort([n for n in names if n not in missing], trainer)
    if files.weights:
        checks.append(_compare_safetensors(a, b, files.weights, tier, fam))
    for n in files.optimizers:
        checks += [_named(ch, n) for ch in compare_optimizers(a / n, b / n, tier,
                                                               fam.files(n) if fam is not None else None,
                                                               fam.kin if fam is not None else None)]
    if files.other:
        not_compared.append(f"in {b.name}: {', '.join(files.other)} (not a tensor or JSON state: text, Trainer's own "
                            "state with its timings and paths, or its pickled TrainingArguments; the steps are "
                            "compared step by step above)")
    pickles = [n for n in files.states if not n.endswith(".json")]
    parts = _pickled_parts(a, b, pickles, fam)
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
        checks.append(_compare_states(a, b, states, tier, fam, parts.rest))
    return checks


def is_dcp(folder: Path) -> bool:
    """The folder is a torch.distributed.checkpoint (DCP) checkpoint: its ``.metadata`` is there (the coordinator
    writes it last, after every rank's shards)."""
    return (folder / ".metadata").is_file()


def dcp_as_files(found: tuple[Path, Path, list[Path]], scratch: Path) -> tuple[Path, Path, list[Path]]:
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
    return whole(a, "uninterrupted"), whole(b, "resumed"), [whole(t, f"twin-{i}") for i, t in enumerate(twins, 1)]


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


@dataclass(frozen=True)
class FinalFiles:
    """The files of the last checkpoint by how they are compared: ``weights`` (.safetensors, by tensor), ``optimizers``
    (:func:`compare_optimizers`), ``states`` (other pickles; a script's JSON files: exact, JSON
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
            elif Path(n).suffix in PICKLE_SUFFIXES and Path(n).name not in TRAINER_UNLOADED:
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

