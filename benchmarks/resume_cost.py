"""What the kill-and-resume check costs over its floor, as a ratio in one run (this machine's speed varies).

The training run (the reference) is not counted: it is the train stage's own run. The check adds an interrupted run
killed at its kill point and a resumed run. Its floor is the training those two must do: the interrupted run's steps
(whole steps, plus the micro-batches of the step it died in) and the resumed run's steps, each at the reference's
median step time. The ratio is the check's wall time over that floor (target at most 1.3); the rest is split into the
two children's start-up (process start to first step: imports, model load, data, and for the resumed run the checkpoint
load) and the comparisons after the resumed run ends.

Setup: the embedded SmolLM2-135M, LoRA r 8 q/v, fp32 on CPU, the spec defaults for LoRA (30 steps, checkpoint every
10, killed after the 2nd) with batch and sequence as given below, each kill point in turn against one reference.

Run: ``.venv/bin/python benchmarks/resume_cost.py`` (writes benchmarks/results/resume_cost.json).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SETTINGS = dict(mode="lora", batch_size=4, seq_len=128, steps=30, eval_max_blocks=8)
KILL_POINTS = ("boundary+1", "checkpoint-write")


def drain(gen, stamps: list | None = None):
    """Run a stage generator to its end; ``stamps`` gets (wall time, event) for each event."""
    try:
        while True:
            event = next(gen)
            if stamps is not None:
                stamps.append((time.time(), event))
    except StopIteration as stop:
        return stop.value


def step_times(events: list[dict]) -> list[float]:
    ts = [e["t"] for e in events if e["kind"] == "step"]
    return [b - a for a, b in zip(ts, ts[1:])]


def main() -> None:
    from core.childproc import ChildJob
    from core.events import ChildStarted
    from core.models import resolve_model, runnable_path
    from core.resume import run_resume_check
    from core.spec import RunSpec
    from core.train import run_train_eval

    results: dict = {"settings": SETTINGS, "device": "cpu", "kill_points": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        spec = RunSpec.build(**SETTINGS)
        model_path = runnable_path(resolve_model(spec.model))
        ref, child = drain(run_train_eval(spec, model_path, root / "train", "cpu"))
        ref_steps = step_times(child.events)
        step_s = statistics.median(ref_steps[1:])  # the first interval pays one-off allocations
        results["reference"] = {"steps": spec.steps, "median_step_s": step_s, "training_time_s": ref.training_time_s}
        print(f"reference: {spec.steps} steps, median {step_s:.3f} s/step")
        for at in KILL_POINTS:
            s = RunSpec.build(**SETTINGS, resume_kill_at=at)
            stamps: list = []
            t0 = time.time()
            result = drain(run_resume_check(s, model_path, root / at, "cpu", ref), stamps)
            wall = time.time() - t0
            events = {run: ChildJob(run, root / at / f"resume-{run}", {}) for run in ("interrupted", "resumed")}
            for job in events.values():
                job.events = [json.loads(line) for line in job.events_path.read_text().splitlines()]
            started = {e.run: t for t, e in stamps if isinstance(e, ChildStarted)}
            first_step = {run: next(e["t"] for e in job.events if e["kind"] == "step") for run, job in events.items()}
            kill = next(e for e in events["interrupted"].events if e["kind"] == "kill_point")
            whole = sum(1 for e in events["interrupted"].events if e["kind"] == "step")
            partial = kill["micro_done"] / kill["micro_in_step"] if kill["where"] == "micro" else 0.0
            resumed = sum(1 for e in events["resumed"].events if e["kind"] == "step")
            floor_steps = whole + partial + resumed
            floor = floor_steps * step_s
            last_resumed = max(e["t"] for e in events["resumed"].events)
            row = {
                "status": result.status,
                "check_wall_s": wall,
                "floor_steps": floor_steps,
                "floor_s": floor,
                "ratio": wall / floor,
                "interrupted_startup_s": first_step["interrupted"] - started["interrupted"],
                "resumed_startup_s": first_step["resumed"] - started["resumed"],
                "after_resumed_run_s": t0 + wall - last_resumed,
            }
            results["kill_points"][at] = row
            print(f"{at}: {result.status}; check {wall:.1f} s, floor {floor_steps:g} steps = {floor:.1f} s, ratio "
                  f"{row['ratio']:.2f}; start-up interrupted {row['interrupted_startup_s']:.1f} s, resumed "
                  f"{row['resumed_startup_s']:.1f} s; after the resumed run {row['after_resumed_run_s']:.1f} s")
    out = ROOT / "benchmarks" / "results" / "resume_cost.json"
    out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
