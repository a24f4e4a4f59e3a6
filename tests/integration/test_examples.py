"""The Trainer hook of command mode (core/child/inject) on the unchanged examples/train_hf.py, run by hand: what it
reports. The examples accepted end to end in command mode (resumed exactly, the broken resume failed, torchrun's
ranks) are tests/integration/test_command_mode.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HF = ROOT / "examples" / "train_hf.py"
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
