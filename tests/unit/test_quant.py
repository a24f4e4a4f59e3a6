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
