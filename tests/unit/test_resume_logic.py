"""The resume comparison on constructed records: each kind of divergence is caught and named."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from core.protocol.manifest import verify_manifest, write_manifest
from core.spec import RunSpec
from core.stages.checkpoint import complete_check, list_checkpoints, safe_loading
from core.stages.noise import (
    NOISE_MULTIPLE,
    Family,
    dequantize_bnb,
    judge_tensors,
    optimizer_state_tensors,
    required_tier,
)
from core.stages.resumechecks import compare_steps, required_files
from core.stages.states import compare_optimizers, compare_scalers, compare_weights
from tests.paths import REPO

EXACT = required_tier("cpu", "fp32")
TWIN = required_tier("cuda:0", "bf16")


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


def test_the_cpu_is_bit_exact_and_cuda_is_bounded_by_a_twins_noise():
    assert EXACT.exact and EXACT.multiple == 0 and "no twin run" in EXACT.why
    assert TWIN.method == "twin" and TWIN.multiple == NOISE_MULTIPLE and TWIN.name == "cuda-bf16-twin-noise"
    assert required_tier("cpu", "fp32", jittered=True).method == "twin"  # the test jitter: the CPU's noise too
    assert required_tier("cpu", "fp32", noise="twin").method == "twin"
    assert required_tier("cuda:0", "fp32", noise="off").exact
    assert required_tier("cuda:0", "bf16", "exact").name == "cuda-bf16-exact-required"


def test_a_twin_that_logged_no_loss_where_one_is_compared_measures_no_bound():
    """The rule itself is tested once, over both modes' series (test_resume_compare.py); here the recipe's own steps:
    twins that logged nothing fail ``loss`` saying so, never pass on a bound of 0."""
    ref = {r["step"]: r for r in steps(8)}
    family = Family.of(2, with_reference=False)
    lost = by_name(compare_steps(ref, steps(5), steps(8, start=5), c=4, steps=8, tier=TWIN, twins=[[], []],
                                 family=family))["loss"]
    assert lost.status == "fail" and "twin run logged no loss at steps 1-8" in lost.evidence


def test_the_interrupted_run_before_its_kill_must_be_this_run():
    """A checkpoint written by another run (other samples before the kill) fails ``reproducible``, naming it."""
    ref = {r["step"]: r for r in steps(8)}
    other = steps(5, sample_ids=(3, [9, 9]))
    check = by_name(compare_steps(ref, other, steps(8, start=5), c=4, steps=8, tier=EXACT))["reproducible"]
    assert check.status == "fail" and "not this run's" in check.evidence and "3" in check.evidence


def test_a_tensor_near_zero_is_judged_by_its_distance_not_a_relative_error():
    """GPU case: lora_B starts at zero, so a relative tolerance fails it on noise alone (2.2e-4 on an H200). Per tensor
    and norm-wise: within 4 x the twin's distance passes; a fault hundreds of times the noise fails."""
    g = torch.Generator().manual_seed(0)
    ref = {"lora_A": torch.randn(8, 64, generator=g), "lora_B": torch.randn(64, 8, generator=g) * 1e-2}
    noise = {k: torch.randn(v.shape, generator=g) * 1e-5 for k, v in ref.items()}
    twin = {k: v + noise[k] for k, v in ref.items()}
    resumed = {k: v - noise[k] * 1.5 for k, v in ref.items()}  # another realisation, 1.5 x as far
    kin = Family.of(1, with_reference=True)  # the pair (reference, twin)
    judged = judge_tensors(ref, resumed, [ref, twin], TWIN, kin)
    assert judged.ok and 1.4 < judged.distance / judged.noise < 1.6
    elementwise = ((resumed["lora_B"] - ref["lora_B"]).abs() / ref["lora_B"].abs()).max()
    assert elementwise > 2e-2  # what the relative tier of bf16 (rtol 2e-2) failed
    restarted = {**resumed, "lora_B": torch.zeros(64, 8)}  # adapters not restored: lora_B back at its initial zeros
    bad = judge_tensors(ref, restarted, [ref, twin], TWIN, kin)
    assert not bad.ok and bad.where == "lora_B" and bad.distance > 10 * bad.bound
    assert not judge_tensors(ref, resumed, None, EXACT).ok and judge_tensors(ref, ref, None, EXACT).ok


def test_final_weights_compare_bitwise_on_the_exact_tier(tmp_path):
    a = {"w": torch.ones(3, 3)}
    b = {"w": torch.ones(3, 3)}
    b["w"][1, 1] += 1e-7
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    check = compare_weights(tmp_path / "a.safetensors", tmp_path / "b.safetensors", EXACT)
    assert check.status == "fail" and check.largest_difference > 0
    t = {"w": torch.ones(3, 3)}
    t["w"][0, 0] -= 1e-7
    save_file(t, tmp_path / "t.safetensors")
    within = compare_weights(tmp_path / "a.safetensors", tmp_path / "b.safetensors", TWIN,
                             [tmp_path / "a.safetensors", tmp_path / "t.safetensors"], Family.of(1, True))
    assert within.status == "pass" and within.noise > 0 and within.bound == NOISE_MULTIPLE * within.noise
    assert compare_weights(tmp_path / "a.safetensors", tmp_path / "missing.safetensors", EXACT).status == "fail"


def test_optimizer_step_counts_must_match(tmp_path):
    def opt(step: float):
        return {"state": {0: {"step": torch.tensor(step), "exp_avg": torch.zeros(4)}},
                "param_groups": [{"params": [0], "lr": 1e-3}]}

    torch.save(opt(8.0), tmp_path / "ref.pt")
    torch.save(opt(4.0), tmp_path / "res.pt")  # optimizer restarted: only the resumed steps counted
    checks = by_name(compare_optimizers(tmp_path / "ref.pt", tmp_path / "res.pt", EXACT))
    assert checks["optimizer_progress"].status == "fail" and "[4.0] vs [8.0]" in checks["optimizer_progress"].evidence


def test_nested_8_bit_optimizer_states_are_compared_dequantised_and_an_empty_state_is_no_evidence(tmp_path):
    """bitsandbytes' 8-bit AdamW nests each tensor's states (found by a helper: 0 tensors were compared, and the check
    passed); its uint8 codes are compared as the values they stand for (code book x block scale), never as numbers
    (on an H200 a code differing by 76 was reported as a difference of 76); a state with no tensor fails, not passes."""
    def opt(moment: torch.Tensor, nested: bool = True):
        inner = {"state1": moment, "absmax1": torch.ones(2), "qmap1": torch.linspace(-1, 1, 256)}
        state = {"step": torch.tensor(4.0), "__bnb_optimizer_quant_state__": inner} if nested else {"step": 4.0}
        return {"state": {0: state}, "param_groups": [{"params": [0], "lr": 1e-3}]}

    moment = torch.arange(512, dtype=torch.uint8).reshape(2, 256)
    changed = moment.clone()
    changed[1, 7] += 76
    torch.save(opt(moment), tmp_path / "ref.pt")
    for name, state, status in (("same", opt(moment.clone()), "pass"), ("changed", opt(changed), "fail"),
                                ("empty", opt(moment, nested=False), "fail")):
        torch.save(state, tmp_path / f"{name}.pt")
        ref = tmp_path / ("ref.pt" if name != "empty" else f"{name}.pt")
        check = by_name(compare_optimizers(ref, tmp_path / f"{name}.pt", EXACT))["optimizer_moments"]
        assert check.status == status, (name, check.evidence)
    assert check.evidence.startswith("no state tensor found")
    changed_check = by_name(compare_optimizers(tmp_path / "ref.pt", tmp_path / "changed.pt", EXACT))
    assert abs(changed_check["optimizer_moments"].largest_difference - 76 * 2 / 255) < 1e-5  # values, not codes
    same = by_name(compare_optimizers(tmp_path / "ref.pt", tmp_path / "same.pt", EXACT))["optimizer_moments"]
    assert same.evidence == "1 optimizer state tensors (8-bit states dequantised): bit-identical"


def test_dequantised_8_bit_states_equal_bitsandbytes_own_dequantisation():
    """The 8-bit optimizer's blockwise layout read as bitsandbytes reads it (its ``dequantize_blockwise``, 256 values a
    block, the signed dynamic code book): the same values to the last bit."""
    import bitsandbytes.functional as F

    g = torch.Generator().manual_seed(1)
    values = torch.randn(3, 300, generator=g)
    code = F.create_dynamic_map(signed=True)
    codes, state = F.quantize_blockwise(values, code=code, blocksize=256)
    ours = dequantize_bnb(codes, code, state.absmax)
    theirs = F.dequantize_blockwise(codes, state)
    assert ours.shape == values.shape and torch.equal(ours, theirs)
    assert (ours - values).abs().max() < 0.05 * values.abs().max()
    read = optimizer_state_tensors({0: {"step": 3, "__bnb_optimizer_quant_state__": {
        "state1": codes, "qmap1": code, "absmax1": state.absmax}}})
    assert list(read) == ["0.state1"] and torch.equal(read["0.state1"], theirs)


def test_required_files_by_mode_and_dtype():
    assert "adapter weights" in required_files(RunSpec.build(mode="lora"))
    assert required_files(RunSpec.build(mode="full"))["model weights"] == "model.safetensors"
    assert "GradScaler" not in required_files(RunSpec.build(mode="full"))
    assert required_files(RunSpec.build(mode="full", dtype="fp16", precision="amp"))["GradScaler"] == "scaler.pt"


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
        assert complete_check(ckpt, required_files(spec)).status == "pass"
        (ckpt / name).unlink()
        check = complete_check(ckpt, required_files(spec))
        assert check.status == "fail" and check.evidence == f"missing: {component} ({name})"


def test_r8_a_pickle_that_needs_weights_only_false_is_refused_and_named(tmp_path):
    spec = RunSpec.build(None, mode="lora")
    ckpt = lora_checkpoint(tmp_path / "ok", spec)
    good = safe_loading(ckpt, trainer=True)
    assert good.status == "pass", good.evidence  # Trainer's own files, RNG state with numpy included, load safely
    torch.save({"state": {}, "param_groups": [], "extra": NotATensor()}, ckpt / "optimizer.pt")
    bad = safe_loading(ckpt, trainer=True)
    assert bad.status == "fail" and bad.evidence.startswith("optimizer.pt: refused, it cannot be loaded with "
                                                            "weights_only=True")
    (ckpt / "scheduler.pt").write_bytes(b"not a torch file")
    assert "scheduler.pt: refused" in safe_loading(ckpt, trainer=True).evidence


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
    assert "GradScaler" in required_files(RunSpec.build(None, mode="full", dtype="fp16", precision="amp"))


def test_safe_load_is_the_only_torch_load_and_children_force_weights_only(tmp_path):
    """docs/architecture.md §4: checkpoints are read with weights_only=True only. In core/ the single torch.load call is
    safe_load's (explicit weights_only=True); every child process also gets TORCH_FORCE_WEIGHTS_ONLY_LOAD=1, so the
    loads inside Trainer and peft cannot read arbitrary pickles either."""
    import re
    from pathlib import Path

    from core.interpreter import child_env

    core = REPO / "core"
    files = sorted(core.rglob("*.py"))  # every package by stage
    assert core / "stages" / "states.py" in files and core / "child" / "worker.py" in files
    calls = {str(f.relative_to(core)): re.findall(r"torch\.load\(([^)]*)\)", f.read_text()) for f in files}
    calls = {name: found for name, found in calls.items() if found}
    assert list(calls) == ["stages/states.py"]
    assert [c for c in calls["stages/states.py"] if "weights_only=True" in c] == calls["stages/states.py"]
    assert "weights_only=False" not in "".join(f.read_text() for f in files)
    # the children's environment refuses a pickle even where a library passes weights_only=False
    import subprocess
    import sys

    evil = Path(tmp_path) / "evil.pt"
    torch.save({"x": NotATensor()}, evil)
    code = (f"import torch\ntry:\n    torch.load({str(evil)!r}, weights_only=False)\n    print('loaded')\n"
            "except Exception as e:\n    print('refused')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=child_env({"PATH": "/usr/bin:/bin", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}),
                         cwd=REPO)
    assert out.stdout.strip() == "refused", out.stdout + out.stderr


# ------------------------------------------------------------------ kill points, checkpoint selection, RNG state
def test_select_checkpoint_skips_a_partial_newer_one_and_names_it(tmp_path):
    """A kill during a checkpoint write leaves checkpoint-40 with weights only; the resume must take checkpoint-20,
    not the highest step transformers' get_last_checkpoint would take."""
    from transformers.trainer_utils import get_last_checkpoint

    from core.stages.checkpoint import select_checkpoint, selection_check

    spec = RunSpec.build(None, mode="lora")
    lora_checkpoint(tmp_path / "checkpoint-20", spec)
    partial = tmp_path / "checkpoint-40"
    partial.mkdir()
    save_file({"w": torch.zeros(2)}, str(partial / "adapter_model.safetensors"))
    assert get_last_checkpoint(str(tmp_path)).endswith("checkpoint-40")
    selection = select_checkpoint(list_checkpoints(tmp_path)[0], required_files(spec))
    assert selection.checkpoint is not None and selection.checkpoint.path == tmp_path / "checkpoint-20"
    check = selection_check(selection, 20)
    assert check.status == "pass"
    assert "checkpoint-40 is partial (missing: optimizer (optimizer.pt)" in check.evidence
    assert selection_check(selection, 40).status == "fail"  # the spec's checkpoint was not the newest complete one


def test_select_checkpoint_fails_naming_every_partial_one_when_none_is_complete(tmp_path):
    from core.stages.checkpoint import select_checkpoint, selection_check

    spec = RunSpec.build(None, mode="lora")
    ckpt = lora_checkpoint(tmp_path / "checkpoint-20", spec)
    (ckpt / "trainer_state.json").unlink()
    other = lora_checkpoint(tmp_path / "checkpoint-10", spec)
    (other / "trainer_state.json").write_text(json.dumps({"global_step": 9}))  # a directory renamed by hand
    selection = select_checkpoint(list_checkpoints(tmp_path)[0], required_files(spec))
    assert selection.checkpoint is None
    check = selection_check(selection, 20)
    assert check.status == "fail" and check.evidence.startswith("no complete checkpoint to resume from")
    assert "checkpoint-20 is partial (missing: trainer state (trainer_state.json))" in check.evidence
    assert "checkpoint-10: trainer_state.json says global step 9" in check.evidence


def test_rng_digest_follows_every_generator():
    import random

    import numpy as np

    from core.protocol.rng import live_rng_state, rng_digest

    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    first = rng_digest(live_rng_state())
    assert set(first) == {"python", "numpy", "cpu"} and first == rng_digest(live_rng_state())
    for draw, key in ((lambda: torch.rand(1), "cpu"), (lambda: random.random(), "python"),
                      (lambda: np.random.rand(), "numpy")):
        before = rng_digest(live_rng_state())
        draw()
        after = rng_digest(live_rng_state())
        assert [k for k in after if after[k] != before[k]] == [key]


def test_rng_digest_of_a_saved_state_equals_the_live_one(tmp_path):
    """The parent digests rng_state.pth (loaded weights_only) and the child its live generators: same layout."""
    from core.protocol.rng import live_rng_state, rng_digest
    from core.stages.states import safe_load

    torch.save(live_rng_state(), tmp_path / "rng_state.pth")
    assert rng_digest(safe_load(tmp_path / "rng_state.pth")) == rng_digest(live_rng_state())


def rng_steps(states: dict[int, dict]) -> list[dict]:
    return [{"step": s, "rng": d} for s, d in sorted(states.items())]


def test_rng_not_restored_or_not_continuing_fails():
    from core.stages.resumechecks import compare_rng

    a, b, c = ({"cpu": x, "numpy": "n", "python": "p"} for x in ("a", "b", "c"))
    ref = {r["step"]: r for r in rng_steps({1: a, 2: b, 3: c})}
    good = compare_rng(b, b, rng_steps({2: b, 3: c}), ref, c=1)
    assert [ch.status for ch in good] == ["pass", "pass"] and "3 distinct states" in good[1].evidence
    not_restored = by_name(compare_rng(None, b, rng_steps({2: a, 3: b}), ref, c=1))
    assert not_restored["rng_restored"].status == "fail"
    # a fresh process: the seed's state where the uninterrupted run had advanced
    fresh = by_name(compare_rng(b, b, rng_steps({2: a, 3: b}), ref, c=1))
    assert fresh["rng_continues"].status == "fail" and fresh["rng_continues"].evidence.startswith("generators cpu")
    other = by_name(compare_rng({**b, "numpy": "x"}, b, rng_steps({2: b, 3: c}), ref, c=1))
    assert other["rng_restored"].status == "fail" and "numpy" in other["rng_restored"].evidence


def test_rng_check_says_when_nothing_drew_random_numbers():
    from core.stages.resumechecks import compare_rng

    a = {"cpu": "a", "numpy": "n", "python": "p"}
    ref = {r["step"]: r for r in rng_steps({1: a, 2: a, 3: a})}
    check = by_name(compare_rng(a, a, rng_steps({2: a, 3: a}), ref, c=1))["rng_continues"]
    # issue 51: it was ticked pass (✓) while its evidence said it proves nothing here; not_applicable, and passing
    from core.status import PASSING

    assert check.status == "not_applicable" and check.status in PASSING
    assert "cannot tell a restored state from a fresh one" in check.evidence
    from core.stages.compare import verdict  # and the stage passes with it (both modes' one rule)

    assert verdict([check])[0] == "pass" and verdict([])[0] == "fail"


def test_kill_point_check_compares_where_the_run_died_with_the_spec():
    from dataclasses import replace

    from core.protocol.events import KillPoint
    from core.stages.resumechecks import kill_point_check

    spec = RunSpec.build(None, mode="lora", steps=30, grad_accum=4, resume_checkpoint_every=10,
                         resume_kill_after_checkpoint=2, resume_kill_at="boundary+1")
    assert spec.resume.kill_step() == 25
    inside = KillPoint(step=25, where="micro", micro_done=1, micro_in_step=4)
    assert kill_point_check(spec, inside).status == "pass"
    assert "inside step 26, after micro-batch 1 of 4" in kill_point_check(spec, inside).evidence
    assert kill_point_check(spec, replace(inside, micro_done=2)).status == "fail"
    assert kill_point_check(spec, KillPoint(step=25, where="step_end")).status == "fail"
    minus = RunSpec.build(None, mode="lora", steps=30, grad_accum=4, resume_kill_at="boundary-1")
    assert kill_point_check(minus, KillPoint(step=24, where="micro", micro_done=3, micro_in_step=4)).status == "pass"
    write = RunSpec.build(None, mode="lora", steps=30, resume_kill_at="checkpoint-write")
    assert write.resume.kill_step() == 30 and write.resume.kill_checkpoint_step() == 20
    assert kill_point_check(write, KillPoint(step=30, where="save")).status == "pass"


def test_kill_points_are_validated_against_the_run_length():
    import pytest

    from core.errors import SpecError

    with pytest.raises(SpecError, match="not a kill point; choose one of boundary, boundary-1"):
        RunSpec.build(None, mode="lora", resume_kill_at="halfway")
    # checkpoint-write (c = 20, every 10) needs step 30 to run; boundary+1 needs step k+1 = 26
    assert RunSpec.build(None, mode="lora", steps=30, resume_kill_at="checkpoint-write").resume.kill_step() == 30
    with pytest.raises(SpecError, match="would come at step 30"):
        RunSpec.build(None, mode="lora", steps=29, resume_kill_at="checkpoint-write")
    assert RunSpec.build(None, mode="lora", steps=26, resume_kill_at="boundary+1").resume.last_step_needed() == 26
    with pytest.raises(SpecError, match="would come at step 25"):
        RunSpec.build(None, mode="lora", steps=25, resume_kill_at="boundary")


def _complete_checkpoints_at_the_kill(kill_at: str, k: int, every: int) -> set[int]:
    """Trainer's order, written out independently of core.spec: a step runs its micro-batches, its optimizer step,
    on_step_end (where ``boundary`` holds), then saves its checkpoint when the step is a multiple of ``every`` (where
    ``checkpoint-write`` holds, the save unfinished). ``boundary-1`` holds inside step k, ``boundary+1`` inside step
    k + 1. Returns the checkpoints complete when the kill lands."""
    done_steps = {"boundary": k - 1, "boundary-1": k - 1, "boundary+1": k, "checkpoint-write": k - 1}[kill_at]
    return {s for s in range(1, done_steps + 1) if s % every == 0}


def test_every_kill_point_lands_between_checkpoint_c_and_the_next_for_every_interval():
    """Issue 16: with a checkpoint every step, boundary+1 (the default) used to land after the next checkpoint was
    written, so the resume took checkpoint c + 1 and the check failed every time. Valid by construction now."""
    for every in range(1, 7):
        for after in range(1, 4):
            for at in ("boundary", "boundary-1", "boundary+1", "checkpoint-write"):
                for accum in (1, 2, 3):
                    c = every * after
                    spec = RunSpec.build(None, mode="lora", steps=c + 2 * every + 1, grad_accum=accum,
                                         resume_checkpoint_every=every, resume_kill_after_checkpoint=after,
                                         resume_kill_at=at)
                    complete = _complete_checkpoints_at_the_kill(at, spec.resume.kill_step(), every)
                    assert max(complete) == c, (every, after, at, accum, spec.resume.kill_step(), complete)
    every_step = RunSpec.build(None, mode="lora", steps=6, resume_checkpoint_every=1, resume_kill_after_checkpoint=2)
    assert every_step.resume.kill_step() == 2 and "inside step 3, after micro-batch 1" in \
        every_step.resume.describe()


def test_trainable_set_must_be_the_references():
    from core.stages.compare import TrainableSet, trainable_check

    ref = TrainableSet.of_names(["a.lora_B", "a.lora_A"], 64)
    assert trainable_check(ref, TrainableSet.of_names(["a.lora_A", "a.lora_B"], 64)).status == "pass"
    other = trainable_check(ref, TrainableSet.of_names(["a.lora_A", "a.lora_B", "lm_head.weight"], 96))
    assert other.status == "fail" and "lm_head.weight" in other.evidence
    assert trainable_check(ref, None).status == "fail"
    # the Trainer hook's report (its names' digest only) is the same set by the same digest (both subjects: one rule)
    hooked = {"trainable_tensors": 2, "trainable_parameters": 64, "trainable_names_sha256": ref.names_sha256}
    assert trainable_check(TrainableSet.of_trainer(hooked), ref).status == "pass"
    moved = trainable_check(TrainableSet.of_trainer({**hooked, "trainable_names_sha256": "0" * 64}), ref)
    assert moved.status == "fail" and moved.evidence.endswith("their names differ (sha256)")


def test_kill_position_reads_right_without_accumulation():
    from core.protocol.events import KillPoint
    from core.stages.resumechecks import kill_position

    assert kill_position(KillPoint(step=3, where="micro", micro_done=1, micro_in_step=1)) == (
        "inside step 4, after micro-batch 1 of 1, before its optimizer step")
    assert kill_position(KillPoint(step=2, where="step_begin", micro_done=0, micro_in_step=1)) == (
        "inside step 3, before its first micro-batch")
    assert kill_position(KillPoint(step=3, where="micro", micro_done=1, micro_in_step=4)) == (
        "inside step 4, after micro-batch 1 of 4, before its optimizer step")


def test_a_check_that_cannot_apply_is_counted_apart_and_diff_does_not_call_it_failed():
    """Issue 51 (the re-walk): the summary said "21 checks passed" with one not_applicable, and `diff` listed it under
    "checks failed"."""
    from core.record.diff import compare
    from core.stages.compare import Check
    from core.stages.resume import checks_passed_words
    from tests.records import committed

    checks = [Check("a", "pass", "ok"), Check("b", "not_applicable", "cannot tell here")]
    assert checks_passed_words(checks) == "1 checks passed, 1 not applicable here"
    assert checks_passed_words(checks[:1]) == "1 checks passed"
    import tomli_w

    rec = committed("lora")
    for check in rec["resume"]["checks"]:
        if check["name"] == "rng_continues":
            check["status"] = "not_applicable"
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        a, b = Path(folder) / "a.toml", Path(folder) / "b.toml"
        a.write_text(tomli_w.dumps(rec))
        b.write_text(tomli_w.dumps(committed("lora")))
        row = next(r for r in compare([a, b]).rows if r.name == "checks failed")
    assert row.values == ["none", "none"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_twins_nudge_moves_every_trainable_element_by_one_ulp_once(dtype):
    """The nudged twin (core/child/inject/jitter.py): before the first optimizer step every element of every parameter
    the optimizer holds moves to its next representable value, up or down, in its own dtype (bf16: 2^-8 relative);
    later steps are untouched; a zero moves to the smallest subnormal, not further."""
    from core.child.inject.jitter import nudge_into

    hooks = []
    w = torch.nn.Parameter(torch.tensor([1.0, -3.0, 0.0, 1e-3] * 64, dtype=dtype))
    before = w.detach().clone()
    opt = torch.optim.SGD([w], lr=0.0)
    nudge_into(hooks.append)
    hooks[0](opt, (), {})
    up, down = torch.nextafter(before, torch.tensor(torch.inf, dtype=dtype)), \
        torch.nextafter(before, torch.tensor(-torch.inf, dtype=dtype))
    moved = w.detach()
    assert bool(((moved == up) | (moved == down)).all()) and bool((moved != before).all())
    assert 0 < int((moved == up).sum()) < moved.numel()  # both directions drawn
    hooks[0](opt, (), {})  # the second step: no nudge
    assert torch.equal(w.detach(), moved)
