"""The analytic memory plan (core/plan/memory.py) against the planner cases in tests/cases/planner.toml and against
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
from core.plan.context import MEASURED_H200_TRAINING
from core.plan.devices import DeviceInfo, detect_devices
from core.plan.lines import CPU_RUNTIME_BYTES
from core.plan.memory import COMPONENTS, plan_memory
from core.plan.meta import ParameterCount, count_parameters, linear_module_names
from core.spec import RunSpec
from core.spectables import LoraSettings
from tests.paths import CASES, REPO

GiB = 2**30
DEVICE_80G = DeviceInfo("cuda:0", "cuda", "test GPU", 80 * GiB, "test")

# Configs exactly as given in the planner cases (tests/cases/planner.toml, a copy of the shared cases).
_CASES = {c["id"].split("-")[0]: c for c in tomllib.loads((CASES / "planner.toml").read_text())["case"]}
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
    spec = _spec(mode="full", dtype="bf16", precision="amp", optimizer="adamw", batch_size=1, seq_len=2048)
    plan = plan_memory(spec, config, [DEVICE_80G])
    dp = plan.devices[0]
    assert plan.parameters == ParameterCount(p, p)
    # mixed precision (bf16 autocast over fp32 master weights): 4 + 4 + 8 = 16 B per parameter before activations
    assert dp.lines["weights"].bytes == 4 * p
    assert dp.lines["gradients"].bytes == 4 * p
    assert dp.lines["optimizer_states"].bytes == 8 * p  # AdamW, two fp32 moments
    assert sum(dp.lines[k].bytes for k in ("weights", "gradients", "optimizer_states")) == 16 * p
    assert dp.lines["kv_cache"].bytes == 0
    # a GPU whose name does not say its SMs: the H200's measured memory outside the allocator, in training
    assert dp.lines["overhead"].bytes == MEASURED_H200_TRAINING
    # the total is the peak of the step: the optimizer step holds all three at once (a sum, never the largest one)
    step = dp.phases["optimizer_step"].components
    assert step["weights"] + step["gradients"] + step["optimizer_states"] == 16 * p
    assert dp.total_bytes == max(phase.total_bytes for phase in dp.phases.values()) >= 16 * p
    assert dp.total_bytes > max(line.bytes for line in dp.lines.values())
    assert dp.total_bytes <= dp.sum_of_lines
    assert dp.fits is False


def test_p3_pure_bf16_holds_half_of_amp_and_no_master_copy(tmp_path):
    """Pure bf16 (the model loaded in bf16): weights, gradients and AdamW's zeros_like(param) moments are 2 B each."""
    config = _config(tmp_path, P1)
    p = 70553706496
    dp = plan_memory(_spec(mode="full", dtype="bf16", precision="pure", batch_size=1, seq_len=2048), config,
                     [DEVICE_80G]).devices[0]
    assert dp.lines["weights"].bytes == 2 * p and dp.lines["gradients"].bytes == 2 * p
    assert dp.lines["optimizer_states"].bytes == 4 * p
    assert "precision pure" in plan_memory(_spec(mode="full", dtype="bf16"), config, [DEVICE_80G]).convention


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
    """Case P7, analytic: LoRA's activations are not cut in proportion to its trainable parameters. On q/v a frozen
    linear keeps no input, so LoRA keeps somewhat less than full fine-tuning; on every linear layer (all-linear) each
    adapter keeps its input and LoRA keeps more than full fine-tuning: the case's "not below" (measured on the layer in
    tests/unit/test_activations.py, traced and hand-written)."""
    config = _config(tmp_path, TINY)
    kw = dict(dtype="bf16", batch_size=4, seq_len=128)
    full = plan_memory(_spec(mode="full", **kw), config, [DEVICE_80G]).devices[0].lines
    lora = plan_memory(_spec(mode="lora", **kw), config, [DEVICE_80G]).devices[0].lines
    every = plan_memory(_spec(mode="lora", lora_targets="all-linear", **kw), config, [DEVICE_80G]).devices[0].lines
    assert 0.5 * full["activations"].bytes < lora["activations"].bytes < full["activations"].bytes
    assert every["activations"].bytes > full["activations"].bytes
    assert lora["gradients"].bytes < full["gradients"].bytes / 10
    assert lora["optimizer_states"].bytes < full["optimizer_states"].bytes / 10


# ------------------------------------------------------------------------------------- against real tiny models
def _real_model(config):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    if hasattr(config, "to_transformers"):  # a Llama-family config.json loads as core.plan.shapes.FastConfig
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


@pytest.mark.parametrize("optimizer,dtype", [("adamw", "fp32"), ("adafactor", "fp32"), ("adamw", "bf16"),
                                             ("sgd", "bf16"), ("adafactor", "bf16")])
def test_optimizer_states_match_a_real_step(tmp_path, optimizer, dtype):
    """What torch's AdamW / SGD and transformers' Adafactor really keep for a model in fp32 or (pure) bf16: AdamW and
    SGD in the parameter's dtype, Adafactor in fp32 whatever it is (it upcasts the gradient first). Step counters are
    0-dimensional tensors on the CPU, not on a CUDA device: not counted for one."""
    import torch

    config = _config(tmp_path, TINY)
    model = _real_model(config).to(getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype]))
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
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
    spec = _spec(mode="full", dtype=dtype, optimizer=optimizer, batch_size=2, seq_len=16)
    assert plan_memory(spec, config, [DEVICE_80G]).devices[0].lines["optimizer_states"].bytes == real


def test_gradient_checkpointing_and_eager_attention_change_activations(tmp_path):
    """Pure bf16 full fine-tuning of TINY (2 layers; the layer accounting of tests/unit/test_activations.py): with
    checkpointing each layer keeps only its input (b·s·h x 2 B); eager attention adds the fp32 softmax and its bf16
    copy (b·a·s·s x 6 B) and the k, v repeated to every head, per layer; the attention choice is the spec's."""
    config = _config(tmp_path, TINY)
    kw = dict(mode="full", dtype="bf16", batch_size=2, seq_len=256, padding="packed")
    base = plan_memory(_spec(**kw), config, [DEVICE_80G]).devices[0]
    ckpt = plan_memory(_spec(gradient_checkpointing=True, **kw), config, [DEVICE_80G]).devices[0]
    eager = plan_memory(_spec(attn_implementation="eager", **kw), config, [DEVICE_80G]).devices[0]
    s, b, h, a, L = 256, 2, 64, 4, 2
    forward = base.phases["forward"].components["activations"]
    assert forward - ckpt.phases["forward"].components["activations"] == L * (base_layer := _layer(base)) - L * s * b * h * 2
    assert base_layer > s * b * h * 2
    # eager per layer: + b·a·s·s x (4 + 2) B, + k and v repeated from 2 to 4 heads (2 x s·b·h/2 x 2 B more), no
    # log-sum-exp (b·a·s x 4 B)
    lse = b * a * s * 4
    assert eager.phases["forward"].components["activations"] - forward == L * (b * a * s * s * 6 + s * b * h * 2 - lse)
    # a padded batch sends SDPA a mask: k and v repeated to every head (+ s·b·h x 2 B here) and the mask, additive in
    # bf16, b·s·s x 2 B, kept per layer
    padded = plan_memory(_spec(**{**kw, "padding": "padded"}), config, [DEVICE_80G]).devices[0]
    assert padded.phases["forward"].components["activations"] - forward == L * (s * b * h * 2 + b * s * s * 2)


def _layer(device_plan) -> int:
    """One layer's saved bytes, read back from the activations method ("one layer saves N B")."""
    import re

    return int(re.search(r"one layer saves ([\d,]+) B", device_plan.lines["activations"].method).group(1).replace(",", ""))


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
    needed = plan_memory(spec, config, [DeviceInfo("cpu", "cpu", "host CPU", None, "test")]).devices[0].total_bytes
    cpu_plan = plan_memory(spec, config, [DeviceInfo("cpu", "cpu", "host CPU", needed, "test")]).devices[0]
    assert cpu_plan.lines["overhead"].bytes == CPU_RUNTIME_BYTES  # the process's runtime: the CPU fit counts RSS
    assert cpu_plan.fits is True  # exactly at capacity fits
    assert plan_memory(spec, config, [DeviceInfo("cpu", "cpu", "host CPU", needed - 1, "test")]).devices[0].fits is False


def test_to_json_has_exactly_the_documented_keys(tmp_path):
    config = _config(tmp_path, TINY)
    plan = plan_memory(_spec(mode="lora", dtype="bf16"), config, [DEVICE_80G])
    out = plan.to_json()
    json.dumps(out)
    assert set(out) == {"parameters", "strategy", "convention", "activation_model", "devices"}
    assert out["activation_model"] == "op-by-op"
    assert set(out["parameters"]) == {"total", "trainable"}
    assert out["strategy"] == "single"
    assert "precision pure" in out["convention"] and "peak of the step" in out["convention"]
    (device,) = out["devices"]
    assert set(device) == {"name", "label", "capacity_bytes", "capacity_source", "components", "methods", "phases", "peak_phase",
                           "sum_of_components_bytes", "untraced_bytes", "total_bytes", "fits"}
    assert list(device["components"]) == list(COMPONENTS) == list(device["methods"])
    assert all(type(v) is int for v in device["components"].values())
    assert all(isinstance(m, str) and m for m in device["methods"].values())
    assert set(device["phases"]) == {"forward", "backward", "optimizer_step"}
    totals = {name: sum(p["components"].values()) for name, p in device["phases"].items()}
    assert device["total_bytes"] == totals[device["peak_phase"]] == max(totals.values())
    assert device["sum_of_components_bytes"] == sum(device["components"].values()) > device["total_bytes"]
    assert device["untraced_bytes"] == device["components"]["overhead"] == MEASURED_H200_TRAINING
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
    code = ("import sys; from core.plan.devices import detect_devices; d = detect_devices('24GiB,8GiB'); "
            "print([x.capacity_bytes for x in d], 'torch' in sys.modules)")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert out.stdout.strip() == f"[{24 * GiB}, {8 * GiB}] False"


def test_strategies_on_cpu_devices_plan_no_cuda_or_nccl_overhead(tmp_path):
    config = _config(tmp_path, TINY)
    cpus = [DeviceInfo(f"cpu{i}", "cpu", "host", 80 * GiB, "test") for i in range(2)]
    for strategy in ("ddp", "zero3", "device_map"):
        plan = plan_memory(_spec(mode="full", strategy=strategy, devices="0,1"), config, cpus)
        # a runtime per process: one per rank, one for device_map's single process
        expected = [CPU_RUNTIME_BYTES, 0] if strategy == "device_map" else [CPU_RUNTIME_BYTES] * 2
        assert [dp.lines["overhead"].bytes for dp in plan.devices] == expected


def test_import_is_lazy():
    code = "import sys, core.plan.memory; print(any(m in sys.modules for m in ('torch', 'transformers', 'peft', 'textual')))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert out.stdout.strip() == "False"
