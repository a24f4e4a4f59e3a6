"""Command mode end to end (issue 21): the user's own training command accepted as they run it, on this CPU.

- examples/train_plain.py (a plain PyTorch loop, measured from outside) and examples/train_hf.py (Trainer + PEFT,
  measured from inside too, also under torchrun with 2 gloo ranks) accepted: probe, plan, evaluation, kill and resume,
  a record ``gpuaccept verify`` finds consistent;
- the deliberately broken resume (``--forget-optimizer``) fails with evidence;
- tests/data/commands/fake_train.py (no model: milliseconds a run) for what a user's command can do wrong: exit early,
  write no checkpoint, write no metrics, leave a detached process; a quit (SIGINT) and a ``kill -9`` of gpuaccept
  leave no process of the job alive.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import psutil
import pytest

from core.command.pipeline import run_command_pipeline
from core.commandspec import CommandSpec
from core.events import RunFinished
from core.methods import METHODS

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
GPUACCEPT = str(Path(PY).parent / "gpuaccept")
FAKE = ROOT / "tests" / "data" / "commands" / "fake_train.py"
PLAIN = ROOT / "examples" / "train_plain.py"
HF = ROOT / "examples" / "train_hf.py"
FSDP = ROOT / "examples" / "train_fsdp_dcp.py"
PLAIN_FILES = ["config.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt", "progress.json"]


def accept(raw: dict, runs: Path) -> tuple[dict, list]:
    """Run command mode in this process; the record (parsed) and every event."""
    events = list(run_command_pipeline(CommandSpec.from_dict({"workdir": str(ROOT), **raw}), runs))
    assert isinstance(events[-1], RunFinished) and events[-1].record_path, events[-3:]
    return tomllib.loads(Path(events[-1].record_path).read_text()), events


def verify(record_path: Path) -> subprocess.CompletedProcess:
    """``gpuaccept verify`` as a user runs it (exit 3: unsigned, every verdict follows from the record's numbers)."""
    return subprocess.run([GPUACCEPT, "verify", str(record_path)], capture_output=True, text=True, timeout=120)


def consistent(record_path: Path) -> bool:
    """What ``verify`` checks, in this process: the schema holds and every verdict follows from the numbers."""
    from core.record.verify import record_problems

    return record_problems(tomllib.loads(record_path.read_text())) == ([], [])


def checks(record: dict) -> dict[str, dict]:
    return {c["name"]: c for c in record["resume"]["checks"]}


def stages(record: dict) -> dict[str, str]:
    return {name: s["status"] for name, s in record["verdict"]["stages"].items()}


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def fake(extra: str = "", **raw) -> dict:
    return {"train": f"{PY} {FAKE} --out {{out}} {extra}", "resume": "{command} --resume {checkpoint}",
            "metrics": "metrics.jsonl", "checkpoint_files": ["state.json"], "eval": "none", **raw}


# ------------------------------------------------------------------------------------- the two example scripts
def test_the_plain_loop_is_accepted_end_to_end(tiny_model_dir, tmp_path):
    """The plain loop reports no Trainer, so it is measured from outside and gets no plan (said so); its final
    checkpoint beats its base on held-out perplexity; killed after checkpoint 4 at step 6 (from outside: when its
    metrics show step 6, two steps before checkpoint 8) it resumes bit for bit (CPU fp32): losses, samples, weights,
    AdamW, RNG. (The console script's command mode: the quit and kill -9 tests below.)"""
    record, _ = accept({"train": f"{PY} {PLAIN} --model {{model}} --out {{out}} --text {{train_data}} --steps 8 "
                                 "--checkpoint-every 4 --lr 1e-3", "resume": "{command} --resume {checkpoint}",
                        "metrics": "metrics.jsonl", "model": str(tiny_model_dir), "checkpoint_files": PLAIN_FILES,
                        "eval_seq_len": 32, "eval_max_blocks": 8}, tmp_path / "runs")
    path = Path(record["run_dir"]) / "record.toml"
    assert record["kind"] == "command" and stages(record) == {"plan": "not_applicable", "probe": "pass",
                                                              "evaluation": "pass", "resume": "pass"}
    assert record["ran"]["view"] == "outside" and "no transformers Trainer" in record["plan"]["why"]
    assert record["probe"]["devices"][0]["device"] == "cpu" and record["probe"]["devices"][0]["measured_bytes"] > 2**20
    ev = record["evaluation"]
    assert ev["after"]["value"] < ev["before"]["value"] and ev["checkpoint"] == "checkpoint-8"
    assert ev["independence"].startswith("by construction") and record["data"]["heldout_blocks_evaluated"] == 8
    c = checks(record)
    assert record["resume"]["tier"]["name"] == "cpu-fp32-exact"
    assert (record["resume"]["checkpoint_step"], record["resume"]["kill_step"]) == (4, 6)
    assert c["final_weights"]["largest_difference"] == 0 and c["optimizer_moments"]["evidence"].endswith("bit-identical")
    assert "rng.pt" in c["states"]["evidence"] and "progress.json" in c["states"]["evidence"]
    script = next(s for s in record["command"]["scripts"] if s["path"].endswith("train_plain.py"))
    import hashlib

    assert script["sha256"] == hashlib.sha256(PLAIN.read_bytes()).hexdigest() and len(script["git_commit"]) == 40
    assert consistent(path)


def test_a_checkpoint_that_forgets_the_optimizer_fails_the_resume_with_evidence(tiny_model_dir, tmp_path):
    """``--forget-optimizer``, the deliberate bug: the checkpoint misses optimizer.pt (named), the resume still runs
    (what it does without it is evidence too) and its losses leave the uninterrupted run's after the first step."""
    record, _ = accept({"train": f"{PY} {PLAIN} --model {{model}} --out {{out}} --text {{train_data}} --steps 8 "
                                 "--checkpoint-every 4 --forget-optimizer",
                        "resume": "{command} --resume {checkpoint}", "metrics": "metrics.jsonl",
                        "model": str(tiny_model_dir), "checkpoint_files": PLAIN_FILES, "eval": "none"},
                       tmp_path / "runs")
    assert record["verdict"]["status"] == "fail" and stages(record)["resume"] == "fail"
    c = checks(record)
    assert c["checkpoint_complete"]["status"] == "fail" and "optimizer.pt" in c["checkpoint_complete"]["evidence"]
    assert c["reproducible"]["status"] == "pass" and c["learning_rate"]["status"] == "pass"
    assert c["loss"]["status"] == "fail" and "steps 6-8" in c["loss"]["evidence"]  # step 5: the moments act later
    rows = record["resume"]["comparison"]
    assert rows[0]["step"] == 5 and rows[0]["difference"] == 0 and all(r["difference"] > 0 for r in rows[1:])
    assert c["final_weights"]["status"] == "fail"
    # no optimizer file in either final checkpoint: named as not compared, never counted as passed
    assert "optimizer_moments" not in c and any("optimizer's state" in n for n in record["resume"]["not_compared"])


def test_the_trainer_script_is_accepted_end_to_end_in_one_process(tiny_model_dir, tmp_path):
    """Trainer + PEFT LoRA as one process: the inside view of a single device (world size 1, ``rng_state.pth``), the
    plan of what ran (strategy single) against its peak RSS, the adapter evaluated over its base, Trainer's resume."""
    record, _ = accept({"train": f"{PY} {HF} --model {tiny_model_dir} --out {{out}} --text {{train_data}} "
                                 "--max_steps 4 --save_steps 2 --learning_rate 0.2", "eval_max_blocks": 4},
                       tmp_path / "runs")
    assert stages(record) == {"plan": "pass", "probe": "pass", "evaluation": "pass", "resume": "pass"}, \
        record["verdict"]
    assert (record["ran"]["world_size"], record["plan"]["strategy"]) == (1, "single")
    assert [d["device"] for d in record["probe"]["devices"]] == ["cpu"]
    assert record["plan"]["comparison"][0]["measured_bytes"] == record["probe"]["devices"][0]["peak_rss_bytes"]
    assert record["evaluation"]["after"]["value"] < record["evaluation"]["before"]["value"]
    c = checks(record)
    assert "rng_state.pth" in c["world_size"]["evidence"] and "held after step 3" in c["kill_point"]["evidence"]
    assert consistent(Path(record["run_dir"]) / "record.toml")


def test_the_trainer_script_under_torchrun_is_measured_from_inside_planned_from_what_ran_and_resumes(
        tiny_model_dir, tmp_path):
    """Trainer + PEFT LoRA under ``torchrun --nproc-per-node 2`` (gloo on the CPU): the hook reports what ran (LoRA r 8
    on q and v, micro-batch 2 x 32 tokens, AdamW, fp32, 2 ranks), each rank measured apart (cpu:0, cpu:1); the plan
    is made from it (ddp over 2 CPU ranks) and compared with each rank's peak RSS; every rank holds at the kill point,
    every process of the job (torchrun and both ranks) is killed, and Trainer's resume at world size 2 continues both
    ranks' losses exactly."""
    record, _ = accept({"train": f"{PY} -m torch.distributed.run --standalone --nproc-per-node 2 {HF} --model "
                                 f"{tiny_model_dir} --out {{out}} --text {{train_data}} --max_steps 6 --save_steps 2 "
                                 "--learning_rate 0.2", "eval_max_blocks": 8}, tmp_path / "runs")
    assert stages(record) == {"plan": "pass", "probe": "pass", "evaluation": "pass", "resume": "pass"}, \
        record["verdict"]
    ran = record["ran"]
    assert ran["view"] == "inside" and ran["model"] == "PeftModelForCausalLM" and ran["peft"]["r"] == 8
    assert ran["batch_widths"] == [32] and ran["arguments"]["per_device_train_batch_size"] == 2
    assert ran["world_size"] == 2 and [(r["rank"], r["local_rank"]) for r in ran["ranks"]] == [(0, 0), (1, 1)]
    assert all(r["device"].startswith("cpu") for r in ran["ranks"])  # Trainer's args.device: "cpu:0" on both
    assert [d["device"] for d in record["probe"]["devices"]] == ["cpu:0", "cpu:1"]
    assert record["probe"]["tokens_per_s"] > 0 and record["probe"]["steps"] == record["probe"]["expected_steps"] == 6
    plan = record["plan"]
    assert (plan["spec"]["mode"], plan["spec"]["seq_len"], plan["spec"]["batch_size"]) == ("lora", 32, 2)
    assert plan["strategy"] == "ddp" and plan["spec"]["lora"]["targets"] == ["q_proj", "v_proj"]
    assert plan["parameters"]["trainable"] == ran["trainable_parameters"]
    assert [r["device"] for r in plan["comparison"]] == ["cpu:0", "cpu:1"]
    for row, measured in zip(plan["comparison"], record["probe"]["devices"]):
        assert row["measured_bytes"] == measured["peak_rss_bytes"] > 0
        assert abs(row["error_pct"] - 100 * (row["planned_bytes"] - row["measured_bytes"]) / row["measured_bytes"]) \
            < 1e-9
    c = checks(record)
    assert {"trainer_state", "world_size", "trainable_set", "sample_ids"} <= set(c)
    assert "every rank (0, 1) held after step 3" in c["kill_point"]["evidence"]
    assert "SIGKILL to 3 process(es)" in c["kill"]["evidence"] and "no process of the job is left" in c["kill"]["evidence"]
    assert "2 rank(s)" in c["global_steps"]["evidence"] and "rng_state_0..1.pth" in c["world_size"]["evidence"]
    assert record["evaluation"]["base"] == str(tiny_model_dir)
    # what the hook reported is what Trainer logged: the reference's losses equal its own trainer_state.json
    run_dir = Path(record["run_dir"])
    state = json.loads((run_dir / "reference" / "out" / "checkpoint-6" / "trainer_state.json").read_text())
    assert record["evaluation"]["loss_per_step"] == [h["loss"] for h in state["log_history"] if "loss" in h]
    # each rank's own events file: every step's batch digests (each rank its own shard), saves, the end
    for rank, name in ((0, "hook-events.jsonl"), (1, "hook-events.rank1.jsonl")):
        lines = [json.loads(x) for x in (run_dir / "reference" / name).read_text().splitlines()]
        assert {e["rank"] for e in lines} == {rank}
        batches = [e for e in lines if e["kind"] == "batches"]
        assert [(b["step"], len(b["digests"]), b["widths"]) for b in batches] == [(s, 1, [32]) for s in range(1, 7)]
        assert [e["step"] for e in lines if e["kind"] == "save"] == [2, 4, 6]
        assert [e["global_step"] for e in lines if e["kind"] == "train_end"] == [6]
    assert ran["optimizer"] == "AdamW" and ran["config"]["model_type"] == "llama"
    assert verify(run_dir / "record.toml").returncode == 3


def test_an_fsdp_job_resumes_at_another_world_size_from_its_dcp_checkpoint(tmp_path):
    """Issue 39: FSDP2 + torch.distributed.checkpoint (examples/train_fsdp_dcp.py) trained on 2 ranks and resumed on 1
    (its resume line starts one process): DCP reshards on load, so the resume is allowed (``world_size``), judged
    against a twin run at the resume's world size (never bit-exact: each reduction is split otherwise), and the
    final DCP checkpoints compared as whole states whatever world size wrote their shards. Trainer's per-rank
    checkpoints at another world size, and a script's that are not DCP, are refused by name:
    tests/unit/test_command_nodeloss.py."""
    line = f"{PY} -m torch.distributed.run --standalone --nproc-per-node {{n}} {FSDP} --out {{{{out}}}} --steps 6 " \
           "--save_every 2 --step_seconds 0.2"
    record, _ = accept({"train": line.format(n=2), "resume": line.format(n=1) + " --resume {checkpoint}",
                        "metrics": "metrics.jsonl", "checkpoint_files": [".metadata", "train_state.json"],
                        "eval": "none"}, tmp_path / "runs")
    assert record["resume"]["status"] == "pass", record["verdict"]["stages"]
    assert record["resume"]["tier"]["name"] == "cpu-fp32-world-size-twin"
    c = checks(record)
    assert c["world_size"]["evidence"].startswith("checkpoint-2 is a torch.distributed.checkpoint (DCP) checkpoint "
                                                  "(2 shard file(s): __0_0.distcp, __1_0.distcp)")
    assert c["world_size"]["evidence"].endswith("written at world size 2, resumed at 1")
    assert c["loss"]["evidence"].startswith("4 resumed losses (every rank): within the noise bound")
    assert c["final_weights"]["evidence"].startswith("4 tensors of state.pt[model]: within the noise bound")
    assert c["optimizer_progress"]["evidence"].endswith("optimizer step counts [6.0] vs [6.0]")
    run_dir = Path(record["run_dir"])  # the twin ran at the resume's world size: one shard file per checkpoint
    assert sorted(p.name for p in (run_dir / "resume-twin-1" / "out" / "checkpoint-6").glob("*.distcp")) == \
        ["__0_0.distcp"]
    assert consistent(run_dir / "record.toml")


# ------------------------------------------------------------------------------------- what a command can do wrong
def test_a_command_that_exits_early_gets_a_failed_probe_naming_its_status_and_last_words(tmp_path):
    record, _ = accept(fake("--sleep 0 --exit-after 3 7"), tmp_path / "runs")
    assert stages(record) == {"plan": "not_applicable", "probe": "fail", "evaluation": "not_run", "resume": "not_run"}
    evidence = record["verdict"]["stages"]["probe"]["evidence"]
    assert "exited with status 7" in evidence and "fake_train: exiting with 7 after step 3" in evidence
    assert "did not exit 0" in record["verdict"]["stages"]["resume"]["evidence"]
    assert consistent(Path(record["run_dir"]) / "record.toml")


def test_a_command_that_writes_no_checkpoint_fails_the_resume_check_saying_so(tmp_path):
    record, _ = accept(fake("--sleep 0 --no-checkpoint"), tmp_path / "runs")
    assert stages(record)["probe"] == "pass" and stages(record)["resume"] == "fail"
    evidence = checks(record)["checkpoints"]["evidence"]
    assert "wrote 0 checkpoint(s) matching checkpoint-*" in evidence and "kill_after_checkpoint" not in evidence
    assert any("no checkpoint" in f for f in record["probe"]["findings"])
    # a glob that matches nothing the command wrote: what the output folder does hold is named
    wrong, _ = accept(fake("--sleep 0", checkpoints="ckpt_*"), tmp_path / "wrong")
    evidence = checks(wrong)["checkpoints"]["evidence"]
    assert "holds checkpoint-4/, checkpoint-8/, metrics.jsonl" in evidence and "command.checkpoints" in evidence


def test_a_command_that_writes_no_metrics_fails_the_resume_check_saying_so(tmp_path):
    record, _ = accept(fake("--sleep 0 --no-metrics"), tmp_path / "runs")
    assert stages(record)["resume"] == "fail"
    assert "no per-step metrics" in checks(record)["metrics"]["evidence"]
    assert "not written" in record["probe"]["metrics_source"]
    assert "steps not known (no per-step metrics)" in record["verdict"]["stages"]["probe"]["evidence"]
    bad, _ = accept(fake("--sleep 0 --bad-metrics"), tmp_path / "bad")  # lines written, none a step: said, with why
    assert "8 line(s) read, none a step: metrics.jsonl line 1: needs an integer step and a finite loss" in \
        checks(bad)["metrics"]["evidence"]


def test_a_correct_resume_passes_and_a_resume_that_loses_state_fails(tmp_path):
    good, _ = accept(fake(), tmp_path / "good")
    assert good["verdict"]["status"] == "pass" and checks(good)["states"]["evidence"].startswith("state.json equal")
    bad, _ = accept(fake("--forget-sum"), tmp_path / "bad")
    assert checks(bad)["states"]["status"] == "fail" and "state.json differs at sum" in checks(bad)["states"]["evidence"]
    assert checks(bad)["loss"]["status"] == "fail"


def test_a_kill_that_comes_after_the_next_checkpoint_is_tried_again_and_each_miss_is_kept(tmp_path):
    """From outside a script is killed when its metrics show step k; a script whose lines arrive after its next
    checkpoint (a busy poller, a buffered file) is killed too late, which says nothing of its resume: the interrupted
    run is started again, the miss kept in its own folder and named. A script late every time fails its kill point
    after the last attempt, each miss named."""
    record, _ = accept(fake(f"--late-runs 2 --counter {tmp_path / 'count-once'}"), tmp_path / "once")
    point = checks(record)["kill_point"]
    assert record["verdict"]["status"] == "pass", record["verdict"]
    assert "(attempt 2 of 3: attempt 1 was killed after checkpoint-8 was complete (resume-interrupted-attempt-1/))" \
        in point["evidence"]
    run_dir = Path(record["run_dir"])
    assert (run_dir / "resume-interrupted-attempt-1" / "out" / "checkpoint-8" / "state.json").is_file()
    assert record["resume"]["runs"]["interrupted-attempt-1"]["log"].startswith(
        str(run_dir / "resume-interrupted-attempt-1"))
    assert consistent(Path(run_dir) / "record.toml")
    always, _ = accept(fake(f"--late-runs 2,3,4 --counter {tmp_path / 'count-always'}"), tmp_path / "always")
    point = checks(always)["kill_point"]
    assert point["status"] == "fail" and stages(always)["resume"] == "fail"
    assert "checkpoint-8 was already complete at the kill" in point["evidence"]
    assert "(attempt 3 of 3: attempt 1 was killed after checkpoint-8 was complete (resume-interrupted-attempt-1/); " \
           "attempt 2 was killed after checkpoint-8 was complete (resume-interrupted-attempt-2/))" in point["evidence"]


def test_no_process_of_the_job_outlives_a_kill_or_the_run_that_started_it(tmp_path):
    """``--detach`` starts a helper in a session of its own in each run: the interrupted run's is killed with it
    (found by the job's token, not by the tree), the others are ended when their run has exited (a finding)."""
    record, _ = accept(fake("--detach"), tmp_path / "runs")
    run_dir = Path(record["run_dir"])
    pids = {p.parent.parent.name: int(p.read_text()) for p in run_dir.glob("*/out/detached.pid")}
    assert set(pids) == {"reference", "resume-interrupted", "resume-resumed"}
    assert not [name for name, pid in pids.items() if alive(pid)]
    assert str(pids["resume-interrupted"]) in checks(record)["kill"]["evidence"]
    assert any("left 1 process(es) running after it exited" in f for f in record["probe"]["findings"])


def _start_headless(tmp_path: Path, extra: str, env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    runs = tmp_path / "runs"
    proc = subprocess.Popen([GPUACCEPT, "run", "--headless", "--runs-dir", str(runs), "--command",
                             f"{PY} {FAKE} --out {{out}} {extra}", "--metrics", "metrics.jsonl", "--eval", "none",
                             "--checkpoint-files", "state.json"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=None if env is None else {**os.environ, **env})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = list(runs.glob("*/reference/out/detached.pid"))
        if found and found[0].read_text():
            return proc, found[0]
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"the command never started: {proc.communicate()}")


def test_a_quit_kills_every_process_of_the_job_and_keeps_what_was_measured(tmp_path):
    """SIGINT to a headless run while the command trains: exit 130, the command, its ranks and its detached helper
    are gone, and the record says the probe was cancelled."""
    proc, pid_file = _start_headless(tmp_path, "--detach --steps 400 --sleep 0.05")
    helper = int(pid_file.read_text())
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    assert not alive(helper)
    record = tomllib.loads((pid_file.parents[2] / "record.toml").read_text())
    assert record["verdict"]["stages"]["probe"]["status"] == "cancelled"
    # what was measured until the quit is kept, marked cancelled, and verify agrees
    probe = record["probe"]
    assert probe["provenance"] == "measured" and probe["status"] == "cancelled" and probe["exit_code"] == "killed"
    assert probe["steps"] > 0 and probe["devices"][0]["measured_bytes"] > 0
    assert consistent(pid_file.parents[2] / "record.toml")
    job = json.loads((pid_file.parents[1] / "job.json").read_text())
    assert job["argv"][0] == PY and not [p for p in psutil.process_iter() if _holds_token(p, job)]


def _job_as_started(path: Path) -> dict:
    """``job.json`` once gpuaccept has written the keeper's words into it (the command may run, and write its pid
    files, a moment before that second write lands)."""
    deadline = time.monotonic() + 30
    job = json.loads(path.read_text())
    while "containment" not in job and time.monotonic() < deadline:
        time.sleep(0.05)
        job = json.loads(path.read_text())
    return job


def _holds_token(p: psutil.Process, job: dict) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE and p.environ().get("GPUACCEPT_JOB") == job["env_added"]["GPUACCEPT_JOB"]
    except psutil.Error:
        return False


def test_a_kill_9_of_gpuaccept_leaves_no_process_of_the_job(tmp_path):
    """gpuaccept SIGKILLed cannot kill anything: every Python process of the job (the command and its detached
    helper) ends itself within seconds (core/child/inject/sitecustomize.py watches gpuaccept's pid), and a process
    of another program (``sleep`` in a session of its own) is ended by the reaper gpuaccept started."""
    proc, pid_file = _start_headless(tmp_path, "--detach --detach-shell --steps 400 --sleep 0.05")
    helper = int(pid_file.read_text())
    sleeper = pid_file.with_name("sleep.pid")
    while not sleeper.is_file() or not sleeper.read_text():
        time.sleep(0.05)
    shell = int(sleeper.read_text())
    command = json.loads((pid_file.parents[1] / "job.json").read_text())
    proc.kill()  # SIGKILL to gpuaccept alone: its children are in sessions of their own
    proc.wait(timeout=30)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (alive(helper) or alive(shell) or
                                           [p for p in psutil.process_iter() if _holds_token(p, command)]):
        time.sleep(0.1)
    assert not alive(helper) and not [p.pid for p in psutil.process_iter() if _holds_token(p, command)]
    assert not alive(shell)  # `sleep` has no lifeline: gpuaccept's reaper (core/command/reaper.py) ended it


@pytest.mark.parametrize(("containment", "keeper_too"), [("auto", False), ("subreaper", False), ("subreaper", True)],
                         ids=["auto", "subreaper", "subreaper-keeper-killed-too"])
def test_a_daemon_that_leaves_no_trace_dies_with_a_kill_9_of_gpuaccept(tmp_path, containment, keeper_too):
    """Issue 35: a grandchild that double-forks, calls setsid(), closes its descriptors, clears its environment and
    execs ``sleep 2222`` survived ``kill -9`` of gpuaccept, re-parented to PID 1. It is held by the job's cgroup where
    one can be made (root here: ``auto``), else by the keeper as its subreaper (``subreaper``): gone either way.
    Issue 52: with the keeper SIGKILLed too (subreaper mode), nothing held it: the reaper found no token in its
    environment. The keeper's list of the command's processes (``job-pids.json``) is what the reaper kills now."""
    proc, pid_file = _start_headless(tmp_path, "--detach --detach-clean --steps 400 --sleep 0.05",
                                     env={"GPUACCEPT_CONTAINMENT": containment})
    daemon_file = pid_file.with_name("clean.pid")
    deadline = time.monotonic() + 30
    while not (daemon_file.is_file() and daemon_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    daemon = int(daemon_file.read_text())
    assert alive(daemon) and psutil.Process(daemon).ppid() != 1  # adopted by the keeper, not by init
    job = _job_as_started(pid_file.parents[1] / "job.json")
    if containment == "subreaper":
        assert job["cgroup"] is None and job["containment"].startswith("subreaper (PR_SET_CHILD_SUBREAPER)")
    elif job["cgroup"]:
        assert job["containment"].startswith("cgroup v2") and daemon in _cgroup_pids(job["cgroup"])
    keeper = psutil.Process(daemon).ppid()
    assert "keeper.py" in " ".join(psutil.Process(keeper).cmdline())
    if keeper_too:  # the keeper's list holds the daemon before both are killed (it is looked for every 0.5 s)
        listed = pid_file.parents[1] / "job-pids.json"
        deadline = time.monotonic() + 5
        while daemon not in dict(json.loads(listed.read_text()).get("pids", [])) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(keeper, signal.SIGKILL)
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while (alive(daemon) or job["cgroup"] and Path(job["cgroup"]).exists()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(daemon), f"{daemon} outlived gpuaccept ({job['containment']})"
    assert not job["cgroup"] or not Path(job["cgroup"]).exists()  # the job's cgroup is removed with it


@pytest.fixture
def memory_cgroup():
    """A memory cgroup limited to 64 MiB, no swap (cgroup v1's memory controller, or v2's), removed after; skipped
    where none can be made (not root)."""
    import uuid

    name = f"gpuaccept-test-oom-{uuid.uuid4().hex[:8]}"
    for base, limits in ((Path("/sys/fs/cgroup/memory"), ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")),
                         (Path("/sys/fs/cgroup"), ("memory.max", "memory.swap.max"))):
        folder = base / name
        try:
            folder.mkdir()
        except OSError:
            continue
        try:
            for limit in limits:
                (folder / limit).write_text("0" if limit == "memory.swap.max" else str(64 * 2**20))
        except OSError:
            folder.rmdir()
            continue
        yield folder
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                folder.rmdir()
                break
            except OSError:
                time.sleep(0.1)
        return
    pytest.skip("no memory cgroup with a limit can be made here (needs root)")


def test_a_command_the_oom_killer_ends_is_named_out_of_memory(tmp_path, memory_cgroup):
    """Issue 35: an OOM kill in command mode read "the command exited with status -9 after 3.5 s: " with nothing
    after the colon, while the cgroup's oom_kill rose."""
    record, _ = accept(fake(f"--oom-in {memory_cgroup}"), tmp_path / "runs")
    probe = record["verdict"]["stages"]["probe"]
    assert probe["status"] == "fail", probe
    assert "exited with status -9 (SIGKILL): out of memory: the kernel's OOM killer ended a process" in \
        probe["evidence"], probe["evidence"]
    assert "its last words: fake_train: allocating until the OOM killer ends me" in probe["evidence"]


def _cgroup_pids(folder: str) -> list[int]:
    return [int(x) for x in (Path(folder) / "cgroup.procs").read_text().split()]


# ------------------------------------------------------------------------------------- the record and verify
@pytest.fixture(scope="session")  # not module: a module fixture ties the file's tests to one worker (conftest.py)
def fake_record(tmp_path_factory) -> Path:
    record, _ = accept(fake(), tmp_path_factory.mktemp("fake"))
    assert record["verdict"]["status"] == "pass"
    return Path(record["run_dir"]) / "record.toml"


@pytest.mark.parametrize("edit, words", [
    (lambda r: r["resume"]["comparison"][1].update(loss_resumed=r["resume"]["comparison"][1]["loss_resumed"] + 0.5),
     "difference is"),
    (lambda r: r["resume"]["checks"].pop(0), "resume passes without the checks checkpoints"),
    (lambda r: r["probe"].update(exit_code=1), "verdict.stages.probe says pass, its data says fail"),
    (lambda r: r["probe"]["devices"][0].update(capacity_bytes=1), "fits says True, its bytes say False"),
    (lambda r: r["spec"]["command"].update(kill_after_checkpoint=2), "spec.hash is not the sha256"),
    (lambda r: r["verdict"].update(status="fail"), "verdict.status says fail, the stages say pass"),
    (lambda r: r["resume"].update(kill_step=r["resume"]["next_checkpoint_step"] + 1), "steps are out of order"),
    (lambda r: next(c for c in r["resume"]["checks"] if c["name"] == "loss").update(largest_difference=0.25),
     "passed on an exact tier with largest difference 0.25"),
])
def test_verify_recomputes_a_command_records_verdicts_and_catches_an_edit(fake_record, tmp_path, edit, words):
    from core.record.verify import record_problems

    record = tomllib.loads(fake_record.read_text())
    assert record_problems(record) == ([], [])
    edit(record)
    schema, verdicts = record_problems(record)
    assert any(words in p for p in schema + verdicts), (schema, verdicts)


# ------------------------------------------------------------------------------------- the wizard
async def test_the_wizard_accepts_your_own_command_and_writes_its_record(tmp_path):
    """Mode 5 (your own command) -> the command form, validated as typed (no {out}: the error under the field; a
    criterion that is no number: under its field) ->
    every stage with its evidence -> the sign-off writes a record of kind command that verifies; Esc from the sign-off
    shows the results again without running the command again."""
    from textual.widgets import Button, Input

    from tests.wizard_helpers import make_app, text_of, wait_for
    from tui.screens.command import CommandRunScreen, CommandSetupScreen
    from tui.screens.export import ExportScreen

    app = make_app(ROOT, tmp_path / "runs")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press(str(len([m for m in METHODS.values() if m.runs]) + 1), "enter")  # your own command: after the methods
        assert isinstance(app.screen, CommandSetupScreen) and app.screen.query_one("#next", Button).disabled
        form = {"train": f"{PY} {FAKE}", "resume": "{command} --resume {checkpoint}",
                "metrics": "metrics.jsonl", "checkpoint_files": "state.json", "eval": "none"}
        for key, value in form.items():
            app.screen.query_one(f"#c-{key}", Input).value = value
        await pilot.pause()
        assert "put {out} where your script" in text_of(app.screen.query_one("#cerr-train"))
        # 0.3 s a step: the kill from outside lands when the metrics show step 6, and on a busy 2-core machine the
        # Textual loop beside the pipeline once let the script reach step 8 (its next checkpoint) at 0.05 s a step
        app.screen.query_one("#c-train", Input).value = form["train"] + " --out {out} --sleep 0.3"
        await pilot.pause()
        assert not app.screen.query_one("#cerr-train").display and app.state.command_spec is not None
        # the criteria on the same form: a bad value is named under its field and holds Next back
        app.screen.query_one("#c-accept_max_step_time_s", Input).value = "fast"
        await pilot.pause()
        assert "a number" in text_of(app.screen.query_one("#cerr-accept_max_step_time_s"))
        assert app.state.command_spec is None and app.screen.query_one("#next", Button).disabled
        app.screen.query_one("#c-accept_max_step_time_s", Input).value = "60"
        app.screen.query_one("#c-accept_resume_tier", Input).value = "exact"
        await pilot.pause()
        assert app.state.command_criteria.max_step_time_s == 60.0 and app.state.command_spec is not None
        await pilot.press("ctrl+n")
        assert isinstance(app.screen, CommandRunScreen)
        await wait_for(pilot, lambda: not app.screen.query_one("#next", Button).disabled, 120)
        from rich.text import Text

        shown = Text.from_markup(text_of(app.screen.query_one("#stages"))).plain
        assert "✓ uninterrupted run (probe) pass" in shown and "✓ kill and resume pass" in shown, shown
        probe_pid = app.state.run.reference.pid
        await pilot.press("ctrl+n")
        assert isinstance(app.screen, ExportScreen)
        assert "your command fake_train.py" in text_of(app.screen.query_one("#overall"))
        await pilot.press("escape")
        assert isinstance(app.screen, CommandRunScreen) and app.state.run.reference.pid == probe_pid
        await pilot.press("ctrl+n")
        await pilot.press(*"Ada")
        app.screen.query_one("#decision").value = "accept"
        app.screen.query_one("#write", Button).press()
        await wait_for(pilot, lambda: app.state.record_path is not None, 60)
    record = tomllib.loads(app.state.record_path.read_text())
    assert record["kind"] == "command" and record["signoff"]["operator"] == "Ada"
    assert record["verdict"]["status"] == "pass" and consistent(app.state.record_path)
    assert record["accept"]["max_step_time_s"] == 60.0 and record["accept"]["resume_tier"] == "exact"
    rows = {r["criterion"]: r for r in record["verdict"]["stages"]["probe"]["criteria"]}
    assert rows["max_step_time_s"]["met"] and 0 < rows["max_step_time_s"]["value"] < 60


def test_your_own_evaluation_command_is_run_on_the_base_and_the_final_checkpoint(tmp_path):
    """``eval`` as a command: its last JSON line with metric and value, on the base (command.model) and on the newest
    checkpoint, judged in its own direction and recorded with its definition."""
    base = tmp_path / "base"
    base.mkdir()
    record, _ = accept(fake(model=str(base), eval=f"{PY} {FAKE.with_name('fake_eval.py')} {{checkpoint}}"),
                       tmp_path / "runs")
    ev = record["evaluation"]
    assert ev["status"] == "pass" and ev["metric"] == "fake loss" and ev["higher_is_better"] is False
    assert ev["before"]["value"] == 10.0 and ev["after"]["value"] < 10.0 and ev["checkpoint"] == "checkpoint-8"
    assert ev["definition"] == "10 / (1 + the running sum of the checkpoint)"
    assert consistent(Path(record["run_dir"]) / "record.toml")
    vague, _ = accept(fake(model=str(base), resume_check=False,
                           eval=f"{PY} {FAKE.with_name('fake_eval.py')} {{checkpoint}} --no-direction"),
                      tmp_path / "vague")
    assert vague["evaluation"]["status"] == "fail" and "which way is better" in vague["evaluation"]["summary"]


def test_criteria_judge_a_command_and_verify_recomputes_their_rows(tmp_path):
    """``gpuaccept run --headless --command ... --max-step-time --max-device-share``: the record holds the accept
    table and the probe's criteria rows (each device's share, the step time over the command's logged steps);
    ``verify`` recomputes them and finds a threshold edited in the accept table. A step-time limit the command cannot
    meet fails the probe, the missed row saying why, and the record stays consistent."""
    import tomli_w

    def run(step_limit: str) -> dict:
        cmd = fake("--sleep 0.05")
        done = subprocess.run(
            [GPUACCEPT, "run", "--headless", "--runs-dir", str(tmp_path / step_limit), "--command", cmd["train"],
             "--resume-command", cmd["resume"], "--metrics", "metrics.jsonl", "--checkpoint-files", "state.json",
             "--eval", "none", "--workdir", str(ROOT), "--max-step-time", step_limit, "--max-device-share", "0.95",
             "--resume-tier", "exact"], capture_output=True, text=True, timeout=300)
        record_path = next((tmp_path / step_limit).glob("*/record.toml"))
        return {"rc": done.returncode, "path": record_path, "record": tomllib.loads(record_path.read_text())}

    ok = run("60")
    rec = ok["record"]
    assert rec["accept"]["max_step_time_s"] == 60.0 and rec["accept"]["max_device_share"] == 0.95
    rows = rec["verdict"]["stages"]["probe"]["criteria"]
    assert [r["criterion"] for r in rows] == ["max_device_share", "max_step_time_s"] and all(r["met"] for r in rows)
    assert 0.04 < rows[1]["value"] < 60 and rows[1]["on"].startswith("the command's logged steps")
    assert [r["criterion"] for r in rec["verdict"]["stages"]["resume"]["criteria"]] == ["resume_tier"]
    assert ok["rc"] == 0 and rec["verdict"]["status"] == "pass" and verify(ok["path"]).returncode == 3
    rec["accept"]["max_step_time_s"] = 0.001  # the threshold edited after the run: the rows no longer follow
    edited = tmp_path / "edited.toml"
    edited.write_text(tomli_w.dumps(rec))
    out = verify(edited)
    assert out.returncode == 6 and "verdict.stages.probe.criteria[1] says" in out.stdout, out.stdout

    slow = run("0.000001")
    rec = slow["record"]
    row = rec["verdict"]["stages"]["probe"]["criteria"][1]
    assert (row["criterion"], row["met"]) == ("max_step_time_s", False) and rec["verdict"]["stages"]["probe"]["status"] \
        == "fail" and "max_step_time_s" in rec["verdict"]["stages"]["probe"]["evidence"]
    assert slow["rc"] == 1 and verify(slow["path"]).returncode == 3
