"""What the kill-and-resume check costs, as ratios within one run (this machine's speed varies): over the training run
it checks, and over its own floor.

The training run (the reference) is the train stage's own run. The check adds an interrupted run killed at its kill
point and a resumed run. Two ways of running it, side by side against one reference:

- **before** (what issue 16 replaced; still ``interrupted_from = "start"`` with ``compare_steps`` to the last step):
  the interrupted run trains from step 0 to the kill and the resumed run from checkpoint c to the last step, so the
  check costs about the training run again;
- **after** (the defaults): the interrupted run starts from a copy of the reference's checkpoint before c, and the
  resumed run trains one checkpoint interval after c, so it costs about 2.5 intervals whatever the run's length.

For each: the check's wall time over the reference's training time (``ratio_to_training``), the steps it trained, and
its wall time over its floor (those steps at the reference's median step time; the rest is the two children's
start-up and the comparisons).

Setup: the embedded SmolLM2-135M, LoRA r 8 q/v, fp32 on CPU, 60 steps with a checkpoint every 5, killed after the 2nd
(checkpoint-10), batch and sequence below: a run 12 checkpoint intervals long. On a real job of thousands of steps the
"before" ratio stays near 1 and the "after" one falls towards 0.

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

SETTINGS = dict(mode="lora", batch_size=2, seq_len=64, steps=60, eval_max_blocks=4, resume_checkpoint_every=5,
                resume_kill_after_checkpoint=2)
WAYS = {
    "before": dict(resume_interrupted_from="start", resume_compare_steps=50, resume_kill_at="boundary+1"),
    "after": dict(resume_kill_at="boundary+1"),
    "after, checkpoint-write": dict(resume_kill_at="checkpoint-write"),
}


def drain(gen, stamps: list | None = None):
    """Run a stage generator to its end; ``stamps`` gets (wall time, event) for each event."""
    try:
        while True:
            event = next(gen)
            if stamps is not None:
                stamps.append((time.time(), event))
    except StopIteration as stop:
        return stop.value


def step_times(events: list) -> list[float]:
    from core.protocol.events import Step

    ts = [e.t for e in events if isinstance(e, Step)]
    return [b - a for a, b in zip(ts, ts[1:])]


def main() -> None:
    from core.events import ChildStarted
    from core.models import resolve_model, runnable_path
    from core.protocol.events import KillPoint, Step, read_events
    from core.spec import RunSpec
    from core.stages.childproc import ChildJob
    from core.stages.resume import run_resume_check
    from core.stages.train import run_train_eval

    results: dict = {"settings": SETTINGS, "device": "cpu", "ways": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        spec = RunSpec.build(**SETTINGS)
        model_path = runnable_path(resolve_model(spec.model))
        ref, child = drain(run_train_eval(spec, model_path, root / "train", "cpu"))
        step_s = statistics.median(step_times(child.events)[1:])  # the first interval pays one-off allocations
        results["reference"] = {"steps": spec.steps, "median_step_s": step_s, "training_time_s": ref.training_time_s}
        print(f"reference: {spec.steps} steps in {ref.training_time_s:.1f} s, median {step_s:.3f} s/step")
        for way, extra in WAYS.items():
            s = RunSpec.build(**SETTINGS, **extra)
            folder = root / way.replace(", ", "-")
            stamps: list = []
            t0 = time.time()
            result = drain(run_resume_check(s, model_path, folder, "cpu", ref), stamps)
            wall = time.time() - t0
            jobs = {run: ChildJob(run, folder / f"resume-{run}", {}) for run in ("interrupted", "resumed")}
            for job in jobs.values():
                job.events = read_events(job.events_path)[0]
            started = {e.run: t for t, e in stamps if isinstance(e, ChildStarted)}
            first_step = {run: next(e.t for e in job.events if isinstance(e, Step)) for run, job in jobs.items()}
            kill = next(e for e in jobs["interrupted"].events if isinstance(e, KillPoint))
            whole = sum(1 for e in jobs["interrupted"].events if isinstance(e, Step))
            partial = kill.micro_done / kill.micro_in_step if kill.where == "micro" else 0.0
            resumed = sum(1 for e in jobs["resumed"].events if isinstance(e, Step))
            trained = whole + partial + resumed
            row = {
                "status": result.status,
                "interrupted_start_step": result.interrupted_start,
                "compared_steps": list(result.compared_steps or ()),
                "check_wall_s": wall,
                "steps_trained": trained,
                "ratio_to_training": wall / ref.training_time_s,
                "steps_ratio_to_training": trained / spec.steps,
                "ratio_to_floor": wall / (trained * step_s),
                "interrupted_startup_s": first_step["interrupted"] - started["interrupted"],
                "resumed_startup_s": first_step["resumed"] - started["resumed"],
            }
            results["ways"][way] = row
            print(f"{way}: {result.status}; interrupted from step {row['interrupted_start_step']}, compared "
                  f"{row['compared_steps']}; {trained:g} steps trained; check {wall:.1f} s = "
                  f"{row['ratio_to_training']:.2f} x the training run ({row['steps_ratio_to_training']:.2f} x its "
                  f"steps), {row['ratio_to_floor']:.2f} x its floor; start-up {row['interrupted_startup_s']:.1f} s + "
                  f"{row['resumed_startup_s']:.1f} s")
    before, after = results["ways"]["before"], results["ways"]["after"]
    results["after_over_before"] = after["check_wall_s"] / before["check_wall_s"]
    print(f"after / before: {results['after_over_before']:.2f} of the wall time")
    out = ROOT / "benchmarks" / "results" / "resume_cost.json"
    out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
