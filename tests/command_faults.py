"""Command mode's resume under the test jitter, shared by tests/integration/test_resume_noise_plain.py and
test_resume_noise_hf.py: one uninterrupted run of an example (the reference), its twin and a run of another seed,
measured once per file; each resume (correct, or with a planted ``--fault``) judged against them."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
#: the test jitter's relative amplitude (core/child/inject/jitter.py)
JITTER = "1e-3"
PLAIN_FILES = ["config.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt", "progress.json"]
#: example -> fault -> the checks that must fail (between them the two examples commit every fault; the plain loop
#: trains every weight, so it has no adapters)
COMMAND_FAULTS = {
    "plain": {"fresh_optimizer": ("optimizer_moments", "final_weights"), "scheduler_restart": ("learning_rate", "states"),
              "rng_not_restored": ("states", "loss"), "data_restart": ("sample_ids", "loss"),
              "other_run": ("loss", "final_weights")},
    "hf": {"fresh_optimizer": ("optimizer_progress", "optimizer_moments"), "data_restart": ("sample_ids", "loss"),
           "adapters_not_restored": ("loss", "final_weights"), "other_run": ("loss", "final_weights")},
}
#: the resume flag of each example
FLAG = {"plain": "--resume", "hf": "--resume_from_checkpoint"}


def by_name(checks) -> dict:
    return {(c["name"] if isinstance(c, dict) else c.name): c for c in checks}


def tolerance(checks) -> dict:
    return {name: c for name, c in by_name(checks).items()
            if (c["kind"] if isinstance(c, dict) else c.kind) == "tolerance"}


def drive(gen) -> Any:
    """Run a generator of events to its end; its return value."""
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value


def command_table(example: str, tiny_model_dir: Path) -> dict:
    """The [command] table of an example, killed after its 2nd checkpoint of 3 (dropout on: the RNG fault shows)."""
    if example == "plain":
        return {"train": f"{PY} {ROOT / 'examples' / 'train_plain.py'} --model {{model}} --out {{out}} --text "
                         "{train_data} --steps 6 --checkpoint-every 2 --lr 1e-3 --dropout 0.1",
                "resume": "{command} --resume {checkpoint}", "metrics": "metrics.jsonl",
                "checkpoint_files": PLAIN_FILES, "model": str(tiny_model_dir), "eval": "none",
                "kill_after_checkpoint": 2, "workdir": str(ROOT)}
    return {"train": f"{PY} {ROOT / 'examples' / 'train_hf.py'} --model {{model}} --out {{out}} --text {{train_data}} "
                     "--max_steps 6 --save_steps 2 --lora_dropout 0.1", "model": str(tiny_model_dir), "eval": "none",
            "kill_after_checkpoint": 2, "workdir": str(ROOT)}


def reference(example: str, tiny_model_dir: Path, folder: Path) -> tuple[dict, Any, Any, Any]:
    """(the table, the run with its reference, the twins, a run of another seed), all under the jitter."""
    from core.command.pipeline import CommandRun
    from core.command.resume import run_twins
    from core.commandspec import CommandSpec

    os.environ["GPUACCEPT_TEST_JITTER"] = JITTER
    try:
        raw = command_table(example, tiny_model_dir)
        run = CommandRun(CommandSpec.from_dict(raw), folder / "runs")
        drive(run.probe_stage())
        assert run.reference is not None and run.reference.exit_code == 0
        twin = drive(run_twins(run.spec, run.reference, run.run_dir, run.values, run.spec.resume_twins))
        other = CommandRun(CommandSpec.from_dict({**raw, "train": raw["train"] + " --seed 7"}), folder / "other")
        drive(other.probe_stage())
    finally:
        os.environ.pop("GPUACCEPT_TEST_JITTER", None)
    return raw, run, twin, other


def resume(found: tuple, example: str, fault: str | None, folder: Path, monkeypatch) -> Any:
    """The resume check of the example's reference with its twins: correct (``fault`` None), with ``--fault`` on the
    resume command, or (``other_run``) a resume command ending with another run's checkpoint (the last flag wins)."""
    from core.command.resume import resume_stage
    from core.commandspec import CommandSpec

    raw, run, twin, other = found
    flag = FLAG[example]
    if fault is None:
        words = f"{{command}} {flag} {{checkpoint}}"
    elif fault == "other_run":
        ckpt = next(x for x in other.reference.checkpoints if x.step == 4)
        words = f"{{command}} {flag} {{checkpoint}} {flag} {ckpt.path}"
    else:
        words = f"{{command}} {flag} {{checkpoint}} --fault {fault}"
    monkeypatch.setenv("GPUACCEPT_TEST_JITTER", JITTER)
    spec = CommandSpec.from_dict({**raw, "resume": words})
    return drive(resume_stage(spec, run.reference, folder, run.values, run.tier(), twins=twin))


def assert_passes(result: Any) -> None:
    assert result.status == "pass", [(c.name, c.evidence) for c in result.checks if c.status != "pass"]
    assert result.tier.method == "twin" and {"twin-1", "twin-2"} <= set(result.runs)
    rows = tolerance(result.checks)
    assert {"loss", "final_weights", "optimizer_moments", "reproducible"} <= set(rows)
    assert all(c.noise is not None and c.largest_difference <= c.bound for c in rows.values())


def assert_fails_naming(result: Any, example: str, fault: str) -> None:
    checks = by_name(result.checks)
    failed = [name for name, c in checks.items() if c.status != "pass"]
    assert result.status == "fail" and set(COMMAND_FAULTS[example][fault]) <= set(failed), (fault, failed)
    for name in COMMAND_FAULTS[example][fault]:
        c = checks[name]
        if c.kind == "tolerance":  # far outside the twin's bound: the bound does not hide it
            assert c.largest_difference > 5 * c.bound, (name, c.evidence)
