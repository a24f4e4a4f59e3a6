"""A training script without a model, for the tests of command mode's verdicts (what a user's command can do wrong):
it "trains" ``--steps`` steps in milliseconds, writes ``metrics.jsonl`` and ``checkpoint-<step>/`` folders
(``state.json``: the step and a running sum that a correct resume continues) and resumes from one with ``--resume``.

Switches, each a way a real job fails: ``--exit-after N CODE`` exits with CODE after step N; ``--no-checkpoint``;
``--no-metrics``; ``--bad-metrics`` (every line's step a string); ``--detach`` starts a Python process in a session of its
own that sleeps (a daemonised helper, which a kill of the command's process group alone would leave behind) and writes
its pid to ``OUT/detached.pid``; ``--detach-shell`` the same with ``sleep`` (no Python: ``OUT/sleep.pid``); ``--detach-clean`` a daemon that leaves
no trace to follow (double fork, ``setsid``, its descriptors closed, its environment cleared, then ``sleep``:
``OUT/clean.pid``); ``--oom-in DIR`` joins the memory cgroup DIR (its limit set by the test) and allocates until
the kernel's OOM killer ends it; ``--sleep S``
per step; ``--forget-sum`` resumes with the running sum reset (a checkpoint that misses part of the state);
``--late-runs N,M --counter FILE``: the script's Nth, Mth... start (counted in FILE) holds back the metrics lines
after its first checkpoint until the next one is written, as a fast script seen late by a busy poller shows them (a
kill placed by them comes after the next checkpoint).
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def detach_clean(pid_file: Path) -> None:
    """A daemon no environment or tree leads back to: fork, ``setsid``, fork again, close every descriptor, clear the
    environment and exec ``sleep``; its pid in ``pid_file`` (written before the exec)."""
    first = os.fork()
    if first:
        os.waitpid(first, 0)
        while not pid_file.is_file() or not pid_file.read_text():
            time.sleep(0.01)
        return
    os.setsid()
    if os.fork():
        os._exit(0)
    pid_file.write_text(str(os.getpid()))
    os.closerange(0, 1024)
    os.environ.clear()
    os.execve("/bin/sleep", ["sleep", "2222"], {})


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    # a checkpoint every 4 steps: from outside the kill lands at step 6, two steps before checkpoint 8 is written
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--resume")
    p.add_argument("--exit-after", nargs=2, type=int)
    p.add_argument("--no-checkpoint", action="store_true")
    p.add_argument("--no-metrics", action="store_true")
    p.add_argument("--detach", action="store_true")
    p.add_argument("--sleep", type=float, default=0.05)
    p.add_argument("--forget-sum", action="store_true")
    p.add_argument("--detach-shell", action="store_true")
    p.add_argument("--bad-metrics", action="store_true")
    p.add_argument("--detach-clean", action="store_true")
    p.add_argument("--oom-in")
    p.add_argument("--late-runs", default="")
    p.add_argument("--counter")
    args = p.parse_args()
    late = False
    if args.counter:
        counter = Path(args.counter)
        run = int(counter.read_text()) + 1 if counter.is_file() else 1
        counter.write_text(str(run))
        late = str(run) in args.late_runs.split(",")
    held: list[str] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.detach:
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        (out / "detached.pid").write_text(str(helper.pid))
    if args.detach_shell:  # not Python: no sitecustomize lifeline ends it
        helper = subprocess.Popen(["sleep", "300"], start_new_session=True, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        (out / "sleep.pid").write_text(str(helper.pid))
    if args.detach_clean:
        detach_clean(out / "clean.pid")
    if args.oom_in:
        print("fake_train: allocating until the OOM killer ends me", flush=True)
        Path(args.oom_in, "cgroup.procs").write_text(str(os.getpid()))
        held = []
        while True:
            held.append(b"x" * (16 << 20))
    start, total = 0, 0.0
    if args.resume:
        state = json.loads((Path(args.resume) / "state.json").read_text())
        start, total = state["step"], 0.0 if args.forget_sum else state["sum"]
    for step in range(start + 1, args.steps + 1):
        time.sleep(args.sleep)
        total += 1.0 / step
        loss = 10.0 / (1.0 + total)
        if args.bad_metrics:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": str(step), "loss": loss}) + "\n")
        elif not args.no_metrics:
            held.append(json.dumps({"step": step, "loss": loss, "learning_rate": 0.1 / step,
                                    "sample_ids": [step % 5]}) + "\n")
            if not (late and step > args.every):  # late: held until the next checkpoint is written
                with open(out / "metrics.jsonl", "a") as f:
                    f.write("".join(held))
                held.clear()
        print(f"step {step} loss {loss:.4f}", flush=True)
        if args.exit_after and step == args.exit_after[0]:
            print(f"fake_train: exiting with {args.exit_after[1]} after step {step}", file=sys.stderr, flush=True)
            return args.exit_after[1]
        if not args.no_checkpoint and (step % args.every == 0 or step == args.steps):
            tmp = out / f".checkpoint-{step}.tmp"
            tmp.mkdir(exist_ok=True)
            (tmp / "state.json").write_text(json.dumps({"step": step, "sum": total}))
            os.replace(tmp, out / f"checkpoint-{step}")
        if held and (step % args.every == 0 or step == args.steps):  # a late run's lines, once its checkpoint is
            with open(out / "metrics.jsonl", "a") as f:
                f.write("".join(held))
            held.clear()
            if late:
                time.sleep(2.0)  # training on past its checkpoint, as a real job does, when its lines are seen
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
