"""bitsandbytes' quantised layouts (core/plan/quant.py) against the live tensors bitsandbytes makes on this CPU, to the byte."""

from __future__ import annotations

import pytest

from core.plan.quant import (
    adamw_8bit_is_8bit,
    adamw_8bit_maps_bytes,
    adamw_8bit_state_bytes,
    quantised_4bit,
)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a tensor shared by two states counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
    return sum(seen.values())


def _constants(state) -> list:
    """The tensors of a bitsandbytes QuantState beside the packed weight."""
    tensors = [state.absmax, state.code]
    if state.nested:
        tensors += [state.state2.absmax, state.state2.code, state.offset]
    return tensors


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [False, True])
def test_each_4bit_layer_of_a_quantised_model_weighs_what_the_layout_says(tiny_model_dir, quant_type, double_quant):
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=config, device_map="cpu")
    quantised = {n: p for n, p in model.named_parameters() if getattr(p, "quant_state", None) is not None}
    assert len(quantised) == 14  # q, k, v, o, gate, up, down in each of the 2 layers; embeddings and norms are not
    for name, param in quantised.items():
        numel = param.quant_state.shape.numel()
        expected = quantised_4bit(numel, double_quant)
        assert param.untyped_storage().nbytes() == expected.packed_bytes, name
        assert _storage_bytes(_constants(param.quant_state)) == expected.constants_bytes, name
    # no constant is shared between two layers: the model's distinct storages are the sum over layers
    every = [t for p in quantised.values() for t in _constants(p.quant_state)]
    assert _storage_bytes(every) == sum(quantised_4bit(p.quant_state.shape.numel(), double_quant).constants_bytes
                                        for p in quantised.values())
    # transformers' own footprint counts parameters and buffers: the packed weights, never the constants
    rest = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n not in quantised)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    packed = sum(quantised_4bit(p.quant_state.shape.numel(), double_quant).packed_bytes for p in quantised.values())
    assert model.get_memory_footprint() == packed + rest + buffers


@pytest.mark.parametrize("numel", [1, 63, 64, 195, 64 * 256, 64 * 256 + 1])
def test_odd_sizes_and_more_than_one_second_level_block(numel):
    """An odd count packs into (n + 1) // 2 bytes; 16,385 elements make 257 blocks: two second-level absmax values."""
    import bitsandbytes.functional as F
    import torch

    data = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    for double_quant in (False, True):
        packed, state = F.quantize_4bit(data, blocksize=64, compress_statistics=double_quant, quant_type="nf4")
        expected = quantised_4bit(numel, double_quant)
        assert (packed.untyped_storage().nbytes(), _storage_bytes(_constants(state))) == (
            expected.packed_bytes, expected.constants_bytes), (numel, double_quant)


def test_adamw_8bit_states_below_at_and_above_the_threshold_and_for_an_embedding(monkeypatch):
    """bitsandbytes' AdamW8bit after one step: fp32 moments under 4,096 elements and for a weight given 32-bit states
    (as Trainer gives every embedding), uint8 moments with an fp32 absmax per 256 elements otherwise, two maps once."""
    import bitsandbytes as bnb
    import torch

    sizes = {"norm": 100, "threshold": 4096, "odd": 5000, "embedding": 8192}
    params = {k: torch.nn.Parameter(torch.randn(n)) for k, n in sizes.items()}
    # bitsandbytes' GlobalOptimManager is a process-wide singleton keeping each override by id(parameter) for good: a
    # fresh one for this test, the process's own put back after it. Left in place, the embedding's 32-bit override
    # outlived its Parameter, and a later test's Parameter allocated at the same address got 32-bit states too
    # (test_the_cpu_step_holds_the_fp32_copies_the_plan_counts then measured 3 + 1 fp32 copies, not 5 + 1).
    monkeypatch.setattr(bnb.optim.GlobalOptimManager, "_instance", None)
    manager = bnb.optim.GlobalOptimManager.get_instance()
    manager.register_parameters(list(params.values()))
    manager.override_config(params["embedding"], "optim_bits", 32)
    optimizer = bnb.optim.AdamW8bit(list(params.values()), lr=1e-3)
    for p in params.values():
        p.grad = torch.randn_like(p)
    optimizer.step()
    live = [t for p in params.values() for t in optimizer.state[p].values() if isinstance(t, torch.Tensor)]
    fp32 = {"embedding"}
    assert [adamw_8bit_is_8bit(n, k in fp32) for k, n in sizes.items()] == [False, True, True, False]
    for key, p in params.items():
        own = [t for k, t in optimizer.state[p].items() if isinstance(t, torch.Tensor) and not k.startswith("qmap")]
        assert _storage_bytes(own) == adamw_8bit_state_bytes(sizes[key], key in fp32), key
    assert adamw_8bit_state_bytes(5000) == 2 * 5000 + 8 * 20  # 20 blocks of 256, the last one partial
    assert _storage_bytes(live) == sum(adamw_8bit_state_bytes(n, k in fp32) for k, n in sizes.items()) + \
        adamw_8bit_maps_bytes(True)


def test_sizes_out_of_range_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        quantised_4bit(0, False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cpu_step_holds_the_fp32_copies_the_plan_counts(dtype):
    """bitsandbytes' CPU kernels run inside one custom op each, where the probe's TorchDispatchMode sees nothing; with
    the kernels exposed (core.child.measure.expose_bitsandbytes_cpu_kernels) a real step shows 5 fp32 copies of an
    8-bit tensor, 3 of an fp32-state one, one more for a 16-bit parameter: what the plan counts."""
    import bitsandbytes as bnb
    import torch

    from core.child.measure import LiveTensorTracker, expose_bitsandbytes_cpu_kernels
    from core.plan.quant import adamw_8bit_step_temporaries

    def step_peak(numel: int, eight: bool) -> tuple[int, int]:
        p = torch.nn.Parameter(torch.randn(numel, dtype=getattr(torch, dtype)))
        optimizer = bnb.optim.AdamW8bit([p], lr=1e-3, min_8bit_size=4096 if eight else 10**9)
        for _ in range(2):  # the first step makes the states; the second is a steady one
            p.grad = torch.randn_like(p)
            tracker = LiveTensorTracker(0)
            with tracker:
                optimizer.step()
        return tracker.peak_bytes, p.element_size()

    exposed = getattr(torch.ops.bitsandbytes.optimizer_update_8bit_blockwise, "_gpuaccept_exposed", False)
    hidden = None if exposed else step_peak(65_636, True)[0]  # the op's inside, unseen (once per process)
    assert expose_bitsandbytes_cpu_kernels()
    for numel, eight in ((65_636, True), (8_192, False)):
        peak, nbytes = step_peak(numel, eight)
        planned, _ = adamw_8bit_step_temporaries([(numel, nbytes, not eight)], "cpu")
        assert peak == planned, (numel, eight, dtype)
        if eight and hidden is not None:
            assert hidden == 0 < planned  # what a probe missed before the kernels were exposed
    assert adamw_8bit_step_temporaries([(65_636, 4, False)], "cuda")[0] == 0  # one fused kernel, nothing allocated


def test_the_plan_counts_8_bit_states_per_tensor_with_the_embedding_in_fp32():
    from core.models import load_config, resolve_model
    from core.plan.devices import DeviceInfo
    from core.plan.memory import plan_memory
    from core.spec import RunSpec

    spec = RunSpec.build(mode="full", optimizer="adamw_8bit")  # the embedded SmolLM2-135M
    device = DeviceInfo("cuda:0", "cuda", "test GPU", 80 * 2**30, "test")
    plan = plan_memory(spec, load_config(resolve_model(spec.model)), [device])
    line = plan.devices[0].lines["optimizer_states"]
    # SmolLM2-135M: 30 layers of q, o (576 x 576), k, v (192 x 576), gate, up, down (1,536 x 576): every projection
    # 8-bit; norms (576) fp32; the tied embedding (49,152 x 576) fp32 as Trainer makes it
    h, kv, i, layers, vocab = 576, 192, 1536, 30, 49152
    eight = layers * (2 * h * h + 2 * kv * h + 3 * i * h)
    full = vocab * h + (2 * layers + 1) * h
    blocks = layers * (2 * (h * h // 256) + 2 * (kv * h // 256) + 3 * (i * h // 256))
    assert line.bytes == 2 * eight + 8 * blocks + 8 * full + 2048


# ---------------------------------------------------------------------------------------------------------- QLoRA
@pytest.mark.parametrize(("quant_type", "double_quant", "dtype"), [("nf4", True, "fp32"), ("fp4", False, "fp32"),
                                                                    ("nf4", False, "bf16")])
def test_the_qlora_plan_weighs_the_loaded_4_bit_model_to_the_byte(tiny_model_dir, quant_type, double_quant, dtype):
    """The plan's weights line and its 4-bit part against the model gpuaccept's child loads (the recipe's
    ``load_4bit``, peft's prepare and the adapters): the packed weights with their quant_state constants, and every
    other parameter fp32 after prepare_model_for_kbit_training, whatever the dtype."""
    from core.child.measure import parameter_placement
    from core.child.recipe import build_model
    from core.pipeline import make_plan
    from core.spec import RunSpec

    spec = RunSpec.build(mode="qlora", model=str(tiny_model_dir), dtype=dtype, qlora_quant_type=quant_type,
                         qlora_double_quant=double_quant, devices="cpu")
    model, _ = build_model(spec, str(tiny_model_dir), "cpu")
    placed = parameter_placement(model)["cpu"]
    plan = make_plan(spec).plan
    q = plan.quantised
    assert q is not None and q.layers == 14 and q.quant_type == quant_type
    assert placed["quantised_bytes"] == q.packed_bytes + q.constants_bytes
    assert placed["bytes"] == plan.devices[0].lines["weights"].bytes == q.weights_bytes
    assert placed["parameters"] == plan.parameters.total and placed["trainable"] == plan.parameters.trainable
    assert {str(p.dtype) for p in model.parameters() if getattr(p, "quant_state", None) is None} == {"torch.float32"}


def _small_llama(path):
    """Hidden 256, MLP 1,024 and a 256-token vocabulary: a 4-bit layer's dequantised weight (1 MiB in fp32) is larger
    than every activation, so it decides the forward's peak."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from core.models import ensure_embedded_cache

    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(ensure_embedded_cache()).save_pretrained(path)
    return path


def test_a_4_bit_layer_holds_its_dequantised_weight_as_it_runs(tmp_path):
    """The forward's peak of QLoRA is LoRA's plus the largest layer's weight dequantised to the compute dtype (and its
    fp32 absmax with double quantisation): both are seen by the probe's tracker once bitsandbytes' kernel bodies are
    exposed, and the plan's dequantised term is that difference, to the byte."""
    import torch

    from core.child.measure import LiveTensorTracker, expose_bitsandbytes_cpu_kernels
    from core.child.recipe import build_model
    from core.plan.quant import dequantised_bytes
    from core.spec import RunSpec

    model_dir = _small_llama(tmp_path / "small")
    expose_bitsandbytes_cpu_kernels()

    def forward_peak(**kw) -> int:
        spec = RunSpec.build(model=str(model_dir), batch_size=1, seq_len=4, **kw)
        model, _ = build_model(spec, str(model_dir), "cpu")
        model.train()
        ids = torch.arange(4).unsqueeze(0)
        with LiveTensorTracker() as tracker:
            model(input_ids=ids, labels=ids)
        return tracker.peak_bytes

    lora = forward_peak(mode="lora")
    for dq in (False, True):
        extra = forward_peak(mode="qlora", qlora_double_quant=dq) - lora
        assert extra == dequantised_bytes(256 * 1024, 4, dq) == 256 * 1024 * 4 + (4 * 4096 if dq else 0)


@pytest.mark.parametrize(("overrides", "named"), [({"mode": "qlora"}, "mode: qlora"),
                                                  ({"mode": "full", "optimizer": "adamw_8bit"},
                                                   "optimizer: adamw_8bit")])
def test_a_variant_without_bitsandbytes_is_refused_before_it_starts_saying_how_to_install_it(
        tiny_model_dir, monkeypatch, overrides, named):
    import importlib.util

    from core.errors import GpuAcceptError
    from core.pipeline import check_runnable, make_plan
    from core.spec import RunSpec

    spec = RunSpec.build(model=str(tiny_model_dir), devices="cpu", **overrides)
    ctx = make_plan(spec)
    check_runnable(spec, ctx, "cpu")  # installed here: runnable
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(GpuAcceptError) as err:
        check_runnable(spec, ctx, "cpu")
    assert str(err.value).startswith(named) and 'pip install -e ".[qlora]"' in str(err.value)
