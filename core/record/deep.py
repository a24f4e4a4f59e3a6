"""``gpuaccept verify --deep RUN_DIR``: the resume check's tensor distances computed again from the saved states.

``verify`` (:mod:`core.record.verify`) computes every verdict again from the numbers the record keeps: a hand-edited
number that changes a verdict is named. What it cannot see is a record whose evidence rows were edited together with
every number computed from them. ``--deep`` reads below the record: each tolerance check over tensors keeps (schema 7)
the files it compared in ``evidence_rows.files`` (``[member, path, sha256, loader, prefix]``:
:func:`core.stages.noise.file_rows`). Here every file's sha256 must still be the recorded one (a checkpoint changed
since is named), each is read as the check read it (a safetensors file's tensors, or an optimizer state's moments,
loaded with ``weights_only=True``) and every tensor's distances are computed again by the check's own rule
(:func:`core.stages.noise.judge_tensors`, the record's tier and noise family): they must equal the record's rows.

What it does not recompute, and says so: the losses (the per-step losses are the runs' own logs, kept in the record;
no saved state holds them), a check read from a combined pickle (no files recorded), a record before schema 7.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: how close a distance computed again must be to the recorded one (both are float64 norms of the same tensors)
REL_TOL = 1e-9


@dataclass
class DeepCheck:
    """What ``--deep`` found: ``problems`` (a file changed, a distance that differs: the record does not follow from
    the states) and ``notes`` (what was recomputed, and what was not, with why)."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def deep_check(record: dict[str, Any], run_dir: Path) -> DeepCheck:
    """Recompute the tensor checks of ``record`` (a parsed record) from the files in ``run_dir`` (the run directory
    it was written in, wherever it is now: a recorded path under the record's ``run_dir`` is read under ``run_dir``)."""
    out = DeepCheck()
    res = record.get("resume")
    res = res if isinstance(res, dict) else {}
    checks = res.get("checks")
    if not isinstance(checks, list):
        out.notes.append("no resume checks in the record: nothing to recompute")
        return out
    tier = res["tier"] if isinstance(res.get("tier"), dict) else {}
    recorded_dir = str(record.get("run_dir") or "")
    for check in checks:
        if not isinstance(check, dict) or check.get("kind") != "tolerance":
            continue
        name = str(check.get("name"))
        rows: dict[str, Any] = check["evidence_rows"] if isinstance(check.get("evidence_rows"), dict) else {}
        if "tensors" not in rows:
            if "losses" in rows:
                out.notes.append(f"{name}: losses, the runs' own logs (no saved state holds them): not recomputed")
            continue
        if not rows.get("files"):
            out.notes.append(f"{name}: the record names no files (schema before 7, or read from a combined "
                             "pickle): not recomputed")
            continue
        try:
            found = _recompute(name, rows, tier, run_dir, recorded_dir)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
            out.problems.append(f"deep: resume check {name}: its files cannot be read again ({exc})")
            continue
        if isinstance(found, list):
            out.problems += [f"deep: resume check {name}: {p}" for p in found]
        else:
            out.notes.append(f"{name}: {found}")
    return out


def _recompute(name: str, rows: dict[str, Any], tier: dict[str, Any], run_dir: Path, recorded_dir: str
               ) -> list[str] | str:
    """The check ``name`` computed again from its files: what differs (a list), or what was recomputed (a str)."""
    from core.protocol.manifest import sha256_file
    from core.stages.noise import Family, Tier, judge_tensors

    states: dict[str, dict[str, Any]] = {}
    changed = []
    for member, path, sha, loader, prefix in rows["files"]:
        local = _local(Path(path), run_dir, recorded_dir)
        if not local.is_file():
            changed.append(f"{local} is gone")
            continue
        if sha256_file(local) != sha:
            changed.append(f"{local} changed since the record (sha256 differs)")
            continue
        states.setdefault(str(member), {}).update({f"{prefix}{k}": v for k, v in _read(local, str(loader)).items()})
    if changed:
        return changed
    twin = tier.get("method") == "twin"
    rule = Tier(str(tier.get("name", "")), "twin" if twin else "exact", float(tier.get("multiple", 0.0)), "")
    kin = Family(tuple(rows["members"]), tuple((int(i), int(j)) for i, j in rows["pairs"])) if twin else None
    family = [states[m] for m in kin.members] if kin is not None else None
    judged = judge_tensors(states["reference"], states["resumed"], family, rule, kin)
    return _differences(rows["tensors"], (judged.evidence or {}).get("tensors", [])) or \
        f"{len(states)} runs' files read again (sha256 as recorded), every tensor's distances equal the record's"


def _local(path: Path, run_dir: Path, recorded_dir: str) -> Path:
    """``path`` as recorded, read under ``run_dir`` where it was under the record's own ``run_dir``."""
    if recorded_dir:
        try:
            return run_dir / path.relative_to(recorded_dir)
        except ValueError:
            pass
    return path


def _read(path: Path, loader: str) -> dict[str, Any]:
    """The tensors of ``path`` as the check read them (``loader``: :data:`core.stages.noise.FILE_LOADERS`).

    Raises:
        ValueError: an unknown loader."""
    if loader == "safetensors":
        from safetensors.torch import load_file

        return dict(load_file(str(path)))
    if loader == "optimizer":
        from core.stages.noise import optimizer_state_tensors
        from core.stages.states import safe_load

        state = safe_load(path)
        return optimizer_state_tensors(state["state"] if isinstance(state, dict) else {})
    raise ValueError(f"{loader!r} is no way gpuaccept reads a file")


def _differences(recorded: list[Any], computed: list[Any]) -> list[str]:
    """The rows that differ between the record's and the ones computed again (names, then each number)."""
    if [str(r[0]) for r in recorded] != [str(r[0]) for r in computed]:
        return [f"the tensors compared are {len(computed)} other ones than the record's {len(recorded)}"]
    out = []
    for a, b in zip(recorded, computed):
        if len(a) != len(b) or not all(math.isclose(float(x), float(y), rel_tol=REL_TOL, abs_tol=0.0)
                                       for x, y in zip(a[1:], b[1:])):
            out.append(f"tensor {a[0]}: the record says {a[1:]}, its files give {b[1:]}")
    return out[:5] + ([f"and {len(out) - 5} more tensors"] if len(out) > 5 else [])
