"""The resume comparison on constructed records: each kind of divergence is caught and named."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from core.resume import (
    compare_optimizers,
    compare_scalers,
    compare_steps,
    compare_weights,
    completeness,
    required_files,
    safe_loading,
    tolerance_tier,
    verify_manifest,
    write_manifest,
)
from core.spec import RunSpec

EXACT = tolerance_tier("cpu", "fp32")


def steps(n: int, start: int = 1, **change) -> list[dict]:
    out = []
    for s in range(start, n + 1):
        row = {"step": s, "epoch": s / 10, "learning_rate": 1e-3 * (1 - s / 20), "loss": 3.0 - s * 0.01,
               "sample_ids": [2 * s, 2 * s + 1]}
        for key, (at, value) in change.items():
            if s == at:
                row[key] = value
        out.append(row)
    return out


def by_name(checks):
    return {c.name: c for c in checks}


def test_identical_runs_pass_every_check():
    ref = {r["step"]: r for r in steps(8)}
    checks = by_name(compare_steps(ref, steps(5), steps(8, start=5), c=4, steps=8, tier=EXACT))
    assert all(c.status == "pass" for c in checks.values()), checks
    assert checks["loss"].largest_difference == 0.0


def test_restarted_learning_rate_is_caught_at_its_step():
    ref = {r["step"]: r for r in steps(8)}
    resumed = steps(8, start=5, learning_rate=(6, 1e-3))  # schedule restarted: lr back at its peak
    checks = by_name(compare_steps(ref, steps(5), resumed, c=4, steps=8, tier=EXACT))
    assert checks["learning_rate"].status == "fail" and "6" in checks["learning_rate"].evidence


def test_wrong_data_after_resume_is_caught():
    ref = {r["step"]: r for r in steps(8)}
    resumed = steps(8, start=5, sample_ids=(5, [0, 1]))  # replayed the epoch from the start
    checks = by_name(compare_steps(ref, steps(5), resumed, c=4, steps=8, tier=EXACT))
    assert checks["sample_ids"].status == "fail"


def test_missing_or_repeated_steps_are_caught():
    ref = {r["step"]: r for r in steps(8)}
    checks = by_name(compare_steps(ref, steps(5), steps(8, start=4), c=4, steps=8, tier=EXACT))
    assert checks["global_steps"].status == "fail" and "4-8" in checks["global_steps"].evidence


def test_loss_tiers_exact_on_cpu_fp32_relative_for_16_bit():
    ref = {r["step"]: r for r in steps(8)}
    resumed = steps(8, start=5, loss=(7, 3.0 - 0.07 + 1e-6))
    exact = by_name(compare_steps(ref, steps(5), resumed, c=4, steps=8, tier=EXACT))["loss"]
    bf16 = by_name(compare_steps(ref, steps(5), resumed, c=4, steps=8, tier=tolerance_tier("cuda:0", "bf16")))["loss"]
    assert exact.status == "fail" and bf16.status == "pass"
    assert abs(exact.largest_difference - 1e-6) < 1e-9 and exact.tier == "cpu-fp32-exact"


def test_final_weights_compare_bitwise_on_the_exact_tier(tmp_path):
    a = {"w": torch.ones(3, 3)}
    b = {"w": torch.ones(3, 3)}
    b["w"][1, 1] += 1e-7
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    check = compare_weights(tmp_path / "a.safetensors", tmp_path / "b.safetensors", EXACT)
    assert check.status == "fail" and check.largest_difference > 0
    assert compare_weights(tmp_path / "a.safetensors", tmp_path / "b.safetensors",
                           tolerance_tier("cuda:0", "fp32")).status == "pass"
    assert compare_weights(tmp_path / "a.safetensors", tmp_path / "missing.safetensors", EXACT).status == "fail"


def test_optimizer_step_counts_must_match(tmp_path):
    def opt(step: float):
        return {"state": {0: {"step": torch.tensor(step), "exp_avg": torch.zeros(4)}},
                "param_groups": [{"params": [0], "lr": 1e-3}]}

    torch.save(opt(8.0), tmp_path / "ref.pt")
    torch.save(opt(4.0), tmp_path / "res.pt")  # optimizer restarted: only the resumed steps counted
    checks = by_name(compare_optimizers(tmp_path / "ref.pt", tmp_path / "res.pt", EXACT))
    assert checks["optimizer_progress"].status == "fail" and "[4.0] vs [8.0]" in checks["optimizer_progress"].evidence


def test_required_files_by_mode_and_dtype():
    assert "adapter weights" in required_files(RunSpec.build(mode="lora"))
    assert required_files(RunSpec.build(mode="full"))["model weights"] == "model.safetensors"
    assert "GradScaler" not in required_files(RunSpec.build(mode="full"))
    assert required_files(RunSpec.build(mode="full", dtype="fp16"))["GradScaler"] == "scaler.pt"


def test_manifest_detects_a_changed_added_or_removed_file(tmp_path):
    ckpt = tmp_path / "checkpoint-4"
    ckpt.mkdir()
    (ckpt / "optimizer.pt").write_bytes(b"state")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    manifest = write_manifest(ckpt, tmp_path / "manifest.json")
    assert verify_manifest(ckpt, manifest) == []
    (ckpt / "optimizer.pt").write_bytes(b"other")
    (ckpt / "extra.bin").write_bytes(b"x")
    assert verify_manifest(ckpt, manifest) == ["extra.bin", "optimizer.pt"]
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest


class NotATensor:
    """An object a checkpoint pickle must never be allowed to rebuild (weights_only=True refuses it)."""

    def __reduce__(self):
        return (print, ("this would run on load",))


def lora_checkpoint(path, spec):
    """A checkpoint laid out as Trainer writes it for LoRA, with real pickles (RNG state with numpy, as Trainer's)."""
    import random

    import numpy as np

    path.mkdir()
    save_file({"w": torch.zeros(2)}, str(path / "adapter_model.safetensors"))
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), path / "optimizer.pt")
    torch.save(torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0).state_dict(), path / "scheduler.pt")
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()},
               path / "rng_state.pth")
    (path / "trainer_state.json").write_text(json.dumps({"global_step": 20}))
    return path


def test_r6_a_missing_component_fails_and_is_named(tmp_path):
    spec = RunSpec.build(None, mode="lora")
    for name, component in (("scheduler.pt", "scheduler"), ("rng_state.pth", "RNG state"),
                            ("optimizer.pt", "optimizer")):
        ckpt = lora_checkpoint(tmp_path / name, spec)
        assert completeness(spec, ckpt).status == "pass"
        (ckpt / name).unlink()
        check = completeness(spec, ckpt)
        assert check.status == "fail" and check.evidence == f"missing: {component} ({name})"


def test_r8_a_pickle_that_needs_weights_only_false_is_refused_and_named(tmp_path):
    spec = RunSpec.build(None, mode="lora")
    ckpt = lora_checkpoint(tmp_path / "ok", spec)
    good = safe_loading(spec, ckpt)
    assert good.status == "pass", good.evidence  # Trainer's own files, RNG state with numpy included, load safely
    torch.save({"state": {}, "param_groups": [], "extra": NotATensor()}, ckpt / "optimizer.pt")
    bad = safe_loading(spec, ckpt)
    assert bad.status == "fail" and bad.evidence.startswith("optimizer.pt: refused, it cannot be loaded with "
                                                            "weights_only=True")
    (ckpt / "scheduler.pt").write_bytes(b"not a torch file")
    assert "scheduler.pt: refused" in safe_loading(spec, ckpt).evidence


def test_r8_the_optimizer_comparison_refuses_an_unsafe_file_instead_of_loading_it(tmp_path):
    good = lora_checkpoint(tmp_path / "good", RunSpec.build(None, mode="lora"))
    torch.save({"x": NotATensor()}, tmp_path / "evil.pt")
    (check,) = compare_optimizers(good / "optimizer.pt", tmp_path / "evil.pt", EXACT)
    assert check.status == "fail" and check.evidence.startswith("evil.pt: refused")


def test_r7_a_restarted_loss_scale_is_caught_and_an_equal_one_passes(tmp_path):
    """Case R7 at the logic level (fp16 needs a GPU: the CUDA path is unverified here). GradScaler.state_dict() as
    Trainer saves it: the reference went on growing/backing off its scale; a resume that restarted at 2^16 fails."""
    ref = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "growth_tracker": 37}
    (tmp_path / "ref").mkdir()
    (tmp_path / "res").mkdir()
    torch.save(ref, tmp_path / "ref" / "scaler.pt")
    torch.save(dict(ref), tmp_path / "res" / "scaler.pt")
    same = compare_scalers(tmp_path / "ref" / "scaler.pt", tmp_path / "res" / "scaler.pt")
    assert same.status == "pass" and "resumed scale 1024" in same.evidence
    torch.save(dict(ref, scale=65536.0, growth_tracker=0), tmp_path / "res" / "scaler.pt")
    restarted = compare_scalers(tmp_path / "ref" / "scaler.pt", tmp_path / "res" / "scaler.pt")
    assert restarted.status == "fail" and "resumed scale 65536" in restarted.evidence
    (tmp_path / "res" / "scaler.pt").unlink()
    missing = compare_scalers(tmp_path / "ref" / "scaler.pt", tmp_path / "res" / "scaler.pt")
    assert missing.status == "fail" and "scaler.pt missing" in missing.evidence
    assert "GradScaler" in required_files(RunSpec.build(None, mode="full", dtype="fp16"))


def test_safe_load_is_the_only_torch_load_and_children_force_weights_only(tmp_path):
    """DESIGN §4: checkpoints are read with weights_only=True only. In core/ the single torch.load call is
    safe_load's (explicit weights_only=True); every child process also gets TORCH_FORCE_WEIGHTS_ONLY_LOAD=1, so the
    loads inside Trainer and peft cannot read arbitrary pickles either."""
    import re
    from pathlib import Path

    from core.childproc import child_env

    core = Path(__file__).resolve().parent.parent / "core"
    calls = {f.name: re.findall(r"torch\.load\(([^)]*)\)", f.read_text()) for f in core.glob("*.py")}
    calls = {name: found for name, found in calls.items() if found}
    assert list(calls) == ["resume.py"]
    assert [c for c in calls["resume.py"] if "weights_only=True" in c] == calls["resume.py"]
    assert "weights_only=False" not in "".join(f.read_text() for f in core.glob("*.py"))
    # the children's environment refuses a pickle even where a library passes weights_only=False
    import subprocess
    import sys

    evil = Path(tmp_path) / "evil.pt"
    torch.save({"x": NotATensor()}, evil)
    code = (f"import torch\ntry:\n    torch.load({str(evil)!r}, weights_only=False)\n    print('loaded')\n"
            "except Exception as e:\n    print('refused')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=child_env({"PATH": "/usr/bin:/bin", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}),
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.stdout.strip() == "refused", out.stdout + out.stderr
