"""core.child.evaluate: token-weighted perplexity (case E1), masking by position (case E4), a real tiny Llama."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from core.child.evaluate import EvalResult, evaluate_perplexity, masked_token_nll, perplexity
from core.data import Document, make_blocks
from core.protocol.events import METRIC

V = 32  # vocabulary of the constructed examples


def logits_row(target: int, nll: float, vocab: int = V) -> torch.Tensor:
    """Logits over ``vocab`` tokens giving ``-ln p(target) == nll`` exactly (up to float rounding).

    All other logits are 0 and the target's is a, so p = e^a / (e^a + vocab - 1); solving for a gives
    a = ln(p (vocab - 1) / (1 - p)) with p = e^-nll.
    """
    p = math.exp(-nll)
    row = torch.zeros(vocab, dtype=torch.float64)
    row[target] = math.log(p * (vocab - 1) / (1 - p))
    return row


def test_logits_row_gives_the_asked_nll():
    row = logits_row(5, 2.0)
    assert -torch.log_softmax(row, -1)[5].item() == pytest.approx(2.0, abs=1e-12)


# ---------------------------------------------------------------------------------------------------------- E1
def test_e1_perplexity_is_token_weighted_not_a_mean_of_batch_means():
    assert perplexity(28.0, 12) == pytest.approx(math.exp(28 / 12))
    assert perplexity(28.0, 12) == pytest.approx(10.312, abs=1e-3)
    mean_of_means = math.exp((20.0 / 10 + 8.0 / 2) / 2)
    assert mean_of_means == pytest.approx(20.09, abs=1e-2)
    assert perplexity(28.0, 12) != pytest.approx(mean_of_means, rel=0.1)


def test_perplexity_rejects_zero_tokens_and_overflows_to_inf():
    with pytest.raises(ValueError):
        perplexity(0.0, 0)
    assert perplexity(1e6, 1) == math.inf


def _batch(seq: list[int], real: int, nll_per_target: float, pad_nll: float = 30.0):
    """One sequence whose first ``real`` positions are real; every real target has NLL ``nll_per_target``.

    The padded positions get logits with NLL ``pad_nll`` per target so that counting them would show.
    """
    rows = []
    for t in range(len(seq) - 1):
        rows.append(logits_row(seq[t + 1], nll_per_target if t + 1 < real else pad_nll))
    rows.append(torch.zeros(V, dtype=torch.float64))  # the last position predicts nothing
    logits = torch.stack(rows).unsqueeze(0).float()
    input_ids = torch.tensor([seq])
    attention_mask = torch.tensor([[1] * real + [0] * (len(seq) - real)])
    return logits, input_ids, attention_mask


def test_e1_masked_nll_of_the_two_batches_of_the_case():
    # batch A: 11 real tokens -> 10 targets of NLL 2.0 (sum 20.0); batch B: 3 real tokens -> 2 targets of NLL 4.0 (sum 8.0)
    a = _batch(list(range(1, 12)), real=11, nll_per_target=2.0)
    b = _batch([3, 4, 5, 0, 0, 0, 0, 0, 0, 0, 0], real=3, nll_per_target=4.0)
    nll_a, n_a = masked_token_nll(*a)
    nll_b, n_b = masked_token_nll(*b)
    assert (n_a, n_b) == (10, 2)
    assert nll_a == pytest.approx(20.0, rel=1e-5)
    assert nll_b == pytest.approx(8.0, rel=1e-5)
    assert perplexity(nll_a + nll_b, n_a + n_b) == pytest.approx(10.31, abs=1e-2)


class TableLM(torch.nn.Module):
    """A fake causal LM: the logits at position t are a fixed row chosen by the token at t (a bigram table)."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.register_buffer("table", table)

    def forward(self, input_ids, attention_mask):
        assert not torch.is_grad_enabled() and not self.training
        return SimpleNamespace(logits=self.table[input_ids])


def test_e1_evaluate_perplexity_end_to_end_over_two_uneven_batches():
    # tokens 1..11 follow each other with NLL 2.0; tokens 20 -> 21 -> 22 with NLL 4.0; token 0 is padding
    table = torch.zeros(V, V)
    for token in range(1, 11):
        table[token] = logits_row(token + 1, 2.0).float()
    for token in (20, 21):
        table[token] = logits_row(token + 1, 4.0).float()
    blocks = [
        {"sample_id": 0, "input_ids": list(range(1, 12)), "attention_mask": [1] * 11},
        {"sample_id": 1, "input_ids": [20, 21, 22] + [0] * 8, "attention_mask": [1] * 3 + [0] * 8},
    ]
    model = TableLM(table)
    model.train()
    for batch_size in (1, 2):
        result = evaluate_perplexity(model, blocks, batch_size=batch_size)
        assert isinstance(result, EvalResult)
        assert (result.tokens, result.blocks) == (12, 2)
        assert result.nll_sum == pytest.approx(28.0, rel=1e-5)
        assert result.mean_nll == pytest.approx(28.0 / 12, rel=1e-5)
        assert result.perplexity == pytest.approx(10.312, abs=1e-3)
        assert result.metric == METRIC
        assert result.seconds >= 0
        assert model.training  # the training flag is restored


# ---------------------------------------------------------------------------------------------------------- E4
def test_e4_real_eos_target_counts_and_padding_does_not_when_pad_is_eos():
    eos = pad = 0
    torch.manual_seed(0)
    logits = torch.randn(1, 5, V)
    input_ids = torch.tensor([[5, 6, eos, pad, pad]])
    attention_mask = torch.tensor([[1, 1, 1, 0, 0]])

    nll, tokens = masked_token_nll(logits, input_ids, attention_mask)

    log_p = torch.log_softmax(logits[0].double(), dim=-1)
    manual = -(log_p[0, 6] + log_p[1, eos]).item()  # targets: 6 (from position 0) and the real eos (from position 1)
    assert tokens == 2  # masking by token id would count 1 (it drops the real eos)
    assert nll == pytest.approx(manual, rel=1e-6)


def test_masked_nll_uses_fp32_log_softmax_for_half_precision_logits():
    torch.manual_seed(1)
    logits = (torch.randn(2, 6, V) * 8).to(torch.bfloat16)
    input_ids = torch.randint(0, V, (2, 6))
    attention_mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    nll, tokens = masked_token_nll(logits, input_ids, attention_mask)
    mask = attention_mask[:, 1:].bool()
    manual = F.cross_entropy(logits[:, :-1][mask].double(), input_ids[:, 1:][mask], reduction="sum").item()
    assert tokens == 8
    assert nll == pytest.approx(manual, rel=1e-6)


# ---------------------------------------------------------------------------------------------------------- real model
class CharTokenizer:
    """ids 3..62 from characters; eos 1, pad 0 (a separate pad id)."""

    eos_token_id = 1
    pad_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [3 + ord(ch) % 60 for ch in text]}


def test_evaluate_perplexity_on_a_tiny_llama_matches_cross_entropy_by_hand():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    docs = [Document("a", "the quick brown fox"), Document("b", "jumps over the lazy dog"), Document("c", "again and again")]
    blocks = make_blocks(docs, CharTokenizer(), seq_len=16)
    assert len(blocks) == 4 and 0 in blocks[-1]["attention_mask"]  # 3 full blocks and a padded one

    model.train()
    result = evaluate_perplexity(model, blocks, batch_size=3)  # batches of 3 and 1
    assert model.training

    model.eval()
    input_ids = torch.tensor([b["input_ids"] for b in blocks])
    attention_mask = torch.tensor([b["attention_mask"] for b in blocks])
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    mask = attention_mask[:, 1:].bool()
    mean_ce = F.cross_entropy(logits[:, :-1][mask].float(), input_ids[:, 1:][mask])
    assert result.tokens == int(mask.sum()) == sum(sum(b["attention_mask"]) - 1 for b in blocks)
    assert result.blocks == 4
    assert result.mean_nll == pytest.approx(mean_ce.item(), rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(mean_ce.item()), rel=1e-5)
    assert 40 < result.perplexity < 90  # a random model over 64 tokens is near-uniform: about 64


def test_evaluate_perplexity_rejects_no_blocks():
    from core.errors import DataError

    with pytest.raises(DataError):
        evaluate_perplexity(TableLM(torch.zeros(V, V)), [], batch_size=2)
