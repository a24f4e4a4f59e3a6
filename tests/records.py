"""Committed fixture records: what the pipeline wrote for four small specs on the tiny model, for the tests that read
a record (the quiz, ``verify``, the GPU check's summary) instead of a fresh training run each.

The specs live here once: the ``lora_run`` fixture (tests/conftest.py) runs ``LORA`` afresh for the tests that are about
the pipeline itself, and ``tests/integration/test_record_of_a_run.py`` checks that a fresh record still has every key
of the committed one, so the fixtures cannot drift from what the pipeline writes. Regenerate them after a deliberate
change of the record (a new key, a new schema version) with::

    .venv/bin/python -m tests.records

The records keep the paths of the run that wrote them (a temporary folder that no longer exists); no test reads a
file through them.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

from tests.paths import RECORDS

#: LoRA, accumulation 2, cosine with warmup, killed after the 2nd of 4 checkpoints: every stage passes
LORA: dict[str, Any] = dict(mode="lora", steps=8, seq_len=64, grad_accum=2, resume_checkpoint_every=2,
                            resume_kill_after_checkpoint=2, lr_scheduler="cosine", warmup_steps=2, eval_max_blocks=8)
#: full fine-tuning, tied embeddings (the tiny Llama ties them), killed after the 1st of 2 checkpoints
FULL: dict[str, Any] = dict(mode="full", seq_len=32, batch_size=2, steps=4, resume_checkpoint_every=2,
                            resume_kill_after_checkpoint=1, eval_max_blocks=8)
#: inference: fixed weights, evaluated once; resume not applicable
INFERENCE: dict[str, Any] = dict(mode="inference", seq_len=32, batch_size=2, eval_max_blocks=4)

#: QLoRA (a variant: the base in NF4 with double quantisation) on every linear layer with bitsandbytes' 8-bit AdamW,
#: killed after the 1st of 2 checkpoints (on q and v alone, 4 steps do not lower the random tiny model's perplexity)
QLORA: dict[str, Any] = dict(mode="qlora", optimizer="adamw_8bit", lora_targets="all-linear", learning_rate=3e-3,
                             seq_len=32, batch_size=2, steps=4, resume_checkpoint_every=2,
                             resume_kill_after_checkpoint=1, eval_max_blocks=4)

SPECS = {"lora": LORA, "full": FULL, "inference": INFERENCE, "qlora": QLORA}


def path_of(name: str) -> Path:
    """The committed record ``name`` (``lora``, ``full``, ``inference`` or ``qlora``)."""
    return RECORDS / f"{name}.toml"


def committed(name: str) -> dict[str, Any]:
    """The committed record ``name``, parsed (a fresh dict each call: tests may change it)."""
    return tomllib.loads(path_of(name).read_text(encoding="utf-8"))


def as_schema(data: dict[str, Any], version: int) -> None:
    """Make a parsed record (of the current schema) a record of an older ``version`` in what the versions since
    added: before 5, a resume tier with its relative tolerance (``rtol``: 0 on the CPU's exact tier) and no
    ``reproducible`` check, no noise or bound in the checks, no twin; before 4, no ``accept`` table and no
    ``criteria`` in the verdict's stages."""
    data["schema_version"] = version
    if version < 5:
        res = data.get("resume", {})
        if isinstance(res.get("tier"), dict) and "method" in res["tier"]:
            tier = res["tier"]
            res["tier"] = {"name": tier["name"], "rtol": 0.0, "why": tier["why"]}
        if isinstance(res.get("checks"), list):
            res["checks"] = [c for c in res["checks"] if c.get("name") != "reproducible"]
            for c in res["checks"]:
                c.pop("noise", None)
                c.pop("bound", None)
        res.pop("twin_steps", None)
        for row in res.get("comparison", []):
            row.pop("loss_twin", None)
        data.get("environment", {}).pop("test_jitter", None)
        data.get("environment", {}).pop("test_fault", None)
    if version < 4:
        data.pop("accept", None)
        for stage in data["verdict"]["stages"].values():
            stage.pop("criteria", None)


def key_paths(tree: Any, prefix: str = "") -> set[str]:
    """Every key path of a record (``plan.devices[].components.weights``; a list of tables by its first element)."""
    if isinstance(tree, dict):
        return {k2 for k, v in tree.items() for k2 in key_paths(v, f"{prefix}.{k}") | {f"{prefix}.{k}"}}
    if isinstance(tree, list) and tree and isinstance(tree[0], dict):
        return key_paths(tree[0], prefix + "[]")
    return set()


def write_all(model_dir: Path, runs_root: Path) -> dict[str, Path]:
    """Run the pipeline for each spec on ``model_dir`` and copy each record to tests/data/records/."""
    from core.events import RunFinished
    from core.pipeline import run_pipeline
    from core.spec import RunSpec

    RECORDS.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, kwargs in SPECS.items():
        events = list(run_pipeline(RunSpec.build(model=str(model_dir), **kwargs), runs_root=runs_root))
        last = events[-1]
        if not isinstance(last, RunFinished) or last.record_path is None:
            raise SystemExit(f"{name}: the pipeline wrote no record ({last})")
        shutil.copyfile(last.record_path, path_of(name))
        out[name] = path_of(name)
    return out


def main() -> int:
    from tests.conftest import make_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_llama(Path(tmp) / "tiny-llama")
        for name, path in write_all(model, Path(tmp) / "runs").items():
            rec = tomllib.loads(path.read_text(encoding="utf-8"))
            print(f"{name}: {path} (verdict {rec['verdict']['status']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
