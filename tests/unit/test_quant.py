"""bitsandbytes' 4-bit layout of a base model (core/plan/quant.py) against the live tensors bitsandbytes makes on this CPU, to the byte."""

from __future__ import annotations

import pytest

from core.plan.quant import QLORA_FAMILIES, quantised_4bit


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


def test_sizes_out_of_range_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        quantised_4bit(0, False)


@pytest.mark.parametrize("family", QLORA_FAMILIES)
def test_every_2d_weight_of_a_qlora_familys_decoder_layer_is_a_linear_bitsandbytes_quantises(family):
    """QLoRA is planned for a family only where transformers' bitsandbytes integration quantises every projection of
    its decoder layers: each 2-D weight there belongs to an ``nn.Linear`` (``replace_with_bnb_linear`` converts by
    ``isinstance(module, nn.Linear)``); a small model of the family built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256, pad_token_id=0,
                                  max_position_embeddings=128)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layer = next((m for name, m in model.named_modules() if name.endswith(("layers.0", "h.0"))), None)
    assert layer is not None, f"no decoder layer found in {type(model).__name__}"
    weighted = [(name, m) for name, m in layer.named_modules()
                if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2]
    assert weighted and all(isinstance(m, torch.nn.Linear) for _, m in weighted), \
        [(name, type(m).__name__) for name, m in weighted]


@pytest.mark.parametrize(("version", "keeps"), [("0.42.0", True), ("0.43.1", True), ("0.43.2", False),
                                                ("0.50.2", False), ("1.0.0rc1", False), ("installed", False)])
def test_bitsandbytes_before_0_43_2_keeps_each_4bit_layers_input(version, keeps):
    """MatMul4Bit.forward kept ``ctx.tensors = (A, B)`` until bitsandbytes 0.43.2 (#1270): a 4-bit layer's input per
    layer for backward. ``installed`` is this environment's (constraints.txt pins 0.50.2). LoRA has no 4-bit layer."""
    from core.methods.lora import keeps_4bit_input
    from core.spec import RunSpec

    spec = RunSpec.build(mode="qlora", precision="pure", dtype="bf16", qlora_bitsandbytes=version)
    assert keeps_4bit_input(spec) is keeps
    assert keeps_4bit_input(RunSpec.build(mode="lora")) is False


def test_a_bitsandbytes_version_that_is_not_one_is_named():
    from core.errors import SpecError
    from core.spec import RunSpec

    with pytest.raises(SpecError) as err:
        RunSpec.build(mode="qlora", precision="pure", dtype="bf16", qlora_bitsandbytes="latest")
    assert err.value.field == "qlora.bitsandbytes" and "0.42.0" in str(err.value)


def test_the_inputs_kept_are_each_4bit_layers_distinct_input():
    """A steady Llama layer under bitsandbytes < 0.43.2 saves, besides what it saves anyway, the input of q/k/v (one
    tensor), of gate/up (one) and of down (the gated product, I wide), in the compute dtype; o_proj's input is the
    attention output SDPA saves already. The first layer's q/k/v input needs no gradient (LoRA without
    checkpointing): only its MLP's inputs are kept."""
    from core.plan.activations import Adapter, Dims, Numerics, decoder_layer, step_activations

    b, s, h, inter, c = 2, 64, 96, 256, 2
    dims = Dims(b, s, h, inter, 6, 2, 16, 500, 3, False)
    adapters = {"q_proj": Adapter(4, True), "v_proj": Adapter(4, True)}

    def layer(keeps: bool) -> int:
        return decoder_layer(dims, Numerics(c, c, False, True, keeps), full=False, adapters=adapters,
                             attention="sdpa", input_grad=True).total

    assert layer(True) - layer(False) == b * s * (2 * h + inter) * c
    steps = [step_activations(dims, Numerics(c, c, False, True, keeps), full=False, adapters=adapters,
                              attention="sdpa", checkpointing=False) for keeps in (False, True)]
    assert steps[1].first - steps[0].first == b * s * (h + inter) * c
