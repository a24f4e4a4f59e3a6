"""The example training scripts under examples/ (what a team brings to gpuaccept's command mode, issue 21), run as a
user runs them: their own checkpoints and their own ``--resume``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLAIN = ROOT / "examples" / "train_plain.py"


def _train(model: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(PLAIN), "--model", str(model), "--out", str(out), "--steps", "6",
                           "--checkpoint-every", "2", *extra], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plain") / "uninterrupted"
    _train(tiny_model_dir, out)
    return out


def test_the_plain_loop_resumed_from_its_checkpoint_continues_as_the_uninterrupted_run(tiny_model_dir, uninterrupted,
                                                                                      tmp_path):
    """Resumed from checkpoint-2 (a copy, as if the run had been killed after it), steps 3-6 take the same samples at
    the same learning rates with the same losses (CPU fp32: bit for bit), and end on the same weights."""
    from safetensors.torch import load_file

    copy = tmp_path / "checkpoint-2"
    shutil.copytree(uninterrupted / "checkpoint-2", copy)
    assert sorted(p.name for p in copy.iterdir()) == ["config.json", "model.safetensors", "optimizer.pt",
                                                      "progress.json", "rng.pt", "scheduler.pt"]
    resumed = tmp_path / "resumed"
    _train(tiny_model_dir, resumed, "--resume", str(copy))
    reference = _metrics(uninterrupted)
    assert [m["step"] for m in reference] == [1, 2, 3, 4, 5, 6]
    assert _metrics(resumed) == reference[2:]
    final, again = (load_file(str(d / "checkpoint-6" / "model.safetensors")) for d in (uninterrupted, resumed))
    assert final.keys() == again.keys() and all(bool((final[k] == again[k]).all()) for k in final)


def test_a_checkpoint_without_the_optimizer_state_resumes_on_the_same_samples_but_not_the_same_losses(
        tiny_model_dir, uninterrupted, tmp_path):
    """``--forget-optimizer`` (the deliberate bug): no optimizer.pt; the resumed run starts AdamW from zero moments.
    Its first step after the checkpoint matches (the moments only act through the update), every later loss differs,
    while the samples and learning rates are those of the uninterrupted run: what the resume check must catch."""
    forgetful = tmp_path / "forgetful"
    _train(tiny_model_dir, forgetful, "--forget-optimizer")
    assert not (forgetful / "checkpoint-2" / "optimizer.pt").exists()
    resumed = tmp_path / "resumed"
    done = _train(tiny_model_dir, resumed, "--resume", str(forgetful / "checkpoint-2"))
    assert "no optimizer.pt: AdamW starts again from zero moments" in done.stderr
    reference, after = _metrics(uninterrupted)[2:], _metrics(resumed)
    assert [(m["step"], m["sample_ids"], m["learning_rate"]) for m in after] == \
        [(m["step"], m["sample_ids"], m["learning_rate"]) for m in reference]
    assert after[0]["loss"] == reference[0]["loss"]
    assert all(a["loss"] != r["loss"] for a, r in zip(after[1:], reference[1:]))


HF = ROOT / "examples" / "train_hf.py"


def test_the_trainer_script_resumed_by_trainer_continues_as_the_uninterrupted_run(tiny_model_dir, tmp_path):
    """Trainer + PEFT LoRA, Trainer's own checkpoints and ``--resume_from_checkpoint`` (a copy of checkpoint-2): the
    log history in the last checkpoint's trainer_state.json and the adapter weights equal the uninterrupted run's."""
    from safetensors.torch import load_file

    def train(out: Path, *extra: str) -> None:
        done = subprocess.run([sys.executable, str(HF), "--model", str(tiny_model_dir), "--out", str(out),
                               "--max_steps", "6", "--save_steps", "2", *extra], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]

    def history(out: Path) -> list[tuple]:
        state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
        return [(h["step"], h["loss"], h["learning_rate"]) for h in state["log_history"] if "loss" in h]

    train(tmp_path / "uninterrupted")
    shutil.copytree(tmp_path / "uninterrupted" / "checkpoint-2", tmp_path / "copy")
    train(tmp_path / "resumed", "--resume_from_checkpoint", str(tmp_path / "copy"))
    reference = history(tmp_path / "uninterrupted")
    assert [step for step, *_ in reference] == [1, 2, 3, 4, 5, 6]
    assert history(tmp_path / "resumed") == reference
    final, again = (load_file(str(tmp_path / run / "checkpoint-6" / "adapter_model.safetensors"))
                    for run in ("uninterrupted", "resumed"))
    assert final.keys() == again.keys() and all(bool((final[k] == again[k]).all()) for k in final)


INJECT = ROOT / "core" / "child" / "inject"


def test_the_trainer_hook_reports_what_the_users_script_ran_without_a_change_to_it(tiny_model_dir, tmp_path):
    """The command mode's inside view (issue 21): with core/child/inject on PYTHONPATH and GPUACCEPT_EVENTS set, the
    unchanged Trainer script reports its TrainingArguments, its model's parameters and every logged step, whose losses
    and learning rates are the ones Trainer itself logged; a process that never imports transformers is not made to."""
    import os

    events = tmp_path / "events.jsonl"
    env = {**os.environ, "PYTHONPATH": f"{INJECT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "GPUACCEPT_EVENTS": str(events)}
    done = subprocess.run([sys.executable, str(HF), "--model", str(tiny_model_dir), "--out", str(tmp_path / "out"),
                           "--max_steps", "4", "--save_steps", "2"], capture_output=True, text=True, timeout=600,
                          env=env)
    assert done.returncode == 0 and "hook was not installed" not in done.stderr, done.stderr[-3000:]
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    trainer, steps = lines[0], [e for e in lines if e["kind"] == "step"]
    assert trainer["kind"] == "trainer" and trainer["world_size"] == 1 and trainer["rank"] == 0
    args = trainer["arguments"]
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"], args["max_steps"],
            args["save_steps"]) == (2, 1, 4, 2)
    assert trainer["model"] == "PeftModelForCausalLM" and 0 < trainer["trainable_parameters"] < trainer["parameters"]
    state = json.loads((tmp_path / "out" / "checkpoint-4" / "trainer_state.json").read_text())
    logged = [(h["step"], h["loss"], h["learning_rate"]) for h in state["log_history"] if "loss" in h]
    assert [(s["step"], s["loss"], s["learning_rate"]) for s in steps] == logged and len(logged) == 4
    assert all(s["peak_rss_bytes"] > 0 for s in steps)
    # what each step trained on (one micro-batch of 2 x 32 tokens), the checkpoints as Trainer saved them, the end
    batches = [e for e in lines if e["kind"] == "batches"]
    assert [(b["step"], len(b["digests"]), b["widths"]) for b in batches] == [(s, 1, [32]) for s in (1, 2, 3, 4)]
    assert len({b["digests"][0] for b in batches}) == 4  # four different batches
    assert [e["step"] for e in lines if e["kind"] == "save"] == [2, 4]
    assert [e["global_step"] for e in lines if e["kind"] == "train_end"] == [4]
    assert trainer["peft"]["r"] == 8 and sorted(trainer["peft"]["target_modules"]) == ["q_proj", "v_proj"]
    assert trainer["config"]["model_type"] == "llama" and trainer["optimizer"] == "AdamW"
    plain = subprocess.run([sys.executable, "-c", "import sys; print('transformers' in sys.modules)"],
                           capture_output=True, text=True, env=env, timeout=60)
    assert plain.stdout.strip() == "False" and plain.stderr == ""


def test_under_torchrun_every_rank_of_the_users_trainer_reports_itself(tiny_model_dir, tmp_path):
    """Two gloo ranks on the CPU (torchrun, the script unchanged): each rank reports world size 2 and its own rank,
    and both log the same (all-reduced) loss at every step."""
    import os

    events = tmp_path / "events.jsonl"
    env = {**os.environ, "PYTHONPATH": f"{INJECT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "GPUACCEPT_EVENTS": str(events), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(HF), "--model", str(tiny_model_dir), "--out", str(tmp_path / "out"), "--max_steps", "3",
                           "--save_steps", "3"], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    trainers = sorted((e["rank"], e["world_size"]) for e in lines if e["kind"] == "trainer")
    assert trainers == [(0, 2), (1, 2)]
    by_rank = {r: [(e["step"], e["loss"]) for e in lines if e["kind"] == "step" and e["rank"] == r] for r in (0, 1)}
    assert [s for s, _ in by_rank[0]] == [1, 2, 3] and by_rank[0] == by_rank[1]
