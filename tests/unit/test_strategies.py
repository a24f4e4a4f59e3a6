"""Per-device plans by strategy (core/plan/memory.py ``plan_memory``): cases P4 and P5 of tests/cases/planner.toml, ZeRO stage
ordering, device_map placement, tensor parallelism, planned boxes (``8x80GiB``) and their spec errors.

Expected values are computed here from the configs by hand (parameter shapes, ZeRO arXiv 1910.02054, Korthikanti et al.
2022), not read back from the planner."""

from __future__ import annotations

import json
import math
import os
import tomllib
from pathlib import Path

import pytest

from core.devicespec import parse_device_capacities, parse_devices
from core.errors import SpecError
from core.models import load_config, resolve_model
from core.plan.context import MEASURED_H200_INFERENCE, MEASURED_H200_TRAINING, nccl_buffers
from core.plan.devices import DeviceInfo, detect_devices
from core.plan.memory import plan_memory
from core.spec import RunSpec
from tests.paths import CASES

GiB = 2**30
#: NCCL's buffers as this environment sets them (core/plan/context.py; worked by hand in tests/unit/test_context.py)
NCCL_BYTES = nccl_buffers(os.environ)[0]
_CASES = {c["id"].split("-")[0]: c for c in tomllib.loads((CASES / "planner.toml").read_text())["case"]}
P4 = _CASES["P4"]
P6 = _CASES["P6"]
# The embedded model's config (SmolLM2-135M): llama, tied embeddings, 134,515,008 parameters.
SMOLLM2 = dict(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, max_position_embeddings=8192,
)
SMOLLM2_PARAMS = 134515008
SMOLLM2_EMBED = 49152 * 576
SMOLLM2_LAYER = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576  # q,o + k,v (3 kv heads x 64) + MLP + 2 norms


def _config(tmp_path: Path, fields: dict, name: str = "config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(fields), encoding="utf-8")
    return load_config(resolve_model(str(path)))


def _plan(config, devices: str, **kw):
    if kw.get("mode") != "inference":
        kw.setdefault("steps", 40)
    spec = RunSpec.build(devices=devices, **kw)
    return plan_memory(spec, config, detect_devices(spec.devices))


def _bytes(plan, component: str) -> list[int]:
    return [dp.lines[component].bytes for dp in plan.devices]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return _config(tmp_path_factory.mktemp("smollm2"), SMOLLM2)


@pytest.fixture(scope="module")
def gptj(tmp_path_factory):
    return _config(tmp_path_factory.mktemp("gptj"), P4["config"])


# ---------------------------------------------------------------------------------------------------------------- P4
def test_p4_zero3_shards_model_states_but_not_activations(gptj):
    # fp16 full fine-tuning keeps fp32 master weights (pure fp16 is refused: its gradients could not be unscaled)
    plans = {n: _plan(gptj, f"{n}x80GiB", mode=P4["mode"], dtype=P4["dtype"], precision="amp",
                      strategy=P4["strategy"], batch_size=1, seq_len=2048) for n in P4["devices"]}
    p = plans[2].parameters.total
    assert p == plans[4].parameters.total == 6050882784
    for n, plan in plans.items():
        assert plan.strategy == "zero3"  # the case says "fsdp": stored as zero3
        assert len(plan.devices) == n
        dp = plan.devices[0]
        # mixed precision, fp32 master weights: 4 + 4 + 8 B per parameter, each / N (rounded up)
        assert dp.lines["weights"].bytes == math.ceil(4 * p / n)
        assert dp.lines["gradients"].bytes == math.ceil(4 * p / n)
        assert dp.lines["optimizer_states"].bytes == math.ceil(8 * p / n)
        assert f"N={n}" in dp.lines["weights"].method and "zero3" in dp.lines["weights"].method
    two, four = plans[2].devices[0].lines, plans[4].devices[0].lines
    for name in ("weights", "gradients", "optimizer_states"):
        assert abs(2 * four[name].bytes - two[name].bytes) <= 2, name  # half, within rounding
    # activations are per micro-batch: identical at N=2 and N=4. GPT-J has no op-by-op model here: Korthikanti's
    # s·b·h·34 per layer (16-bit), its MLP share (19) generalised: a plain 4h MLP with gelu_new, whose Python arithmetic
    # keeps 3 more 4h-wide tensors (+ 3 x 2 x 4 = 24); under amp each layer's fp16 copy of its linear weights and
    # biases (q,k,v,o; fc_in/out), the final norm and LM head inputs b·s·h x (4 + 2) B, and the loss: logits b·s·V x
    # (2 + 4 + 4) B
    s, b, h, L, V = 2048, 1, 4096, 28, 50400
    cast = L * (4 * h * h + 2 * 4 * h * h + 4 * h + h) * 2
    expected_act = L * s * b * h * (34 + 24) + cast + b * s * h * (4 + 2) + b * s * V * (2 + 4 + 4)
    assert two["activations"].bytes == four["activations"].bytes == expected_act
    assert "not divided" in four["activations"].method and "Korthikanti" in four["activations"].method
    # the gathered units, in forward and backward: the largest decoder layer x 2 and the root unit (embeddings, ln_f,
    # LM head with its bias: every parameter no layer holds), fp32 master weights
    layer = 4 * h * h + 2 * (h * 4 * h) + 4 * h + h + 2 * h  # q,k,v,o + fc_in/fc_out + their biases + ln_1
    root = p - L * layer
    assert root == V * h + 2 * h + V * h + V  # wte, ln_f (weight, bias), lm_head (weight, bias)
    phases = plans[4].devices[0].phases
    assert phases["forward"].components["temporaries"] == 2 * layer * 4 + root * 4
    assert phases["backward"].components["temporaries"] == 2 * layer * 4 + root * 4 + 2 * b * s * V * 4
    # the optimizer step runs on the shard: foreach AdamW's one more state / N, and nothing gathered
    assert phases["optimizer_step"].components["temporaries"] == math.ceil(4 * p / 4)
    assert four["overhead"].bytes == MEASURED_H200_TRAINING + NCCL_BYTES
    dp4 = plans[4].devices[0]
    states_only = sum(four[k].bytes for k in ("weights", "gradients", "optimizer_states"))
    assert dp4.phases["forward"].total_bytes >= states_only - four["gradients"].bytes + four["activations"].bytes
    assert dp4.total_bytes > 1.3 * states_only  # far above the "model states only" figure
    assert four["activations"].bytes > 10 * 0.77e9  # the wrong value seen was 0.77 GB per GPU in all


# ---------------------------------------------------------------------------------------------------------------- P5
def test_p5_a_device_does_not_fit_whatever_the_sum_and_ddp_replicates(smollm2):
    kw = dict(mode="full", dtype="bf16", batch_size=16, seq_len=2048)
    single = _plan(smollm2, "8x24GiB", strategy="single", **kw)
    assert single.parameters.total == SMOLLM2_PARAMS
    assert len(single.devices) == 8
    cuda0 = single.devices[0]
    assert cuda0.device.name == "cuda:0" and cuda0.device.capacity_bytes == 24 * GiB
    assert cuda0.total_bytes > 24 * GiB
    assert cuda0.total_bytes < 8 * 24 * GiB  # the sum over the box would hold it: irrelevant
    assert [dp.fits for dp in single.devices] == [False] * 8
    assert single.to_json()["devices"][0]["fits"] is False
    ddp = _plan(smollm2, "8x24GiB", strategy="ddp", **kw)
    assert ddp.strategy == "ddp" and len(ddp.devices) == 8
    for dp in ddp.devices:
        assert dp.lines["weights"].bytes == cuda0.lines["weights"].bytes == 2 * SMOLLM2_PARAMS  # a full bf16 replica
        assert dp.lines["gradients"].bytes == cuda0.lines["gradients"].bytes
        assert dp.lines["optimizer_states"].bytes == cuda0.lines["optimizer_states"].bytes
        assert dp.lines["activations"].bytes == cuda0.lines["activations"].bytes
        # DDP's bucket buffers: a second copy of every gradient (gradient_as_bucket_view=False), in every phase
        assert dp.lines["temporaries"].bytes == cuda0.lines["temporaries"].bytes + 2 * SMOLLM2_PARAMS
        assert all(p.components["temporaries"] >= 2 * SMOLLM2_PARAMS for p in dp.phases.values())
        assert "estimate" in dp.lines["temporaries"].method and "bucket" in dp.lines["temporaries"].method
        assert dp.lines["overhead"].bytes == MEASURED_H200_TRAINING + NCCL_BYTES
        assert "NCCL" in dp.lines["overhead"].method and "estimate" in dp.lines["overhead"].method
        assert dp.fits is False


# ------------------------------------------------------------------------------------------------------------ ZeRO-1/2
def test_zero1_shards_optimizer_states_zero2_also_gradients(smollm2):
    kw = dict(mode="full", dtype="bf16", precision="amp", batch_size=1, seq_len=256)
    n = 8
    plans = {s: _plan(smollm2, f"{n}x24GiB", strategy=s, **kw) for s in ("ddp", "zero1", "zero2", "zero3")}
    ddp, z1, z2, z3 = (plans[s].devices[0].lines for s in ("ddp", "zero1", "zero2", "zero3"))
    p = SMOLLM2_PARAMS
    assert ddp["optimizer_states"].bytes == 8 * p
    assert z1["optimizer_states"].bytes == math.ceil(8 * p / n)
    assert z1["gradients"].bytes == 4 * p and z1["weights"].bytes == 4 * p  # not divided in stage 1
    assert z2["optimizer_states"].bytes == math.ceil(8 * p / n)
    assert z2["gradients"].bytes == math.ceil(4 * p / n) and z2["weights"].bytes == 4 * p
    assert z3["weights"].bytes == math.ceil(4 * p / n)
    assert ddp["activations"].bytes == z1["activations"].bytes == z2["activations"].bytes == z3["activations"].bytes
    totals = [plans[s].devices[0].total_bytes for s in ("ddp", "zero1", "zero2", "zero3")]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4
    assert "÷ N=8" in z1["optimizer_states"].method and "not divided" in z1["gradients"].method


# ------------------------------------------------------------------------------------------------------------ device_map
def test_device_map_heterogeneous_places_more_layers_on_the_larger_device(smollm2):
    single = _plan(smollm2, "1x24GiB", mode="inference", dtype="bf16", batch_size=1, seq_len=1024)
    plan = _plan(smollm2, "24GiB,8GiB", mode="inference", dtype="bf16", batch_size=1, seq_len=1024,
                 strategy="device_map")
    assert plan.strategy == "device_map"
    big, small = plan.devices
    assert (big.device.capacity_bytes, small.device.capacity_bytes) == (24 * GiB, 8 * GiB)
    # the KV cache follows the layers: 2 (K,V) x 3 kv heads x 64 x b·s x 2 B per layer
    per_layer_kv = 2 * 3 * 64 * 1 * 1024 * 2
    layers = [dp.lines["kv_cache"].bytes // per_layer_kv for dp in plan.devices]
    assert [dp.lines["kv_cache"].bytes % per_layer_kv for dp in plan.devices] == [0, 0]
    assert sum(layers) == 30 and layers[0] > layers[1] > 0
    assert sum(_bytes(plan, "weights")) == single.devices[0].lines["weights"].bytes == 2 * SMOLLM2_PARAMS
    # embeddings (tied with the LM head) on the first device; weights split about 3:1, within one layer
    assert big.lines["weights"].bytes == 2 * (SMOLLM2_EMBED + layers[0] * SMOLLM2_LAYER)
    assert abs(big.lines["weights"].bytes / (2 * SMOLLM2_PARAMS) - 0.75) < SMOLLM2_LAYER / SMOLLM2_PARAMS
    # the logits are computed on the last device only
    # bf16 logits, their fp32 copy and the log-softmax, and the last hidden state the LM head read
    assert big.lines["activations"].bytes == 0
    assert small.lines["activations"].bytes == 1 * 1024 * 49152 * (2 + 4 + 4) + 1 * 1024 * 576 * 2
    assert "no NCCL" in big.lines["overhead"].method and big.lines["overhead"].bytes == MEASURED_H200_INFERENCE


def test_device_map_training_sums_to_the_whole_run(smollm2):
    kw = dict(mode="full", dtype="bf16", batch_size=2, seq_len=512)
    single = _plan(smollm2, "1x24GiB", **kw).devices[0].lines
    plan = _plan(smollm2, "24GiB,8GiB,8GiB", strategy="device_map", **kw)
    for name in ("weights", "gradients", "optimizer_states", "activations"):
        assert sum(_bytes(plan, name)) == single[name].bytes, name
    assert all(b > 0 for b in _bytes(plan, "weights"))


# ------------------------------------------------------------------------------------------------------------ tp
def test_tp2_halves_the_linear_weights_and_the_kv_cache(tmp_path):
    config = _config(tmp_path, P6["config"])
    kw = dict(mode="inference", dtype="bf16", batch_size=P6["batch"], seq_len=P6["seq_len"])
    single = _plan(config, "1x80GiB", **kw).devices[0].lines
    plan = _plan(config, "2x80GiB", strategy="tp", tp=2, **kw)
    h, inter, L, V, kv = 4096, 14336, 32, 128256, 8 * 128
    linear = L * (2 * h * h + 2 * h * kv + 3 * h * inter)  # q,o + k,v + gate/up/down
    vocab = 2 * V * h  # embedding + untied LM head: vocab-parallel
    replicated = L * 2 * h + h  # RMSNorms
    assert linear + vocab + replicated == P6["expect_parameters"]
    assert single["weights"].bytes == 2 * P6["expect_parameters"]
    for dp in plan.devices:
        assert dp.lines["weights"].bytes == 2 * (linear // 2 + vocab // 2 + replicated)
        assert dp.lines["kv_cache"].bytes == P6["expect_kv_cache_bytes"] // 2
        hidden = P6["batch"] * P6["seq_len"] * h * 2  # the last hidden state, replicated
        assert dp.lines["activations"].bytes - hidden == (single["activations"].bytes - hidden) // 2  # vocab-parallel
        assert "tp=2" in dp.lines["weights"].method
    # 4 devices with tp=2: two data-parallel replicas of a 2-device group hold the same per device
    four = _plan(config, "4x80GiB", strategy="tp", tp=2, **kw)
    assert _bytes(four, "weights") == [plan.devices[0].lines["weights"].bytes] * 4


def test_tp_training_activations_follow_korthikanti_eq2(tmp_path):
    config = _config(tmp_path, P6["config"])
    s, b, h, L, V = 1024, 1, 4096, 32, 128256
    plan = _plan(config, "2x80GiB", mode="full", dtype="bf16", batch_size=b, seq_len=s, strategy="tp", tp=2)
    act = plan.devices[0].lines["activations"]
    # pure bf16: L layers of s·b·h·(10 + 24/t) x 2/2 B, the final norm and LM head inputs b·s·h x (4 + 2) B, the loss
    # over vocab-parallel logits b·s·V/t x (2 + 4 + 4) B
    assert act.bytes == L * s * b * h * (10 + 24 // 2) + b * s * h * 6 + b * s * (V // 2) * (2 + 4 + 4)
    assert "Korthikanti eq. 2" in act.method


def test_tp_must_divide_the_heads(smollm2):
    with pytest.raises(SpecError) as info:
        _plan(smollm2, "2x24GiB", mode="full", strategy="tp", tp=2)  # 9 heads, 3 KV heads
    assert info.value.field == "tp" and "choose tp among 3" in info.value.message
    assert len(_plan(smollm2, "3x24GiB", mode="full", strategy="tp", tp=3).devices) == 3


# ------------------------------------------------------------------------------------------------------------ boxes
def test_box_parsing_and_planned_devices():
    assert parse_device_capacities("8x80GiB") == [80 * 2**30] * 8
    assert parse_device_capacities("24GiB,8GiB") == [24 * 2**30, 8 * 2**30]
    assert parse_device_capacities("2x24GB, 512MiB,1000MB") == [24 * 10**9] * 2 + [512 * 2**20, 10**9]
    assert parse_device_capacities("1.5GiB") == [3 * 2**29]
    for other in ("auto", "cpu", "0", "0,1", "cuda:1"):
        assert parse_device_capacities(other) is None
    devices = detect_devices("8x80GiB")
    assert [d.name for d in devices] == [f"cuda:{i}" for i in range(8)]
    assert all(d == DeviceInfo(d.name, "cuda", "planned GPU", 80 * 2**30, "given: 8x80GiB") for d in devices)
    assert parse_devices("0,1") == ["cuda:0", "cuda:1"]  # unchanged for the run's own devices
    with pytest.raises(SpecError) as info:
        parse_devices("8x80GiB")  # a box is planned, never run
    assert info.value.field == "devices" and "gpuaccept plan" in info.value.message


def test_fsdp_is_stored_as_zero3():
    spec = RunSpec.build(mode="full", strategy="fsdp", devices="2x80GiB")
    assert spec.strategy == "zero3"
    assert RunSpec.from_dict(spec.to_dict()) == spec
    assert spec.spec_hash() == RunSpec.build(mode="full", strategy="zero3", devices="2x80GiB").spec_hash()


@pytest.mark.parametrize(
    ("overrides", "field", "hint"),
    [
        ({"strategy": "pipeline"}, "strategy", "single, ddp, zero1, zero2, zero3, device_map, tp"),
        ({"strategy": "ddp", "devices": "cpu"}, "strategy", "at least 2 devices"),
        ({"strategy": "zero3", "devices": "0"}, "strategy", "at least 2 devices"),
        ({"strategy": "device_map", "devices": "1x80GiB"}, "strategy", "use strategy single"),
        ({"tp": 0}, "tp", "at least 1"),
        ({"tp": 2}, "tp", "only with strategy tp"),
        ({"tp": "2", "strategy": "tp"}, "tp", "expected int"),
        ({"strategy": "tp", "devices": "2x80GiB"}, "tp", "at least 2"),
        ({"strategy": "tp", "tp": 3, "devices": "8x80GiB"}, "tp", "choose tp among 2, 4, 8"),
        ({"devices": "8x80TB"}, "devices", "units GiB, GB, MiB, MB"),
        ({"devices": "0x80GiB"}, "devices", "above 0"),
        ({"devices": "80GiB,0"}, "devices", "mixes CUDA indices with devices to plan for"),
        ({"devices": "2000x1GiB"}, "devices", "plan at most 1024"),
    ],
)
def test_bad_strategy_tp_and_devices_name_the_field(overrides, field, hint):
    with pytest.raises(SpecError) as info:
        RunSpec.build(mode="full", **overrides)
    assert info.value.field == field
    assert hint in info.value.message


def test_strategy_needing_devices_is_checked_when_auto_finds_one(smollm2):
    spec = RunSpec.build(mode="full", strategy="ddp")  # auto: the count is known only when devices are detected
    with pytest.raises(SpecError) as info:
        plan_memory(spec, smollm2, [DeviceInfo("cpu", "cpu", "host", 10**12, "test")])
    assert info.value.field == "strategy"


def test_every_strategy_keeps_every_component_and_the_json_keys(smollm2):
    from core.plan.memory import COMPONENTS

    for strategy, devices, tp in [("ddp", "2x24GiB", 1), ("zero1", "2x24GiB", 1), ("zero2", "2x24GiB", 1),
                                  ("zero3", "2x24GiB", 1), ("device_map", "2x24GiB", 1), ("tp", "3x24GiB", 3)]:
        for mode in ("inference", "full", "lora"):
            plan = _plan(smollm2, devices, mode=mode, strategy=strategy, tp=tp, batch_size=1, seq_len=128)
            out = plan.to_json()
            json.dumps(out)
            assert set(out) == {"parameters", "strategy", "convention", "activation_model", "devices"}
            assert out["strategy"] == strategy
            assert "strategy 'single'" not in out["convention"] and f"Strategy {strategy}" in out["convention"]
            for device in out["devices"]:
                assert list(device["components"]) == list(COMPONENTS)
                assert all(type(v) is int and v >= 0 for v in device["components"].values())
                assert all(m.startswith(strategy) or m.startswith("CUDA") for m in device["methods"].values()), \
                    (strategy, mode, device["methods"])
