"""The traced plan (core/plan/traced.py): one step under torch's MemTracker on fake CPU tensors, beside the analytic plan."""

from __future__ import annotations

import pytest

from core.plan.devices import DeviceInfo
from core.plan.lines import Line
from core.plan.memory import DevicePlan, plan_memory
from core.plan.traced import TRACED_COMPONENTS, TracedPlan, compare
from core.plan.tracer import trace_plan
from core.spec import RunSpec

GiB = 2**30
TINY = dict(
    model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=512,
)
CPU = DeviceInfo("cpu", "cpu", "host CPU", 64 * GiB, "test")


def _config(**overrides):
    from transformers import AutoConfig

    values = dict(TINY, **overrides)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def _spec(mode: str, **kw) -> RunSpec:
    base = dict(mode=mode, batch_size=2, seq_len=16, devices="cpu")
    base.update(kw)
    return RunSpec.build(None, **base)


SPECS = {
    "lora fp32": _spec("lora"),
    "lora bf16 pure + checkpointing": _spec("lora", dtype="bf16", gradient_checkpointing=True),
    "lora bf16 amp": _spec("lora", dtype="bf16", precision="amp"),
    "full fp32, accumulation 2": _spec("full", grad_accum=2),
    "full bf16 pure, sgd": _spec("full", dtype="bf16", optimizer="sgd"),
    "full bf16 pure, adamw, eager": _spec("full", dtype="bf16", attn_implementation="eager"),
    "full bf16 amp + checkpointing": _spec("full", dtype="bf16", precision="amp", gradient_checkpointing=True),
    "full adafactor": _spec("full", optimizer="adafactor"),
    "inference bf16": _spec("inference", dtype="bf16"),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_fake_and_real_tensors_give_identical_category_totals(name):
    """docs/architecture.md §6: the same step on fake and on real CPU tensors gives the same bytes in every MemTracker category."""
    spec, config = SPECS[name], _config()
    fake = trace_plan(spec, config, target="cpu")
    real = trace_plan(spec, config, target="cpu", real=True)
    assert fake.tensors == "fake" and real.tensors == "real"
    assert fake.categories == real.categories
    assert fake.components == real.components
    assert fake.phases == real.phases
    assert fake.peak_bytes > 0


@pytest.mark.parametrize("name", ["lora fp32", "full fp32, accumulation 2", "inference bf16"])
def test_fast_path_keeps_the_same_peak_as_per_module_tracking(name):
    spec, config = SPECS[name], _config()
    fast = trace_plan(spec, config, target="cpu", fast=True)
    slow = trace_plan(spec, config, target="cpu", fast=False)
    assert fast.peak_bytes == slow.peak_bytes
    assert fast.components == slow.components
    assert slow.modules and not fast.modules  # per-module peaks only when asked for


def test_weights_and_optimizer_states_match_the_parameters_exactly():
    """Full fp32 with AdamW: weights = 4 B x P; optimizer states = 2 x 4 B x P + one 4-byte step counter per parameter
    tensor (torch keeps ``step`` as a CPU scalar tensor). The batch is large enough for the peak to fall in the
    forward/backward, not in the optimizer step (whose temporaries MemTracker counts as optimizer states)."""
    config = _config()
    spec = _spec("full", batch_size=8, seq_len=64)
    traced = trace_plan(spec, config, target="cpu")
    analytic = plan_memory(spec, config, [CPU])
    n_params = analytic.parameters.total
    n_tensors = 2 + 2 * 9 + 1  # embedding, LM head (untied); per layer 7 linear + 2 norms; the final norm
    assert traced.components["weights"] == 4 * n_params
    assert traced.components["optimizer_states"] == 2 * 4 * n_params + 4 * n_tensors


def test_gradient_accumulation_peak_holds_the_earlier_micro_batch_gradients():
    """With accumulation the second backward adds into gradients that already exist: at that peak every gradient
    (4 B x P, fp32 master weights) is alive; without accumulation the peak comes before most gradients exist."""
    config = _config()
    n_params = plan_memory(_spec("full"), config, [CPU]).parameters.total
    accumulated = trace_plan(_spec("full", grad_accum=2, batch_size=8, seq_len=64), config, target="cpu")
    single = trace_plan(_spec("full", batch_size=8, seq_len=64), config, target="cpu")
    assert accumulated.components["gradients"] == 4 * n_params
    assert single.components["gradients"] < 4 * n_params
    assert accumulated.peak_bytes > single.peak_bytes


def test_inference_kv_cache_equals_the_grouped_query_formula():
    """Traced KV cache = 2 x L x kv_heads x head_dim x b x s x bytes, the analytic line, exactly (GQA: 2 KV heads)."""
    config = _config()
    spec = _spec("inference", dtype="bf16", batch_size=3, seq_len=20)
    traced = trace_plan(spec, config, target="cpu")
    expected = 2 * 2 * 2 * (64 // 4) * 3 * 20 * 2
    assert traced.components["kv_cache"] == expected
    assert plan_memory(spec, config, [CPU]).devices[0].lines["kv_cache"].bytes == expected
    assert traced.components["gradients"] == traced.components["optimizer_states"] == 0


def test_lora_trains_only_adapters_and_keeps_frozen_weights_without_gradients():
    config = _config()
    spec = _spec("lora", lora_r=4, lora_targets="q_proj,v_proj", grad_accum=2)
    traced = trace_plan(spec, config, target="cpu")
    adapters = 2 * 2 * (4 * 64 + 4 * 64) + 0  # 2 layers x (q, v) x (A: r x 64, B: 64 x r) ... per projection
    # q_proj: A (4 x 64), B (64 x 4); v_proj: A (4 x 64), B (32 x 4) (2 KV heads x head_dim 16)
    adapters = 2 * ((4 * 64 + 64 * 4) + (4 * 64 + 32 * 4))
    assert traced.components["gradients"] == 4 * adapters  # accumulation: every adapter gradient alive, fp32
    assert traced.components["optimizer_states"] == 2 * 4 * adapters + 4 * 8  # + 8 step counters (8 adapter tensors)


def test_adamw_foreach_on_cuda_adds_step_temporaries():
    """The target decides foreach as torch would; foreach AdamW's step makes whole-size temporaries (docs/architecture.md §3)."""
    config = _config()
    spec = _spec("full", batch_size=1, seq_len=2)  # tiny activations: the optimizer step is the peak
    cuda = trace_plan(spec, config, target="cuda")
    cpu = trace_plan(spec, config, target="cpu")
    assert "foreach=True" in cuda.method and "foreach=False" in cpu.method
    assert cuda.peak_bytes > cpu.peak_bytes


def test_compare_names_the_line_that_differs_most():
    from core.plan.phases import Phase

    device = CPU
    lines = {name: Line(name, b, "test") for name, b in
             dict(weights=100, gradients=100, optimizer_states=200, activations=1000, temporaries=10, kv_cache=0,
                  overhead=500).items()}
    fwd = dict(weights=100, gradients=0, optimizer_states=200, activations=1000, temporaries=10, kv_cache=0,
               overhead=500)
    step = dict(weights=100, gradients=100, optimizer_states=200, activations=0, temporaries=10, kv_cache=0,
                overhead=500)
    phases = {"forward": Phase("forward", fwd, "constructed"), "optimizer_step": Phase("optimizer_step", step, "c")}
    traced_fwd = dict(weights=100, gradients=0, optimizer_states=200, activations=1300, temporaries=50, kv_cache=0)
    traced_step = dict(weights=100, gradients=100, optimizer_states=200, activations=0, temporaries=0, kv_cache=0)
    traced = TracedPlan(components=traced_fwd, peak_bytes=1650, categories={}, method="constructed", seconds=0.0,
                        tensors="fake", phases={"forward": traced_fwd, "optimizer_step": traced_step})
    diff = compare(DevicePlan(device, lines, phases), traced)
    assert diff.most_different == "activations"
    assert diff.analytic_tensor_bytes == 1310  # the analytic peak (forward) without the overhead: it is not traced
    assert diff.traced_peak_bytes == 1650
    assert diff.relative == pytest.approx(340 / 1310)
    by = {d.component: d for d in diff.lines}
    assert by["gradients"].traced_bytes == 100  # a line is the component's largest value over the phases
    assert by["kv_cache"].relative is None
    assert [d.component for d in diff.lines] == list(TRACED_COMPONENTS)
    assert [(p.component, p.analytic_bytes, p.traced_bytes) for p in diff.phases] == [
        ("forward", 1310, 1650), ("optimizer_step", 410, 400)]


def test_not_a_causal_lm_is_a_named_error():
    from transformers import ViTConfig

    from core.errors import SpecError

    with pytest.raises(SpecError, match="not a causal language model"):
        trace_plan(_spec("full"), ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=64), target="cpu")


def test_p7_traced_lora_activations_stay_the_order_of_full_fine_tuning():
    """Case P7 on the embedded SmolLM2-135M config, traced: LoRA trains 0.7 % of the parameters, and its gradients and
    optimizer states shrink accordingly, but its activations stay the order of full fine-tuning's (backward still runs
    through every frozen layer). Measured here: LoRA's saved activations are 0.7-0.8x full fine-tuning's, not "not
    below" as the case words it: a frozen nn.Linear does not save its input (no weight gradient), so the inputs of
    o_proj, gate/up_proj and down_proj are not kept; the test asserts what was measured."""
    from core.models import ensure_embedded_cache, load_config, resolve_model

    ensure_embedded_cache()
    config = load_config(resolve_model("smollm2-135m"))
    kw = dict(dtype="bf16", batch_size=4, seq_len=256, devices="cpu")  # the peak falls in the backward for both
    full = trace_plan(RunSpec.build(None, mode="full", **kw), config, target="cuda")
    lora_spec = RunSpec.build(None, mode="lora", **kw)
    lora = trace_plan(lora_spec, config, target="cuda")
    counts = plan_memory(lora_spec, config, [CPU]).parameters
    assert counts.trainable / counts.total < 0.01
    ratio = lora.components["activations"] / full.components["activations"]
    assert 0.5 < ratio < 1.0, ratio  # the order of full fine-tuning's, nowhere near the trainable fraction
    assert lora.components["optimizer_states"] < full.components["optimizer_states"] / 100
    assert lora.components["weights"] >= full.components["weights"]  # the base is kept whole (bf16 + fp32 adapters)
