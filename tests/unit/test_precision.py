"""Precision (pure / amp), the attention implementation, LoRA all-linear, the fit judged by the larger estimate, the
under-estimate, and the fit search: on constructed cases with values written out here."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from core.errors import SpecError
from core.models import load_config, resolve_model
from core.plan.devices import DeviceInfo
from core.plan.fit import fit_of, fit_verdicts, plan_fits, under_estimate
from core.plan.memory import plan_memory
from core.plan.meta import count_parameters
from core.plan.search import largest_fitting
from core.spec import RunSpec
from core.spectables import LoraSettings
from tests.paths import CASES

GiB = 2**30
_CASES = {c["id"].split("-")[0]: c for c in tomllib.loads((CASES / "planner.toml").read_text())["case"]}
P6 = _CASES["P6"]
TINY = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=512)


def _config(tmp_path: Path, fields: dict, name: str = "config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(fields), encoding="utf-8")
    return load_config(resolve_model(str(path)))


def _gpu(capacity: int | None = 80 * GiB, name: str = "cuda:0") -> DeviceInfo:
    return DeviceInfo(name, "cuda", "test GPU", capacity, "test")


# ------------------------------------------------------------------------------------------------ the conventions
def test_the_gradscaler_fp16_training_needs_refuses_fp16_gradients():
    """Why pure fp16 full fine-tuning is refused: run here on the CPU's GradScaler (accelerate makes the CUDA one)."""
    import torch

    layer = torch.nn.Linear(4, 4).half()
    optimizer = torch.optim.AdamW(layer.parameters())
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(layer(torch.randn(2, 4).half()).float().sum()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(optimizer)


@pytest.mark.parametrize("kw,field,says", [
    (dict(mode="full", dtype="fp16", precision="pure"), "precision", "Attempting to unscale FP16 gradients"),
    (dict(mode="inference", precision="amp"), "precision", "inference loads the weights in dtype"),
    (dict(precision="half"), "precision", "choose pure"),
    (dict(attn_implementation="flash"), "attn_implementation", "sdpa, eager, flash_attention_2"),
    (dict(lora_targets="all-linear,q_proj"), "lora.targets", "give it alone"),
])
def test_what_cannot_run_is_a_named_error(kw, field, says):
    with pytest.raises(SpecError) as info:
        RunSpec.build(**kw)
    assert info.value.field == field and says in info.value.message


def test_lora_on_an_fp16_base_and_amp_fp16_full_are_accepted():
    assert RunSpec.build(mode="lora", dtype="fp16").param_dtype == "fp16"
    assert RunSpec.build(mode="full", dtype="fp16", precision="amp").param_dtype == "fp32"


def test_lora_on_an_8b_16_bit_base_counts_16_gb_of_frozen_weights_not_32(tmp_path):
    """The issue's case: LoRA on Llama-3-8B's shape (case P6) in bf16. pure: the base 2 B per parameter, the adapters
    fp32 (peft's autocast_adapter_dtype); amp: every weight 4 B."""
    config = _config(tmp_path, P6["config"])
    lora = LoraSettings()  # r 8 on q_proj, v_proj
    adapters = 32 * 8 * ((4096 + 4096) + (4096 + 1024))  # 32 layers x r x ((in + out) of q, (in + out) of v)
    assert count_parameters(config, "lora", lora).total == P6["expect_parameters"] + adapters
    pure = plan_memory(RunSpec.build(mode="lora", dtype="bf16"), config, [_gpu()]).devices[0].lines
    amp = plan_memory(RunSpec.build(mode="lora", dtype="bf16", precision="amp"), config, [_gpu()]).devices[0].lines
    assert pure["weights"].bytes == 2 * P6["expect_parameters"] + 4 * adapters  # 16.06 GB
    assert amp["weights"].bytes == 4 * (P6["expect_parameters"] + adapters)  # 32.12 GB
    assert pure["gradients"].bytes == amp["gradients"].bytes == 4 * adapters
    assert pure["optimizer_states"].bytes == 2 * 4 * adapters


def test_a_pure_lora_plan_fits_a_24_gib_card_the_amp_plan_does_not(tmp_path):
    config = _config(tmp_path, P6["config"])
    kw = dict(mode="lora", dtype="bf16", batch_size=1, seq_len=1024)
    card = [_gpu(24 * GiB)]
    assert plan_memory(RunSpec.build(**kw), config, card).devices[0].fits is True
    assert plan_memory(RunSpec.build(precision="amp", **kw), config, card).devices[0].fits is False


# ------------------------------------------------------------------------------------------------ all-linear
def test_all_linear_is_every_projection_but_the_head_as_peft_resolves_it(tmp_path):
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from core.methods.lora import lora_config

    config = _config(tmp_path, TINY)
    lora = LoraSettings(r=4, targets=("all-linear",))
    torch.manual_seed(0)
    real = get_peft_model(AutoModelForCausalLM.from_config(config.to_transformers()), lora_config(lora))
    trainable, total = real.get_nb_trainable_parameters()
    assert count_parameters(config, "lora", lora).total == total
    assert count_parameters(config, "lora", lora).trainable == trainable
    from core.child.recipe import model_facts

    facts = model_facts(RunSpec.build(mode="lora", lora_targets="all-linear"), real)
    assert facts["lora_targets"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert facts["lora_modules"] == 14  # 2 layers x 7 (peft resolves all-linear to each module by name)
    # 2 layers x 4 x (in + out) of q (64+64), k (64+32), v (64+32), o (64+64), gate (64+128), up (64+128), down (128+64)
    assert trainable == 2 * 4 * (128 + 96 + 96 + 128 + 192 + 192 + 192)


def test_all_linear_passes_validation_against_the_model():
    from core.specdraft import validate_against_config

    spec = RunSpec.build(mode="lora", lora_targets="all-linear")
    validate_against_config(spec, 512, {"q_proj", "v_proj", "lm_head"})  # no "all-linear not found"
    assert spec.lora.targets == ("all-linear",) and spec.all_linear


# ------------------------------------------------------------------------------------------------ fit and findings
def test_fit_is_judged_by_the_larger_of_the_analytic_and_traced_peaks(tmp_path):
    config = _config(tmp_path, TINY)
    spec = RunSpec.build(mode="full", dtype="bf16", batch_size=2, seq_len=64)
    analytic = plan_memory(spec, config, [_gpu(None)]).devices[0]
    overhead = analytic.lines["overhead"].bytes
    capacity = analytic.total_bytes + 1000
    plan = plan_memory(spec, config, [_gpu(capacity)])
    assert plan_fits(plan, None)
    lower = {"status": "estimated", "peak_bytes": analytic.total_bytes - overhead - 5}
    higher = {"status": "estimated", "peak_bytes": analytic.total_bytes - overhead + 2000}
    (fit,) = fit_verdicts(plan, lower)
    assert (fit.judged_by, fit.bytes, fit.fits) == ("analytic", analytic.total_bytes, True)
    (fit,) = fit_verdicts(plan, higher)
    assert (fit.judged_by, fit.bytes, fit.fits) == ("traced", analytic.total_bytes + 2000, False)
    assert not plan_fits(plan, higher)
    assert "judged by the traced plan, the larger" in fit.untraced_note
    # a sharded strategy's trace would be of one device holding the whole step: not applied
    assert fit_of("cuda:0", capacity, 100, 0, 10**12, "zero3").judged_by == "analytic"


def test_an_under_estimate_is_more_than_the_tolerance_above_the_plan():
    assert under_estimate(1000, 1050) is None  # 5 %: within
    assert under_estimate(1000, 1051) == pytest.approx(0.051)
    assert under_estimate(1000, 800) is None  # over-estimates are errors, not under-estimates


def test_the_probe_names_an_under_estimate_and_compares_tensors_without_the_context(tmp_path):
    from core.stages.probe import DeviceMeasurement, compare_with_plan

    config = _config(tmp_path, TINY)
    device = plan_memory(RunSpec.build(mode="lora", dtype="bf16"), config, [_gpu()]).devices[0]
    tensors = device.total_bytes - device.lines["overhead"].bytes
    m = DeviceMeasurement("cuda:0", 0, 0, 0, peak_bytes=int(tensors * 1.2), peak_method="peak allocated",
                          peak_reserved_bytes=None, peak_rss_bytes=0, rss_after_load_bytes=0, parameters=0,
                          trainable_parameters=0)
    row = compare_with_plan(device, m)
    assert row.planned_bytes == tensors  # peak allocated holds no CUDA context: the overhead line is not compared
    assert row.under_estimate == pytest.approx(0.2, abs=1e-6)
    assert compare_with_plan(device, m, fit_bytes=device.total_bytes * 2).under_estimate is None


# ------------------------------------------------------------------------------------------------ the fit search
def test_largest_micro_batch_is_the_last_that_fits_exactly(tmp_path):
    config = _config(tmp_path, TINY)
    spec = RunSpec.build(mode="full", dtype="bf16", batch_size=4, seq_len=64)
    at = {b: plan_memory(RunSpec.build(mode="full", dtype="bf16", batch_size=b, seq_len=64), config,
                         [_gpu()]).devices[0].total_bytes for b in (12, 13)}
    devices = [_gpu(at[13] - 1, "cuda:0"), _gpu(at[13], "cuda:1"), _gpu(None, "cuda:2"), _gpu(2**20, "cuda:3")]
    rows = largest_fitting(spec, config, devices, "batch_size")
    assert [(r.value, r.plan_bytes) for r in rows[:2]] == [(12, at[12]), (13, at[13])]
    assert rows[0].headroom_bytes == at[13] - 1 - at[12] and rows[1].headroom_bytes == 0
    assert rows[0].limit == "batch_size = 13 does not fit"
    assert rows[2].value is None and "unknown" in rows[2].limit
    assert rows[3].value == 0  # 1 MiB: the CUDA context alone is above it


def test_largest_sequence_stops_at_the_models_limit(tmp_path):
    config = _config(tmp_path, TINY)
    spec = RunSpec.build(mode="lora", batch_size=1, seq_len=64)
    (row,) = largest_fitting(spec, config, [_gpu()], "seq_len", max_positions=512)
    assert row.value == 512 and "max_position_embeddings (512)" in row.limit


def test_plan_exit_codes_and_the_search_on_the_command_line(tmp_path, capsys):
    from tui.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    base = ["plan", "--model", str(path), "--mode", "full", "--dtype", "bf16"]
    assert main(base + ["--devices", "80GiB", "--max-batch"]) == 0
    out = capsys.readouterr().out
    assert "largest micro-batch that fits" in out and "cuda:0:" in out and "<- the peak" in out
    assert main(base + ["--devices", "1MiB"]) == 3
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(base + ["--devices", "7"]) == 4  # a CUDA index this box does not have: capacity unknown
    assert "fit unknown" in capsys.readouterr().out
    assert main(base + ["--devices", "80GiB", "--max-seq", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["largest_fitting"]["seq_len"]
    assert rows[0]["value"] == 512 and rows[0]["headroom_bytes"] > 0


def test_the_fit_search_checks_its_answer_with_traces_when_given_them(tmp_path):
    """A model the analytic plan under-counts (here: a trace made to read 25 % above it, standing for a layer type
    without an op-by-op model): the search's value is checked as the fit is judged, by the larger of the two, and
    bisected down with traces until that fits."""
    config = _config(tmp_path, TINY)
    spec = RunSpec.build(mode="full", dtype="bf16", batch_size=4, seq_len=64)
    gpu = _gpu(None)

    def analytic(b: int) -> int:
        d = plan_memory(RunSpec.build(mode="full", dtype="bf16", batch_size=b, seq_len=64), config, [gpu]).devices[0]
        return d.total_bytes - d.untraced_bytes

    capacity = plan_memory(RunSpec.build(mode="full", dtype="bf16", batch_size=40, seq_len=64), config,
                           [gpu]).devices[0].total_bytes
    device = _gpu(capacity)
    traces = []

    def trace(candidate) -> int:  # 25 % above the analytic tensors
        traces.append(candidate.batch_size)
        return int(analytic(candidate.batch_size) * 1.25)

    (plain,) = largest_fitting(spec, config, [device], "batch_size")
    (checked,) = largest_fitting(spec, config, [device], "batch_size", trace=trace)
    assert plain.value == 40 and checked.value < 40
    untraced = plan_memory(spec, config, [device]).devices[0].untraced_bytes
    assert int(analytic(checked.value) * 1.25) + untraced <= capacity < int(analytic(checked.value + 1) * 1.25) + untraced
    assert checked.plan_bytes == int(analytic(checked.value) * 1.25) + untraced
    assert "does not fit by the traced plan" in checked.limit and len(traces) <= 8
