"""The variants through every stage on a tiny Llama: bitsandbytes' 8-bit AdamW and QLoRA's 4-bit base, each planned
from its layout, probed, trained, killed and resumed (the 8-bit states and the adapters over the 4-bit base compared
exactly), recorded."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from core.events import RunFinished
from core.pipeline import run_pipeline
from core.spec import RunSpec
from tests import records
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
    # the uint8 moments, their absmax and the maps resumed exactly (bitsandbytes nests them: every one compared)
    assert checks["optimizer_moments"]["status"] == "pass" and int(checks["optimizer_moments"]["evidence"].split()[0]) > 8


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


def test_qlora_passes_every_stage_its_4_bit_weights_measure_as_planned_and_it_resumes_exactly(tiny64, tmp_path):
    """QLoRA with gradient checkpointing (peft's prepare, then the spec's checkpointing) and plain absmax constants
    (the committed record has double quantisation and 8-bit AdamW)."""
    spec = RunSpec.build(model=str(tiny64), mode="qlora", qlora_double_quant=False, gradient_checkpointing=True,
                         lora_targets="all-linear", learning_rate=3e-3, steps=4, seq_len=32,
                         resume_checkpoint_every=2, resume_kill_after_checkpoint=1, eval_max_blocks=2)
    record = _run(spec, tmp_path)
    stages = record["verdict"]["stages"]
    assert [stages[s]["status"] for s in ("plan", "probe", "resume")] == ["pass"] * 3, stages
    plan, probe = record["plan"]["devices"][0], record["probe"]["devices"][0]
    quantised = record["plan"]["quantised"]
    assert quantised["layers"] == 14 and quantised["double_quant"] is False
    # the 4-bit weights as stored and every weight the model holds, as planned from the layout, to the byte
    row = record["probe"]["plan_comparison"][0]
    assert row["components"]["quantised_weights"]["planned_bytes"] == probe["quantised_weights_bytes"] == \
        quantised["packed_bytes"] + quantised["constants_bytes"]
    assert plan["components"]["weights"] == probe["weights_bytes"]
    assert plan["methods"]["weights"].startswith("QLoRA (a variant: the base stored in 4 bits)")
    assert "dequantised" in plan["methods"]["temporaries"]
    assert abs(row["error_pct"]) < 1.0, row  # the step's peak: the dequantised layer and checkpointing planned
    assert record["plan"]["traced"]["status"] == "not_run" and "4-bit" in record["plan"]["traced"]["reason"]
    checks = {c["name"]: c["status"] for c in record["resume"]["checks"]}
    assert checks["final_weights"] == checks["optimizer_moments"] == checks["loss"] == "pass", checks
    assert record["spec"]["qlora"] == {"quant_type": "nf4", "double_quant": False}
    assert record["environment"]["bitsandbytes"] == "0.50.2"
    # the committed QLoRA record (the quiz and verify read it) has every key a fresh QLoRA run writes
    assert records.key_paths(records.committed("qlora")) == records.key_paths(record)


def test_qlora_with_a_bf16_compute_dtype_measures_as_planned(tiny64, tmp_path):
    """A 16-bit compute dtype: the 4-bit layers take their input in bf16 and give their output back in fp32 (the
    residual stays fp32 after prepare_model_for_kbit_training), nothing saved but the packed weight; the fp32 LM head is
    cast by autocast as under amp. The plan's peak is the probe's within 1 % (measured 0.015 % here)."""
    spec = RunSpec.build(model=str(tiny64), mode="qlora", dtype="bf16", steps=2, seq_len=32, resume_check=False,
                         eval_max_blocks=1)
    record = _run(spec, tmp_path)
    assert record["verdict"]["stages"]["probe"]["status"] == "pass", record["verdict"]["stages"]
    row = record["probe"]["plan_comparison"][0]
    assert abs(row["error_pct"]) < 1.0, row
    assert record["plan"]["devices"][0]["components"]["weights"] == record["probe"]["devices"][0]["weights_bytes"]
