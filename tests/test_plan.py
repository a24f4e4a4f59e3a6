"""The analytic memory plan (core/plan.py) against the planner cases in tests/cases/planner.toml and against
what torch/peft actually allocate on tiny CPU models."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from core.models import load_config, resolve_model
from core.plan import (
    COMPONENTS,
    CUDA_OVERHEAD_BYTES,
    DeviceInfo,
    ParameterCount,
    count_parameters,
    detect_devices,
    linear_module_names,
    plan_memory,
)
from core.spec import LoraSettings, RunSpec

GiB = 2**30
DEVICE_80G = DeviceInfo("cuda:0", "cuda", "test GPU", 80 * GiB, "test")

# Configs exactly as given in the planner cases (tests/cases/planner.toml, a copy of the shared cases).
_CASES = {c["id"].split("-")[0]: c for c in tomllib.loads((Path(__file__).parent / "cases" / "planner.toml").read_text())["case"]}
P1 = _CASES["P1"]["config"]
P2 = _CASES["P2"]["config"]
P6 = _CASES["P6"]["config"]
TINY = dict(
    model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=512,
)


def _config(tmp_path: Path, fields: dict, name: str = "config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(fields), encoding="utf-8")
    return load_config(resolve_model(str(path)))


def _spec(**kw) -> RunSpec:
    if kw.get("mode", "lora") != "inference":
        kw.setdefault("steps", 40)
    return RunSpec.build(**kw)


# ------------------------------------------------------------------------------------------------- planner cases
def test_p1_70b_counts_every_parameter_and_weights_with_head(tmp_path):
    config = _config(tmp_path, P1)
    start = time.perf_counter()
    params = count_parameters(config, "inference", None)
    spec = RunSpec.build(mode="inference", dtype="fp16")
    plan = plan_memory(spec, config, [DEVICE_80G], params)
    elapsed = time.perf_counter() - start
    assert params == ParameterCount(total=70553706496, trainable=0)
    weights = plan.devices[0].lines["weights"]
    assert weights.bytes == 141107412992  # every parameter, LM head included, 2 bytes each
    assert "fp16" in weights.method
    assert plan.devices[0].fits is False  # 141 GB of fp16 weights do not fit in 80 GiB
    assert elapsed < 30, f"building the 70B model twice on the meta device took {elapsed:.1f} s"


def test_p2_gated_mlp_and_qkv_bias_count(tmp_path):
    config = _config(tmp_path, P2)
    assert count_parameters(config, "inference", None).total == 72287920128


def test_p3_full_finetune_is_a_sum_with_every_component(tmp_path):
    config = _config(tmp_path, P1)
    p = 70553706496
    spec = _spec(mode="full", dtype="bf16", optimizer="adamw", batch_size=1, seq_len=2048)
    plan = plan_memory(spec, config, [DEVICE_80G])
    dp = plan.devices[0]
    assert plan.parameters == ParameterCount(p, p)
    # mixed precision (bf16 autocast over fp32 master weights): 4 + 4 + 8 = 16 B per parameter before activations
    assert dp.lines["weights"].bytes == 4 * p
    assert dp.lines["gradients"].bytes == 4 * p
    assert dp.lines["optimizer_states"].bytes == 8 * p  # AdamW, two fp32 moments
    assert sum(dp.lines[k].bytes for k in ("weights", "gradients", "optimizer_states")) == 16 * p
    assert dp.lines["kv_cache"].bytes == 0
    assert dp.lines["overhead"].bytes == CUDA_OVERHEAD_BYTES
    assert dp.total_bytes == sum(line.bytes for line in dp.lines.values())
    assert dp.total_bytes >= 16 * p
    assert dp.total_bytes > max(line.bytes for line in dp.lines.values())
    assert dp.fits is False


def test_p6_kv_cache_with_grouped_query_attention(tmp_path):
    config = _config(tmp_path, P6)
    spec = RunSpec.build(mode="inference", dtype="bf16", batch_size=1, seq_len=8192)
    plan = plan_memory(spec, config, [DEVICE_80G])
    assert plan.parameters.total == 8030261248
    kv = plan.devices[0].lines["kv_cache"]
    assert kv.bytes == 1073741824  # 2 x 32 layers x 8 kv heads x 128 x 8192 x 2 B, not 4x that
    assert "x 8 x 128 x" in kv.method
    assert plan.devices[0].lines["gradients"].bytes == 0
    assert plan.devices[0].lines["optimizer_states"].bytes == 0


def test_p7_lora_activations_stay_the_order_of_full_fine_tuning(tmp_path):
    """Case P7, analytic: LoRA's activations are not cut in proportion to its trainable parameters. What was measured
    (traced plan, CPU probe): frozen MLP linears keep no input, so LoRA on q/v saves about 0.7x full fine-tuning's
    activations (see tests/test_traced.py for the traced side of the case)."""
    config = _config(tmp_path, TINY)
    kw = dict(dtype="bf16", batch_size=4, seq_len=128)
    full = plan_memory(_spec(mode="full", **kw), config, [DEVICE_80G]).devices[0].lines
    lora = plan_memory(_spec(mode="lora", **kw), config, [DEVICE_80G]).devices[0].lines
    assert 0.5 * full["activations"].bytes < lora["activations"].bytes < full["activations"].bytes
    layer = 4 * 128 * 64  # s·b·h
    adapters = 4 * 128 * (64 + 8) * 4 * 4  # b·s·(in + r) x 4 B for 2 layers x (q, v)
    assert full["activations"].bytes - lora["activations"].bytes == 2 * 10 * layer - adapters  # 10 of 34 units
    assert "frozen MLP linears keep no input" in lora["activations"].method
    assert lora["gradients"].bytes < full["gradients"].bytes / 10
    assert lora["optimizer_states"].bytes < full["optimizer_states"].bytes / 10


# ------------------------------------------------------------------------------------- against real tiny models
def _real_model(config):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    if hasattr(config, "to_transformers"):  # a Llama-family config.json loads as core.shapes.FastConfig
        config = config.to_transformers()
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")])
def test_lora_trainable_count_matches_peft_on_a_real_model(tmp_path, targets):
    from peft import LoraConfig, get_peft_model

    config = _config(tmp_path, TINY)
    lora = LoraSettings(r=4, alpha=8, dropout=0.0, targets=targets)
    real = get_peft_model(
        _real_model(config), LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), task_type="CAUSAL_LM")
    )
    trainable, total = real.get_nb_trainable_parameters()
    assert count_parameters(config, "lora", lora) == ParameterCount(total=total, trainable=trainable)


def test_tied_embeddings_counted_once(tmp_path):
    tied = _config(tmp_path, dict(TINY, tie_word_embeddings=True), "tied.json")
    untied = _config(tmp_path, TINY, "untied.json")
    real = _real_model(tied)
    assert count_parameters(tied, "full", None).total == sum(p.numel() for p in real.parameters())
    assert count_parameters(untied, "full", None).total - count_parameters(tied, "full", None).total == 256 * 64


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
def test_optimizer_states_match_a_real_fp32_step(tmp_path, optimizer):
    """fp32 model: the convention's 4 B states are what torch AdamW / transformers Adafactor really keep."""
    import torch

    config = _config(tmp_path, TINY)
    model = _real_model(config)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        from transformers.optimization import Adafactor

        opt = Adafactor(model.parameters(), lr=1e-3, relative_step=False, scale_parameter=False, warmup_init=False)
    ids = torch.randint(0, 256, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    real = sum(
        t.numel() * t.element_size()
        for state in opt.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    spec = _spec(mode="full", dtype="fp32", optimizer=optimizer, batch_size=2, seq_len=16)
    assert plan_memory(spec, config, [DEVICE_80G]).devices[0].lines["optimizer_states"].bytes == real


def test_gradient_checkpointing_and_eager_attention_change_activations(tmp_path):
    config = _config(tmp_path, TINY)
    eager = _config(tmp_path, dict(TINY, attn_implementation="eager"), "eager.json")
    kw = dict(mode="full", dtype="bf16", batch_size=2, seq_len=256)
    base = plan_memory(_spec(**kw), config, [DEVICE_80G]).devices[0].lines["activations"]
    ckpt = plan_memory(_spec(gradient_checkpointing=True, **kw), config, [DEVICE_80G]).devices[0].lines["activations"]
    with_scores = plan_memory(_spec(**kw), eager, [DEVICE_80G]).devices[0].lines["activations"]
    s, b, h, a, L, V = 256, 2, 64, 4, 2, 256
    assert base.bytes == L * s * b * h * 34 + 2 * b * s * V * 4
    assert ckpt.bytes == L * s * b * h * 2 + s * b * h * 34 + 2 * b * s * V * 4
    assert with_scores.bytes == L * (s * b * h * 34 + 5 * a * s * s * b) + 2 * b * s * V * 4
    assert "sdpa" in base.method and "eager" in with_scores.method


def test_linear_module_names(tmp_path):
    names = linear_module_names(_config(tmp_path, TINY))
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"}


# ------------------------------------------------------------------------------------------------ fit and output
def test_fits_is_judged_against_the_device_capacity(tmp_path):
    config = _config(tmp_path, TINY)
    spec = _spec(mode="full", dtype="fp32", batch_size=2, seq_len=64)
    small = DeviceInfo("cuda:0", "cuda", "small", 100 * 2**20, "test")
    large = DeviceInfo("cuda:1", "cuda", "large", 80 * GiB, "test")
    unknown = DeviceInfo("cuda:2", "cuda", "unknown", None, "unknown")
    plan = plan_memory(spec, config, [small, large, unknown])
    assert [dp.fits for dp in plan.devices] == [False, True, None]  # 500 MiB CUDA overhead alone exceeds 100 MiB
    cpu = DeviceInfo("cpu", "cpu", "host CPU", plan.devices[0].total_bytes - CUDA_OVERHEAD_BYTES, "test")
    cpu_plan = plan_memory(spec, config, [cpu]).devices[0]
    assert cpu_plan.lines["overhead"].bytes == 0
    assert cpu_plan.fits is True  # exactly at capacity fits


def test_to_json_has_exactly_the_documented_keys(tmp_path):
    config = _config(tmp_path, TINY)
    plan = plan_memory(_spec(mode="lora", dtype="bf16"), config, [DEVICE_80G])
    out = plan.to_json()
    json.dumps(out)
    assert set(out) == {"parameters", "strategy", "convention", "devices"}
    assert set(out["parameters"]) == {"total", "trainable"}
    assert out["strategy"] == "single"
    assert "fp32" in out["convention"] and "sum" in out["convention"]
    (device,) = out["devices"]
    assert set(device) == {"name", "label", "capacity_bytes", "components", "methods", "total_bytes", "fits"}
    assert list(device["components"]) == list(COMPONENTS) == list(device["methods"])
    assert all(type(v) is int for v in device["components"].values())
    assert all(isinstance(m, str) and m for m in device["methods"].values())
    assert device["total_bytes"] == sum(device["components"].values())
    assert device["fits"] is True


def test_detect_devices():
    (cpu,) = detect_devices("cpu")
    assert cpu.kind == "cpu" and cpu.capacity_bytes > 0 and "psutil" in cpu.capacity_source
    import torch

    (gpu,) = detect_devices("cuda:0")
    assert gpu.name == "cuda:0" and gpu.kind == "cuda"
    if torch.cuda.is_available():
        assert gpu.capacity_bytes == torch.cuda.get_device_properties(0).total_memory
    else:
        assert gpu.capacity_bytes is None and "unknown" in gpu.capacity_source
        assert [d.name for d in detect_devices("auto")] == ["cpu"]


def test_detect_devices_for_a_planned_box_asks_no_torch():
    code = ("import sys; from core.plan import detect_devices; d = detect_devices('24GiB,8GiB'); "
            "print([x.capacity_bytes for x in d], 'torch' in sys.modules)")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1]
    )
    assert out.stdout.strip() == f"[{24 * GiB}, {8 * GiB}] False"


def test_strategies_on_cpu_devices_plan_no_cuda_or_nccl_overhead(tmp_path):
    config = _config(tmp_path, TINY)
    cpus = [DeviceInfo(f"cpu{i}", "cpu", "host", 80 * GiB, "test") for i in range(2)]
    for strategy in ("ddp", "zero3", "device_map"):
        plan = plan_memory(_spec(mode="full", strategy=strategy, devices="0,1"), config, cpus)
        assert [dp.lines["overhead"].bytes for dp in plan.devices] == [0, 0]


def test_import_is_lazy():
    code = "import sys, core.plan; print(any(m in sys.modules for m in ('torch', 'transformers', 'peft', 'textual')))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1]
    )
    assert out.stdout.strip() == "False"
