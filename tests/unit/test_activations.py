"""The op-by-op activation model (core/plan/activations.py) and the phases of a step (core/plan/phases.py), on small constructed
cases whose bytes are written out here by hand from transformers' Llama code and torch's rules for what each op saves,
then checked against the traced step (torch MemTracker over the model's own code).

The layer: h = 64, MLP width 128 (gated), 4 heads of 16, 2 KV heads; micro-batch b = 2 x s = 16 tokens. So
s·b·h = 2,048 elements, s·b·I = 4,096, a KV projection 1,024 (half of h), the attention log-sum-exp b·a·s = 128 fp32
(512 B), each RMSNorm's rsqrt column b·s = 32 fp32 (128 B, two norms: 256 B).
"""

from __future__ import annotations

import pytest

from core.plan.activations import Adapter, Dims, Numerics, decoder_layer
from core.plan.phases import StepTerms, peak, training_phases
from core.spec import RunSpec

SBH, SBI = 2 * 16 * 64, 2 * 16 * 128
LSE_AND_RSQRT = 2 * 4 * 16 * 4 + 2 * (2 * 16 * 4)
DIMS = Dims(b=2, s=16, h=64, inter=128, heads=4, kv_heads=2, head_dim=16, vocab=256, layers=2, tied=False)
FP32 = Numerics(param_bytes=4, compute_bytes=4, autocast=False)
PURE_BF16 = Numerics(param_bytes=2, compute_bytes=2, autocast=True)
AMP_BF16 = Numerics(param_bytes=4, compute_bytes=2, autocast=True)
QV = {"q_proj": Adapter(4, False), "v_proj": Adapter(4, False)}
LAYER_LINEAR_PARAMS = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128  # q, k, v, o, gate, up, down

#: (name, numerics, full, adapters, attention, bytes per layer written out by hand)
CASES = [
    # fp32 full: norm saves x and the normed x (2 sbh) twice; the q/k/v input, q, k, v, the attention output and the
    # gate/up input (1 + 1 + 0.5 + 0.5 + 1 + 1 sbh); the MLP's gate, SiLU output, up and product (4 sbI); 4 B each
    ("fp32 full", FP32, True, {}, "sdpa", (9 * SBH + 4 * SBI) * 4 + LSE_AND_RSQRT),
    # pure bf16 full: each norm keeps an fp32 copy (4 B) and the normed bf16 copy (2 B) = 12 B·sbh for two; the linear
    # inputs (2 + 2), q, k, v and the output (2 + 1 + 1 + 2) in bf16 = 22 B·sbh; the MLP 4 x 2 B·sbI
    ("pure bf16 full", PURE_BF16, True, {}, "sdpa", 22 * SBH + 8 * SBI + LSE_AND_RSQRT),
    # amp bf16 full: fp32 residual, so each norm keeps 8 B; q, k and v each cast their fp32 input (3 x 2 B), gate and
    # up theirs (2 x 2 B); the fp32 RoPE output is cast for SDPA (q 2, k 1), v 1, output 2 = 32 B·sbh; and autocast's
    # bf16 copy of every linear weight, saved for the input's gradient
    ("amp bf16 full", AMP_BF16, True, {}, "sdpa", 32 * SBH + 8 * SBI + 2 * LAYER_LINEAR_PARAMS + LSE_AND_RSQRT),
    # LoRA q/v on a pure bf16 base: the norms keep only the fp32 copy (frozen weight: 4 + 4 B); frozen linears keep no
    # input; each adapter keeps its input cast bf16 -> fp32 -> bf16 (2 B·sbh) and its rank-4 output (b·s·4 x 2 B),
    # and autocast's bf16 copies of its fp32 A and B (4 x (in + out) x 2 B); attention 6 B·sbh; SiLU's input, its
    # output and up (3 x 2 B·sbI); the product goes into a frozen down_proj: not kept
    ("LoRA q,v pure bf16", PURE_BF16, False, QV, "sdpa",
     (4 + 2 + 2 + 6 + 4) * SBH + 6 * SBI + 2 * (32 * 4 * 2) + 4 * (128 + 96) * 2 + LSE_AND_RSQRT),
    # eager attention (pure bf16 full): q and k, v repeated to all 4 heads (2 + 2 + 2 B·sbh), the fp32 softmax and its
    # bf16 copy (b·a·s·s x (4 + 2) B), the attention output copy the trained o_proj keeps (2 B·sbh); no log-sum-exp
    ("pure bf16 full eager", PURE_BF16, True, {}, "eager",
     (12 + 2 + 2 + 2 + 2 + 2 + 2) * SBH + 8 * SBI + 2 * 4 * 16 * 16 * 6 + 2 * (2 * 16 * 4)),
]


@pytest.mark.parametrize("name,num,full,adapters,attention,expected", CASES, ids=[c[0] for c in CASES])
def test_one_layer_saves_what_the_code_saves(name, num, full, adapters, attention, expected):
    saved = decoder_layer(DIMS, num, full=full, adapters=adapters, attention=attention, input_grad=True)
    assert saved.total == expected


def _layer_difference(spec_kw: dict) -> int:
    """Traced: the forward phase's activations of the 2-layer model minus the 1-layer one's (one middle layer)."""
    from transformers import LlamaConfig

    from core.plan.tracer import trace_plan

    spec = RunSpec.build(batch_size=2, seq_len=16, devices="cpu", **{"padding": "packed", **spec_kw})
    acts = []
    for layers in (1, 2):
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        acts.append(trace_plan(spec, config, target="cuda").phases["forward"]["activations"])
    return acts[1] - acts[0]


@pytest.mark.parametrize("name,spec_kw", [
    ("fp32 full", dict(mode="full", dtype="fp32")),
    ("pure bf16 full", dict(mode="full", dtype="bf16", precision="pure")),
    ("amp bf16 full", dict(mode="full", dtype="bf16", precision="amp")),
    ("LoRA q,v pure bf16", dict(mode="lora", dtype="bf16", precision="pure", lora_r=4)),
    ("pure bf16 full eager", dict(mode="full", dtype="bf16", attn_implementation="eager")),
])
def test_the_traced_layer_is_the_hand_written_one(name, spec_kw):
    expected = next(c[-1] for c in CASES if c[0] == name)
    assert _layer_difference(spec_kw) == expected


def test_a_padded_batch_sends_sdpa_a_mask_it_keeps_per_layer():
    """Padding in the batch: transformers repeats k and v to all 4 heads (2 x 1,024 more elements x 2 B) and SDPA keeps
    the mask, made additive in bf16, b·s·s x 2 B; found when a real Trainer step measured above the unmasked plan."""
    packed = decoder_layer(DIMS, PURE_BF16, full=True, adapters={}, attention="sdpa", input_grad=True).total
    padded = decoder_layer(DIMS, PURE_BF16, full=True, adapters={}, attention="sdpa", input_grad=True,
                           masked=True).total
    assert padded - packed == 2 * 1024 * 2 + 2 * 16 * 16 * 2
    assert padded == _layer_difference(dict(mode="full", dtype="bf16", padding="padded"))
    eager = decoder_layer(DIMS, PURE_BF16, full=True, adapters={}, attention="eager", input_grad=True, masked=True)
    assert eager.total == next(c[-1] for c in CASES if c[0] == "pure bf16 full eager")  # eager masks either way


def test_all_linear_lora_keeps_more_than_full_fine_tuning_pure_bf16():
    """Case P7's claim holds exactly where it should: LoRA on every linear layer keeps each one's input cast for its
    adapter, more than full fine-tuning keeps; on q/v only, the frozen linears keep no input and LoRA keeps less."""
    every = {n: Adapter(4, False) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
    full = decoder_layer(DIMS, PURE_BF16, full=True, adapters={}, attention="sdpa", input_grad=True).total
    all_linear = decoder_layer(DIMS, PURE_BF16, full=False, adapters=every, attention="sdpa", input_grad=True).total
    qv = decoder_layer(DIMS, PURE_BF16, full=False, adapters=QV, attention="sdpa", input_grad=True).total
    assert qv < full < all_linear
    assert all_linear == _layer_difference(dict(mode="lora", dtype="bf16", lora_r=4, lora_targets="all-linear"))


def test_the_first_lora_layer_keeps_less_without_checkpointing():
    """The embedding is frozen in LoRA: the first layer's input needs no gradient, so its first norm and the frozen
    linears before the first adapter keep nothing; with checkpointing peft makes the input need one."""
    first = decoder_layer(DIMS, PURE_BF16, full=False, adapters=QV, attention="sdpa", input_grad=False).total
    steady = decoder_layer(DIMS, PURE_BF16, full=False, adapters=QV, attention="sdpa", input_grad=True).total
    assert steady - first == 4 * SBH + 2 * 16 * 4  # the first norm's fp32 copy and its rsqrt column


# ---------------------------------------------------------------------------------------------------- phases
TERMS = StepTerms(
    weights=1000, gradients=1000, optimizer_states=2000, step_temporaries=1000, accumulated_gradients=0,
    layers=3000, first_layer=100, head=50, logits_forward=400, logits_saved=160, logits_backward=320, logits_grad=80,
    hidden_grad=10, recompute=0, forward_cache=0, tied_buffer=200, first_gradients=300)


def test_the_phases_hold_what_coexists_and_the_peak_is_the_largest():
    phases = training_phases(TERMS)
    # forward: weights, states, every layer's activations, the head's, the loss (no gradient yet)
    assert phases["forward"].total_bytes == 1000 + 2000 + 3000 + 50 + 400
    # backward: the loss's gradient (3000 + 50 + 160 saved, 320 of fp32 gradients) is larger than the LM head's
    # (3000 + 50 + 80 + 10 + the tied buffer 200), the first layer's (700 gradients + 100 + 10 + 200) and the end
    # (every gradient + twice the tied buffer)
    assert phases["backward"].total_bytes == 1000 + 2000 + 3000 + 50 + 160 + 320
    assert phases["backward"].at == "the loss's gradient, at the start of backward"
    # optimizer step: weights, gradients, states and the step's buffers; activations gone
    assert phases["optimizer_step"].total_bytes == 1000 + 1000 + 2000 + 1000
    assert peak(phases).name == "backward"
    assert phases["optimizer_step"].components["activations"] == 0
    assert phases["forward"].components["gradients"] == 0


def test_gradient_accumulation_and_a_large_step_move_the_peak():
    accumulated = training_phases(StepTerms(**{**TERMS.__dict__, "accumulated_gradients": 1000}))
    assert accumulated["forward"].components["gradients"] == 1000  # the first micro-batch's, held through the second
    assert peak(accumulated).total_bytes == 1000 + 2000 + 1000 + 3000 + 50 + 160 + 320
    big_step = training_phases(StepTerms(**{**TERMS.__dict__, "step_temporaries": 5000}))
    assert peak(big_step).name == "optimizer_step"
    end = training_phases(StepTerms(**{**TERMS.__dict__, "layers": 0, "logits_backward": 0, "logits_saved": 0,
                                       "logits_forward": 0}))["backward"]
    assert end.at == "the end of backward" and end.components["temporaries"] == 2 * 200  # two parts and their sum
