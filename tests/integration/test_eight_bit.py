"""bitsandbytes' 8-bit AdamW (a variant) through every stage on a tiny Llama: planned from its layout, probed, trained,
killed and resumed with the 8-bit states compared exactly, recorded."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from core.events import RunFinished
from core.pipeline import run_pipeline
from core.spec import RunSpec
from tests.conftest import make_tiny_llama


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory) -> Path:
    """Hidden 64 and MLP 160: q/o projections of 4,096 elements and MLP weights of 10,240 get 8-bit states; norms
    (64) and k/v (2,048) stay fp32 (under 4,096), and so does the embedding (Trainer gives it 32-bit states)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny64"), hidden=64, intermediate=160)


def _run(spec: RunSpec, runs: Path) -> dict:
    events = list(run_pipeline(spec, runs_root=runs))
    assert isinstance(events[-1], RunFinished)
    return tomllib.loads(Path(events[-1].record_path).read_text())


def _common(record: dict) -> None:
    stages = record["verdict"]["stages"]
    assert [stages[s]["status"] for s in ("plan", "probe", "resume")] == ["pass"] * 3, stages
    assert all(record["evaluation"][when]["perplexity"] > 1.0 for when in ("before", "after"))
    plan, probe = record["plan"]["devices"][0], record["probe"]["devices"][0]
    # the 8-bit states as planned from bitsandbytes' layout are the bytes the optimizer held after a step, exactly
    assert plan["components"]["optimizer_states"] == probe["optimizer_states_bytes"]
    assert plan["methods"]["optimizer_states"].startswith("bitsandbytes AdamW8bit (a variant)")
    assert record["plan"]["traced"]["status"] == "not_run" and "bitsandbytes" in record["plan"]["traced"]["reason"]
    checks = {c["name"]: c for c in record["resume"]["checks"]}
    assert record["resume"]["status"] == "pass", record["resume"]["checks"]
    assert checks["optimizer_moments"]["status"] == "pass"  # the uint8 moments and their absmax resumed exactly


def test_full_fine_tuning_with_adamw_8bit_passes_every_stage_and_resumes_its_8_bit_states(tiny64, tmp_path):
    spec = RunSpec.build(model=str(tiny64), mode="full", optimizer="adamw_8bit", steps=4, seq_len=32,
                         resume_checkpoint_every=2, resume_kill_after_checkpoint=1, eval_max_blocks=2)
    record = _run(spec, tmp_path)
    _common(record)
    # full fine-tuning moves the random model's held-out perplexity down in 4 steps (4 LoRA steps on it need not)
    assert record["verdict"]["status"] == "pass", record["verdict"]
    method = record["plan"]["devices"][0]["methods"]["optimizer_states"]
    assert "for 10 tensors of 77,824 elements" in method  # q, o (4,096 each) and gate, up, down (10,240) x 2 layers


def test_lora_with_adamw_8bit_passes_every_stage_and_resumes_its_8_bit_states(tiny64, tmp_path):
    spec = RunSpec.build(model=str(tiny64), mode="lora", optimizer="adamw_8bit", lora_r=64, steps=4, seq_len=32,
                         resume_checkpoint_every=2, resume_kill_after_checkpoint=1, eval_max_blocks=2)
    record = _run(spec, tmp_path)
    _common(record)
    method = record["plan"]["devices"][0]["methods"]["optimizer_states"]
    # per layer, r = 64: q's lora_A and lora_B and v's lora_A hold 64 x 64 = 4,096 elements (8-bit from 4,096 on); v's
    # lora_B is 32 x 64 = 2,048 (v projects to 2 KV heads x 16), under the threshold: fp32
    assert "for 6 tensors of 24,576 elements" in method and "fp32 moments (8 B) for 2 tensors of 4,096" in method
