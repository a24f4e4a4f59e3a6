"""The sha256 manifest of a checkpoint: written by the parent right after the kill, verified by the parent, and verified
again inside the resumed process right before Trainer loads the files and once more after its run (issue 16).

What this covers: a checkpoint file changed, added or removed at any time between the manifest and the end of the
resumed run, as long as the change is still there at one of the checks. What it cannot see: a change made and undone
between two checks (the resumed process reads the files once, inside ``Trainer.train``, between its two checks).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_files(ckpt: Path) -> list[Path]:
    """Every file under ``ckpt`` (recursively), sorted; ``[]`` if it is not a folder."""
    return sorted(p for p in ckpt.rglob("*") if p.is_file()) if ckpt.is_dir() else []


def write_manifest(ckpt: Path, path: Path) -> dict[str, str]:
    """sha256 of every file in a checkpoint folder, written as JSON to ``path``; returns ``{relative name: hex}``."""
    manifest = {str(f.relative_to(ckpt)): sha256_file(f) for f in checkpoint_files(ckpt)}
    path.write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    return manifest


def read_manifest(path: Path) -> dict[str, str]:
    """The manifest written by :func:`write_manifest`."""
    return dict(json.loads(Path(path).read_text(encoding="utf-8")))


def verify_manifest(ckpt: Path, manifest: dict[str, str]) -> list[str]:
    """Names of files whose sha256 differs from the manifest, or that appeared or vanished since it was written
    (sorted: appeared/vanished first, then changed)."""
    now = {str(p.relative_to(ckpt)) for p in checkpoint_files(ckpt)}
    bad = sorted(now ^ set(manifest))
    bad += [name for name in sorted(now & set(manifest)) if sha256_file(ckpt / name) != manifest[name]]
    return bad
