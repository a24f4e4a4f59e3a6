"""The resume check's power, measured: how often it fails a correct resume (false fails) and how far outside its bound
each planted fault lands (the detection margin), in both subjects: gpuaccept's own recipe and a user's command.

Everything runs under the test jitter (``GPUACCEPT_TEST_JITTER=1e-3``: each optimizer step's gradients multiplied by
``1 + 1e-3 N(0, 1)``, drawn per process, core/child/inject/jitter.py), the CPU's stand-in for a GPU's run-to-run
noise, so every tolerance check is bounded by the twins' measured spread (core/stages/noise.py). A run is:

- **recipe**: the tiny random Llama of the tests (tests/conftest.py), LoRA with dropout 0.1, 6 steps, a checkpoint
  every 2, killed after the 2nd (c = 4; the interrupted run and the twins start from a copy of checkpoint 2):
  tests/integration/test_resume_noise.py's setup. A fresh uninterrupted run (the reference), then the resume check.
- **command**: examples/train_plain.py (a hand-written loop, dropout 0.1, 6 steps, a checkpoint every 2) run as a
  user's command: tests/command_faults.py's setup; a fresh uninterrupted run, its twins, then the resume check. The
  faults the loop cannot commit (it has no adapters) are planted in examples/train_hf.py (Trainer and PEFT LoRA).

For each run every tolerance check's **margin** (its distance over its bound; at most 1 passes) is kept. A correct
resume false-fails where any check fails. ``--faults`` plants each fault once (the recipe:
core/protocol/faults.py; the command: the example's own ``--fault``) and keeps the checks it failed and their margins.

Usage::

    .venv/bin/python benchmarks/resume_false_fail.py --subject recipe --runs 100
    .venv/bin/python benchmarks/resume_false_fail.py --subject command --runs 10 --faults

    .venv/bin/python benchmarks/resume_false_fail.py --subject recipe --runs 300 --append   # more of the same

Writes benchmarks/results/resume_false_fail.json (one entry per subject, replaced by the next run of it). With
``--append`` every correct resume is also appended, as it ends, to benchmarks/results/resume_false_fail_runs.jsonl
(one line a run: the subject, the commit, the loss multiple it ran under, its margins), so a batch can be stopped at
any time and nothing measured is lost; the subject's entry then counts every run of the log and the entry's own
``per_run`` (the loss margins rescaled to the multiple in use: margin x multiple then / multiple now).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "benchmarks" / "results" / "resume_false_fail.json"
RUNS_LOG = ROOT / "benchmarks" / "results" / "resume_false_fail_runs.jsonl"
JITTER = "1e-3"
RECIPE = dict(mode="lora", dtype="bf16", lora_dropout=0.1, steps=6, resume_checkpoint_every=2, resume_kill_after_checkpoint=2,
              batch_size=2, seq_len=32, eval_max_blocks=4)


def margins(checks: list[Any]) -> dict[str, float]:
    """Each tolerance check's distance over its bound (inf where the bound is 0 and the distance is not)."""
    out = {}
    for c in checks:
        if c.kind != "tolerance" or c.bound is None or c.largest_difference is None:
            continue
        out[c.name] = (c.largest_difference / c.bound if c.bound > 0 else
                       (0.0 if c.largest_difference == 0 else math.inf))
    return out


def kill_attempts(checks: list[Any]) -> int:
    """How many interrupted runs the check started before its kill landed where it must (command mode runs a script
    again when its kill came after the next checkpoint: core/command/resume.py ``KILL_ATTEMPTS``): 1 unless the
    ``kill_point`` evidence names an attempt."""
    import re

    point = next((c.evidence for c in checks if c.name == "kill_point"), "")
    found = re.search(r"\(attempt (\d+) of \d+", point)
    return int(found.group(1)) if found else 1


def recipe_run(model: Path, folder: Path, fault: str | None = None) -> Any:
    """One reference training run and its resume check (``fault`` planted in the resumed run)."""
    from core.spec import RunSpec
    from core.stages.resume import run_resume_check
    from core.stages.train import run_train_eval
    from tests.command_faults import drive

    spec = RunSpec.build(model=str(model), **RECIPE)
    te, _ = drive(run_train_eval(spec, model, folder / "reference", "cpu"))
    if fault:
        os.environ["GPUACCEPT_TEST_FAULT"] = fault
    try:
        return drive(run_resume_check(spec, model, folder / "check", "cpu", te))
    finally:
        os.environ.pop("GPUACCEPT_TEST_FAULT", None)


def command_run(model: Path, folder: Path, fault: str | None = None, found: Any = None, example: str = "plain"
                ) -> Any:
    """One uninterrupted run of an example (``plain``: examples/train_plain.py; ``hf``: examples/train_hf.py, Trainer
    and PEFT LoRA) with its twins (or ``found``, a reference measured before) and its resume check (``fault``: the
    example's ``--fault``)."""
    from tests.command_faults import reference, resume

    class Env:  # what resume() asks of pytest's monkeypatch
        @staticmethod
        def setenv(name: str, value: str) -> None:
            os.environ[name] = value

    found = found or reference(example, model, folder / "reference")
    os.environ["GPUACCEPT_TEST_JITTER"] = JITTER  # reference() takes it away again
    return resume(found, example, fault, folder / "check", Env()), found


def loss_multiple_now(subject: str) -> float:
    """The multiple a loss check of ``subject`` is judged by now: two independent contrasts in both subjects (the
    recipe's three twins from a checkpoint; the command's two twins and the reference, all from step 0)."""
    from core.stages.noise import loss_multiple_for

    return loss_multiple_for(2)


def rescaled(margins: dict[str, float], multiple_then: float, multiple_now: float) -> dict[str, float]:
    """``margins`` at the loss multiple in use (a loss check's margin is its distance over multiple x noise)."""
    from core.stages.noise import LOSS_CHECKS

    return {k: (v * multiple_then / multiple_now if k in LOSS_CHECKS else v) for k, v in margins.items()}


def logged_runs(subject: str, multiple_now: float) -> list[dict[str, Any]]:
    """Every run of ``subject`` in :data:`RUNS_LOG` and the subject's earlier ``per_run`` (its multiple then in the
    entry's ``loss_multiple_when_run``), their margins at ``multiple_now`` and their status by them."""
    runs: list[dict[str, float]] = []
    attempts: list[int] = []
    entry = (json.loads(OUT.read_text()) if OUT.is_file() else {}).get(subject, {})
    if entry.get("per_run") and not entry.get("from_log"):
        runs += [rescaled(m, entry.get("loss_multiple_when_run", multiple_now), multiple_now) for m in entry["per_run"]]
    elif entry.get("earlier_per_run"):
        runs += [rescaled(m, entry["earlier_loss_multiple"], multiple_now) for m in entry["earlier_per_run"]]
    attempts += [1] * len(runs)
    if RUNS_LOG.is_file():
        for line in RUNS_LOG.read_text().splitlines():
            row = json.loads(line)
            if row["subject"] == subject:
                # a check without a margin (exact, completeness: a kill that came late) fails the run whatever the
                # multiple; a tolerance check fails it by its margin at the multiple in use
                exact = [c for c in row.get("failed", []) if c not in row["margins"]]
                runs.append({**rescaled(row["margins"], row["loss_multiple"], multiple_now),
                             **{f"{c} (exact)": math.inf for c in exact}})
                attempts.append(row.get("kill_attempts", 1))
    return [{"status": "pass" if all(v <= 1 for v in m.values()) else "fail", "kill_attempts": tries,
             "margins": {k: v for k, v in m.items() if not k.endswith(" (exact)")}} for m, tries in zip(runs, attempts)]


def _commit() -> str:
    import subprocess

    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The false-fail count and the margins' spread per check over correct runs."""
    per: dict[str, list[float]] = {}
    for r in results:
        for name, m in r["margins"].items():
            per.setdefault(name, []).append(m)
    fails = sum(1 for r in results if r["status"] != "pass")
    retried = sum(1 for r in results if r.get("kill_attempts", 1) > 1)
    return {"runs": len(results), "false_fails": fails, "kills_retried": retried,
            "false_fail_rate": fails / len(results) if results else None,
            # one-sided 95 % upper bound on the rate (Clopper-Pearson; with 0 fails, 1 - 0.05^(1/n), "rule of three")
            "false_fail_rate_upper95": _upper95(fails, len(results)) if results else None,
            "margins": {name: {"max": max(v), "median": sorted(v)[len(v) // 2], "p90": sorted(v)[int(0.9 * (len(v) - 1))]}
                        for name, v in sorted(per.items())}}


def _upper95(k: int, n: int) -> float:
    """The one-sided 95 % Clopper-Pearson upper bound of a rate seen k times in n (bisection on the binomial tail)."""
    lo, hi = k / n, 1.0
    for _ in range(60):
        p = (lo + hi) / 2
        tail = sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k + 1))
        lo, hi = (p, hi) if tail > 0.05 else (lo, p)
    return hi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--subject", choices=("recipe", "command"), default="recipe")
    ap.add_argument("--runs", type=int, default=100, help="correct resumes (default 100)")
    ap.add_argument("--faults", action="store_true", help="plant each fault once too")
    ap.add_argument("--append", action="store_true",
                    help=f"log each run as it ends to {RUNS_LOG.name} and count every logged run")
    args = ap.parse_args()
    os.environ["GPUACCEPT_TEST_JITTER"] = JITTER
    from core.protocol.faults import FAULTS
    from core.status import PASSING
    from tests.command_faults import COMMAND_FAULTS
    from tests.conftest import make_tiny_llama

    started = time.time()
    results, faults = [], {}
    with tempfile.TemporaryDirectory(prefix="resume-false-fail-") as tmp:
        model = make_tiny_llama(Path(tmp) / "model")
        found = None
        for i in range(args.runs):
            folder = Path(tmp) / f"run-{i}"
            if args.subject == "recipe":
                result = recipe_run(model, folder)
            else:  # every run its own reference and twins: the noise is drawn afresh
                result, _ = command_run(model, folder)
            results.append({"status": str(result.status), "margins": margins(result.checks),
                            "failed": [c.name for c in result.checks if c.status not in PASSING],
                            "kill_attempts": kill_attempts(result.checks)})
            if args.append:  # one line a run, as it ends: a batch stopped early keeps what it measured
                with RUNS_LOG.open("a") as log:
                    log.write(json.dumps({"subject": args.subject, "commit": _commit(), "date": time.strftime("%Y-%m-%d"),
                                          "loss_multiple": loss_multiple_now(args.subject), **results[-1]},
                                         sort_keys=True) + "\n")
            print(f"run {i + 1}/{args.runs}: {result.status} "
                  + " ".join(f"{k}={v:.2f}" for k, v in sorted(results[-1]["margins"].items())), flush=True)
            _remove(folder)
        # the command's faults: the plain loop's, then the Trainer example's for what the loop cannot commit (it
        # trains every weight: no adapters)
        names = [(f, "") for f in sorted(FAULTS)] if args.subject == "recipe" else \
            [(f, "plain") for f in sorted(COMMAND_FAULTS["plain"])] + \
            [(f, "hf") for f in sorted(COMMAND_FAULTS["hf"]) if f not in COMMAND_FAULTS["plain"]]
        found_by: dict[str, Any] = {"plain": found}
        for fault, example in names if args.faults else []:
            folder = Path(tmp) / f"fault-{fault}"
            if args.subject == "recipe":
                result = recipe_run(model, folder, fault)
            else:
                result, found_by[example] = command_run(model, folder, fault, found_by.get(example), example)
            faults[fault] = {"status": str(result.status), "margins": margins(result.checks),
                             "failed": [c.name for c in result.checks if c.status not in PASSING],
                             **({"example": example} if example else {})}
            print(f"fault {fault}: {result.status}, failed {faults[fault]['failed']}, margins "
                  + " ".join(f"{k}={v:.3g}" for k, v in sorted(faults[fault]["margins"].items())), flush=True)
    entry = {"jitter": float(JITTER), "setup": RECIPE if args.subject == "recipe" else "examples/train_plain.py "
             "(tests/command_faults.py)", "seconds": round(time.time() - started, 1), **summary(results),
             "faults": faults, "date": time.strftime("%Y-%m-%d"),
             # every run's margins, so that the rate at another multiple can be read off (margin x old / new)
             "per_run": [r["margins"] for r in results]}
    data = json.loads(OUT.read_text()) if OUT.is_file() else {}
    if args.append:  # the entry counts every logged run, the earlier per_run kept once as it was
        old = data.get(args.subject, {})
        every = logged_runs(args.subject, loss_multiple_now(args.subject))
        entry.update(summary(every), from_log=RUNS_LOG.name, per_run=[], seconds_this_batch=entry.pop("seconds"),
                     loss_multiple_now=loss_multiple_now(args.subject), faults=faults or old.get("faults", {}),
                     earlier_per_run=old.get("earlier_per_run", old.get("per_run", [])),
                     earlier_loss_multiple=old.get("earlier_loss_multiple", old.get("loss_multiple_when_run")))
    data[args.subject] = entry
    OUT.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    print(json.dumps({k: v for k, v in entry.items() if k not in ("faults", "per_run")}, indent=2))


def _remove(folder: Path) -> None:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
