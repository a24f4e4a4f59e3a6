"""A local Hugging Face Hub cache made from committed model configs, as ``huggingface_hub`` lays one out, so a config
that names a Hub model (``meta-llama/Llama-3.2-1B``) is planned offline from its config.json."""

from __future__ import annotations

import shutil
from pathlib import Path

#: the snapshot revision every cached model gets (any 40 hex digits)
REVISION = "0" * 40


def hub_cache(root: Path, *model_roots: Path) -> Path:
    """Lay out ``root`` as a Hub cache holding each ``<org>/<name>/config.json`` under ``model_roots`` (the first root
    that holds a model wins); returns ``root``."""
    for models in model_roots:
        for config in sorted(models.rglob("config.json")):
            repo = root / ("models--" + config.parent.relative_to(models).as_posix().replace("/", "--"))
            snapshot = repo / "snapshots" / REVISION
            if (snapshot / "config.json").exists():
                continue
            snapshot.mkdir(parents=True)
            shutil.copy(config, snapshot / "config.json")
            (repo / "refs").mkdir(exist_ok=True)
            (repo / "refs" / "main").write_text(REVISION)
    return root
