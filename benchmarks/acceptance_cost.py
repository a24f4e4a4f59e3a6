"""What a whole acceptance costs over its floor, before and after the fork server (issue 41), as ratios within one run.

A stage's child spent most of its start importing torch, transformers and peft (about 5 s of CPU here; 11-14 s on the
H200 box, where a LoRA acceptance of 12 steps that trained in 2.2 s took 82 s). The fork server (core/forkserver.py)
imports them once and forks each stage's child.

The floor of an acceptance is what no implementation can avoid: **one cold start** (a fresh interpreter importing
torch, transformers and peft and building the model: measured here, median of 3) plus **the steps it trains** in all
its children (the probe's, the training run's, the twin's where one runs, the interrupted and resumed runs'), at the
training run's own seconds per step. The same headless acceptance runs twice per way, alternated:

- **before**: ``GPUACCEPT_FORKSERVER=0``: every stage child is a fresh interpreter, as before issue 41;
- **after**: the fork server.

Reported per way: the wall time (median of the runs), and its ratio to the floor. Setup: a tiny random Llama (hidden 32,
2 layers, the embedded tokenizer's 49,152 tokens), LoRA r 8 q/v, fp32, 2 x 32 tokens, 6 steps, a checkpoint every 2,
killed after the 2nd; once without the test jitter (CPU: bit-exact, no twin) and once with it (a twin runs).

Run: ``.venv/bin/python benchmarks/acceptance_cost.py`` (writes benchmarks/results/acceptance_cost.json).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GPUACCEPT = str(Path(sys.executable).parent / "gpuaccept")
ARGS = ["--mode", "lora", "--steps", "6", "--checkpoint-every", "2", "--kill-after-checkpoint", "2", "--batch-size", "2",
        "--seq-len", "32", "--eval-max-blocks", "4", "--devices", "cpu"]
COLD = ("import time, sys; t = time.perf_counter(); import torch, transformers, peft; "
        "from transformers import AutoModelForCausalLM, Trainer; "
        "AutoModelForCausalLM.from_pretrained(sys.argv[1]); print(time.perf_counter() - t)")


def tiny_model(path: Path) -> Path:
    """A tiny random Llama with the embedded model's tokenizer (the suite's, tests/conftest.py)."""
    from tests.conftest import make_tiny_llama

    return make_tiny_llama(path)


def cold_start(model: Path) -> float:
    """Seconds for a fresh interpreter to import torch, transformers (Trainer) and peft and load the model."""
    out = subprocess.run([sys.executable, "-c", COLD, str(model)], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def steps_trained(record: dict) -> int:
    """Optimizer steps every child of the acceptance trained: probe, training run, twin, interrupted, resumed."""
    spec, res = record["spec"], record["resume"]
    probe = int(spec.get("probe_steps", 3))
    train = int(spec["steps"])
    twin = res["twin_steps"][1] if res.get("twin_steps") else 0
    start = int(res.get("interrupted_start_step", 0))
    interrupted = int(res["kill_step"]) - start
    first, last = res["compared_steps"]
    return probe + train + twin + interrupted + (last - first + 1)


def acceptance(model: Path, runs: Path, fork: bool, jitter: bool) -> tuple[float, dict]:
    env = {**os.environ, "GPUACCEPT_FORKSERVER": "1" if fork else "0"}
    env.pop("GPUACCEPT_TEST_JITTER", None)
    if jitter:
        env["GPUACCEPT_TEST_JITTER"] = "1e-3"
    started = time.perf_counter()
    subprocess.run([GPUACCEPT, "run", "--headless", *ARGS, "--model", str(model), "--runs-dir", str(runs)], env=env,
                   capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - started
    record = tomllib.loads(sorted(runs.glob("*/record.toml"))[-1].read_text())
    return wall, record


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="acceptance-cost-") as tmp:
        model = tiny_model(Path(tmp) / "tiny")
        cold = statistics.median(cold_start(model) for _ in range(3))
        results: dict[str, dict] = {}
        for jitter in (False, True):
            walls: dict[str, list[float]] = {"before": [], "after": []}
            record: dict = {}
            for i in range(2):
                for way, fork in (("before", False), ("after", True)):
                    wall, record = acceptance(model, Path(tmp) / f"runs-{jitter}-{way}-{i}", fork, jitter)
                    assert record["verdict"]["stages"]["resume"]["status"] == "pass", record["resume"]["summary"]
                    walls[way].append(wall)
            per_step = record["evaluation"]["training_time_s"] / int(record["spec"]["steps"])
            trained = steps_trained(record)
            floor = cold + trained * per_step
            key = "with the test jitter (twin)" if jitter else "bit-exact (no twin)"
            results[key] = {
                "cold_start_s": round(cold, 2), "steps_trained": trained, "seconds_per_step": round(per_step, 4),
                "floor_s": round(floor, 2),
                **{f"{way}_wall_s": round(statistics.median(w), 2) for way, w in walls.items()},
                **{f"{way}_over_floor": round(statistics.median(w) / floor, 2) for way, w in walls.items()},
                "after_over_before": round(statistics.median(walls["after"]) / statistics.median(walls["before"]), 2),
            }
            print(key, json.dumps(results[key]), flush=True)
    out = ROOT / "benchmarks" / "results" / "acceptance_cost.json"
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "arguments": ARGS,
                               "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
