"""What real recipes do to memory (issue 50), each term against what it is derived from, checked here where it runs
on this CPU: torch.compile's partition of a decoder layer, the losses' saved tensors, bitsandbytes' paged states."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from core.losses import LossInput, loss_of


@pytest.fixture(scope="module")
def small_llama():
    """A Llama layer's shapes with no width a multiple of the probe's 37 tokens: h 64, I 160, 4 heads of 16, 2 KV."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=1, vocab_size=128, max_position_embeddings=256)


def test_a_compiled_layer_saves_what_the_min_cut_keeps_per_token(small_llama):
    """Pure bf16 under inductor's partition: the gate and up projections' outputs and the SiLU input's recompute
    source (3 I-wide), the layer input, q, the attention output, o_proj's output and two views (6 h-wide), k and v
    after RoPE (2 KV-wide), the attention's log-sum-exp (fp32 per head) and both RMSNorms' rsqrt (fp32): per token
    (3 I + 6 h + 2 kv) x 2 B + heads x 4 B + 2 x 4 B; nothing that does not grow with the tokens."""
    from core.plan.compiled import compiled_layer_bytes

    h, i, heads, kv = 64, 160, 4, 2 * 16
    layer = compiled_layer_bytes(small_llama, "bf16", None)
    assert layer.per_token == (3 * i + 6 * h + 2 * kv) * 2 + heads * 4 + 2 * 4
    assert (layer.constant, layer.per_token_squared) == (0, 0)
    assert layer.saved_bytes(4, 512) == layer.per_token * 4 * 512


def test_under_autocast_the_weight_copies_are_per_layer_and_a_padding_mask_grows_with_the_square(small_llama):
    """amp (fp32 weights, bf16 autocast): the layer's 7 projections' bf16 copies are saved whatever the batch (they
    were scaled with the tokens before); a padding mask reaching SDPA is b·s·s in the compute dtype."""
    from core.plan.compiled import compiled_layer_bytes

    h, i, kv = 64, 160, 2 * 16
    weights = (2 * h * h + 2 * kv * h + 3 * i * h) * 2  # q, o; k, v; gate, up, down in bf16
    amp = compiled_layer_bytes(small_llama, "fp32", "bf16", masked=True)
    assert amp.constant == weights
    assert amp.per_token_squared == 2  # the bf16 mask (1, 1, s, s) per row
    assert amp.saved_bytes(2, 100) == pytest.approx(weights + amp.per_token * 200 + 2 * 2 * 100 * 100)


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd packs for backward while ``fn`` runs."""
    import torch

    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@dataclass
class _Sizes:
    b: int = 2
    s: int = 24
    h: int = 16
    v: int = 96


@pytest.mark.parametrize("trained", [False, True])
def test_the_standard_loss_keeps_what_transformers_cross_entropy_saves(trained):
    """transformers' ForCausalLMLoss over bf16 logits: autograd keeps the fp32 log_softmax (N·V·4), and the LM head's
    input only when its weight is trained (frozen: the linear saves its weight alone)."""
    import torch
    from transformers.loss.loss_utils import ForCausalLMLoss

    z = _Sizes()
    hidden = torch.randn(z.b, z.s, z.h, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(z.v, z.h, dtype=torch.bfloat16, requires_grad=trained)
    labels = torch.randint(0, z.v, (z.b, z.s))

    def step():
        logits = torch.nn.functional.linear(hidden * 1, weight)  # * 1: the head's input, not a leaf
        ForCausalLMLoss(logits, labels, vocab_size=z.v)

    n = z.b * z.s
    terms = loss_of("standard").terms(LossInput(tokens=n, rows=z.b, vocab=z.v, hidden=z.h, logit_bytes=2,
                                                head_bytes=2, head_trained=trained))
    head_input = n * z.h * 2 if trained else 0
    measured = _saved_bytes(step) - z.v * z.h * 2  # the head's weight is a parameter, counted with the weights
    # transformers pads the labels by one and shifts them (every position's log_softmax kept); nll_loss also keeps
    # the int64 targets and a scalar total weight, which the term leaves out (8 B a token)
    assert measured == terms.saved + n * 8 + 4 + head_input


@pytest.mark.parametrize("trained", [False, True])
def test_torchtunes_linear_cross_entropy_keeps_the_rows_hidden_only_for_a_trained_head(trained):
    """A chunk's projection inside the loss (torchtune's LinearCrossEntropyLoss) saves its input only when the head's
    weight is trained: the term counts b·s·h x c then, and nothing for a frozen head (under LoRA)."""
    import torch

    z = _Sizes()
    rows = torch.randn(z.b * z.s, z.h, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(z.v, z.h, dtype=torch.bfloat16, requires_grad=trained)

    def step():
        for chunk in (rows * 1).chunk(4):
            torch.nn.functional.linear(chunk, weight).float().log_softmax(-1)

    n = z.b * z.s
    base = LossInput(tokens=n, rows=z.b, vocab=z.v, hidden=z.h, logit_bytes=2, head_bytes=2, head_trained=trained,
                     chunks=4)
    terms = loss_of("linear_chunked").terms(base)
    assert _saved_bytes(step) - z.v * z.h * 2 == terms.saved


def test_litgpts_chunked_head_holds_fp32_logits_under_bf16_mixed():
    """LitGPT's loop keeps every chunk's logits and their log_softmax: 2 B each under bf16-true, 4 B each under
    bf16-mixed (Fabric converts the outputs to fp32)."""
    pure = loss_of("litgpt_chunked").terms(LossInput(tokens=1024, rows=2, vocab=1000, hidden=64, logit_bytes=2,
                                                     head_bytes=2, head_trained=False))
    mixed = loss_of("litgpt_chunked").terms(LossInput(tokens=1024, rows=2, vocab=1000, hidden=64, logit_bytes=2,
                                                      head_bytes=4, head_trained=False, autocast=True))
    assert (pure.saved, mixed.saved) == (1024 * 1000 * 2 * 2, 1024 * 1000 * 2 * 4)


@dataclass(frozen=True)
class _P:
    numel: int
    dtype: str = "bf16"
    kind: str = "linear"

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.numel,)


def test_paged_states_keep_the_tensor_being_stepped_on_the_device():
    """bitsandbytes pages the moments of a parameter of 100,000 elements or more and prefetches one tensor's before
    its update: the largest one's are planned on the device, the rest off it; small tensors are ordinary tensors;
    the 8-bit absmax stays on the device."""
    from core.optim import optimizer_of

    params = [_P(50_000), _P(200_000), _P(1_000_000)]
    paged32 = optimizer_of("paged_adamw_32bit")
    total, _ = paged32.state_bytes(params)
    off, words = paged32.pageable_bytes(params)
    assert total == 8 * 1_250_000 and off == 8 * 200_000  # 1M's moments resident, 50k unpaged
    assert "prefetched before its update" in words
    assert paged32.pageable_bytes(params, "cpu")[0] == 0  # bitsandbytes falls back to unpaged states on the CPU
    paged8 = optimizer_of("paged_adamw_8bit")
    assert paged8.pageable_bytes(params)[0] == 2 * 200_000  # uint8 moments only
    assert optimizer_of("adamw_8bit").pageable_bytes(params)[0] == 0


def test_dpo_plans_its_reference_and_the_chosen_and_rejected_rows():
    """DPO in full fine-tuning holds a frozen copy of the model (in reference_dtype when given); under LoRA the
    reference is the base with its adapters disabled (no copy); the policy's rows are the pairs' two sequences."""
    from core.models import load_config, resolve_model
    from core.plan.devices import DeviceInfo
    from core.plan.memory import plan_memory
    from core.spec import RunSpec

    device = DeviceInfo("cuda:0", "cuda", "test GPU", 80 * 2**30, "test")

    def plan(**settings):
        spec = RunSpec.build(batch_size=2, seq_len=128, dtype="bf16", **settings)  # the embedded SmolLM2-135M
        return spec, plan_memory(spec, load_config(resolve_model(spec.model)), [device])

    sft, sft_plan = plan(mode="full")
    dpo, dpo_plan = plan(mode="full", objective="dpo")
    fp32_ref, fp32_plan = plan(mode="full", objective="dpo", reference_dtype="fp32")
    lora, lora_plan = plan(mode="lora", objective="dpo")
    lora_sft, lora_sft_plan = plan(mode="lora")
    total = sft_plan.parameters.total
    weights = {name: p.devices[0].lines["weights"].bytes for name, p in (
        ("sft", sft_plan), ("dpo", dpo_plan), ("fp32", fp32_plan), ("lora", lora_plan), ("lora_sft", lora_sft_plan))}
    assert weights["dpo"] - weights["sft"] == total * 2  # a bf16 copy of every parameter
    assert weights["fp32"] - weights["sft"] == total * 4
    assert weights["lora"] == weights["lora_sft"]  # adapters disabled: no second copy
    assert (dpo.reference_source, lora.reference_source) == ("copy", "adapters")
    assert (dpo.policy_rows, sft.policy_rows) == (4, 2)
    # the plan's recipe line (gpuaccept plan, the wizard's Plan screen) names the objective and its reference
    assert dpo.recipe_text().startswith("objective DPO (preference), reference a frozen copy of the model, loss ")
    assert lora.recipe_text().startswith("objective DPO (preference), reference the model with its adapters disabled")
    assert (dpo.beyond_own_recipe(), sft.beyond_own_recipe()) == (("objective", "a preference objective (DPO "
                                                                   "(preference))"), None)
