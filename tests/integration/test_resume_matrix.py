"""The kill-point matrix on the tiny model (issue 6): one uninterrupted run is the reference, then for each kill point an
interrupted run is SIGKILLed there and a resumed run is compared with the reference step by step.

LoRA with dropout 0.1 so the random generators advance at every step (the RNG checks would be vacuous otherwise), and
gradient accumulation 2 so "one micro-step either side of the boundary" is a different moment from the boundary.
"""

from __future__ import annotations

import pytest

from core.spec import RunSpec
from core.stages.resume import run_resume_check
from core.stages.train import run_train_eval

# compared to the last step (compare_steps 4 after checkpoint-2): the whole run after the kill, for every kill point
SETTINGS = dict(mode="lora", steps=6, seq_len=64, grad_accum=2, lora_dropout=0.1, resume_checkpoint_every=2,
                resume_kill_after_checkpoint=1, resume_compare_steps=4, eval_max_blocks=4)


def drain(gen):
    try:
        while True:
            next(gen)
    except StopIteration as stop:
        return stop.value


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    spec = RunSpec.build(model=str(tiny_model_dir), **SETTINGS)
    result, _ = drain(run_train_eval(spec, tiny_model_dir, tmp_path_factory.mktemp("reference"), "cpu"))
    return result


@pytest.mark.parametrize("kill_at, killed, interrupted_steps", [
    ("boundary", "right after optimizer step 3", 3),
    ("boundary-1", "inside step 3, after micro-batch 1 of 2, before its optimizer step", 2),
    ("boundary+1", "inside step 4, after micro-batch 1 of 2, before its optimizer step", 3),
    ("checkpoint-write", "while checkpoint-4 is written (weights saved, optimizer not)", 4),
])
def test_each_kill_point_resumes_from_checkpoint_2_exactly(tiny_model_dir, reference, tmp_path, kill_at, killed,
                                                           interrupted_steps):
    spec = RunSpec.build(model=str(tiny_model_dir), **SETTINGS, resume_kill_at=kill_at)
    result = drain(run_resume_check(spec, tiny_model_dir, tmp_path, "cpu", reference))
    checks = {ch.name: ch for ch in result.checks}
    assert result.status == "pass", [(c.name, c.evidence) for c in result.checks if c.status != "pass"]
    assert checks["kill_point"].evidence == f"{kill_at}: killed {killed}"
    assert result.checkpoint_step == 2 and result.kill_at == kill_at
    assert result.extra_steps == interrupted_steps + 4  # the killed run's whole steps + resumed steps 3-6
    # the RNG checks mean something here: dropout advances the generators at every step
    assert "6 distinct states over 6 steps" in checks["rng_continues"].evidence
    assert checks["rng_restored"].status == "pass" and "cpu, numpy, python" in checks["rng_restored"].evidence
    assert "bit-identical" in checks["final_weights"].evidence  # CPU fp32: the exact tier
    assert checks["trainable_set"].evidence.startswith("the same 8 trainable tensors")  # q, v x A, B x 2 layers
    assert reference.steps[2]["epoch"] < 1.0  # killed mid-epoch in the first epoch
    out = tmp_path / "resume-interrupted" / "output"
    if kill_at == "checkpoint-write":  # a partial checkpoint-4 exists; transformers would take it, the check does not
        from transformers.trainer_utils import get_last_checkpoint

        assert get_last_checkpoint(str(out)).endswith("checkpoint-4")
        assert sorted(p.name for p in (out / "checkpoint-4").iterdir()) == [
            "README.md", "adapter_config.json", "adapter_model.safetensors", "training_args.bin"]
        assert "skipped checkpoint-4 is partial (missing: optimizer (optimizer.pt)" in checks[
            "checkpoint_selection"].evidence
    else:
        assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert (tmp_path / "resume-interrupted" / "manifest-checkpoint-2.json").is_file()
    assert "optimizer.pt" in result.manifest and "rng_state.pth" in result.manifest
