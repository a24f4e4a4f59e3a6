"""Held-out evaluation: token-weighted perplexity of a causal language model.

The metric (``shared/cases/eval.md``)::

    perplexity = exp( sum over every target token of -ln p(token | tokens before it)  /  number of target tokens )

- token-weighted over the whole held-out split (case E1), never the mean of per-batch means;
- targets are masked by the attention mask, i.e. by position, never by token id (case E4: pad = eos is common);
- log-probabilities in fp32 whatever the model's dtype; NLL in nats.

The second metric, next-token accuracy, counts the same targets: a target is correct when it is the argmax of the
logits that predict it (ties go to the lowest token id, as ``torch.argmax`` breaks them)::

    accuracy = (targets equal to the argmax of their logits) / number of target tokens

torch is imported inside the functions so that importing this module stays cheap.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from core.errors import DataError
from core.protocol.events import METRIC


def masked_token_nll(logits: Any, input_ids: Any, attention_mask: Any) -> tuple[float, int]:
    """Summed negative log-likelihood of the real next-token targets of a batch.

    Position t predicts token t+1. A target counts iff ``attention_mask`` is 1 at the target and at the position that
    predicts it (with right padding, as :func:`core.data.make_blocks` produces, that is: the target is not padding).
    Token ids are never used to mask, so a real eos target counts even when pad = eos (case E4).

    Args:
        logits: ``(batch, seq, vocab)`` tensor, any float dtype (log-softmax is taken in fp32).
        input_ids: ``(batch, seq)`` integer tensor.
        attention_mask: ``(batch, seq)`` tensor of 1 (real token) and 0 (padding).

    Returns:
        ``(sum of -ln p over counted targets in nats, number of counted targets)``.
    """
    import torch.nn.functional as F

    if logits.dim() != 3 or input_ids.shape != logits.shape[:2] or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"expected logits (batch, seq, vocab) and input_ids / attention_mask (batch, seq); got "
            f"{tuple(logits.shape)}, {tuple(input_ids.shape)}, {tuple(attention_mask.shape)}"
        )
    input_ids = input_ids.to(logits.device)
    real = attention_mask.to(logits.device).bool()
    counted = real[:, 1:] & real[:, :-1]
    n_targets = int(counted.sum().item())
    if n_targets == 0:
        return 0.0, 0
    # Select first, then upcast: only the counted rows are materialised in fp32.
    predicting = logits[:, :-1][counted].float()
    targets = input_ids[:, 1:][counted].long()
    nll = F.cross_entropy(predicting, targets, reduction="sum")  # fp32 log-softmax + gather
    return float(nll.item()), n_targets


def masked_token_correct(logits: Any, input_ids: Any, attention_mask: Any) -> int:
    """How many of the targets :func:`masked_token_nll` counts are the argmax of the logits that predict them.

    Args: as :func:`masked_token_nll` (the same shapes; ``ValueError`` on others).

    Returns:
        the number of correctly predicted targets, an int in [0, the targets counted].
    """
    if logits.dim() != 3 or input_ids.shape != logits.shape[:2] or attention_mask.shape != input_ids.shape:
        raise ValueError(f"expected logits (batch, seq, vocab) and input_ids / attention_mask (batch, seq); got "
                         f"{tuple(logits.shape)}, {tuple(input_ids.shape)}, {tuple(attention_mask.shape)}")
    real = attention_mask.to(logits.device).bool()
    counted = real[:, 1:] & real[:, :-1]
    predicted = logits[:, :-1].argmax(dim=-1)
    return int((predicted == input_ids.to(logits.device)[:, 1:])[counted].sum().item())


def perplexity(nll_sum: float, tokens: int) -> float:
    """Token-weighted perplexity ``exp(nll_sum / tokens)`` (case E1).

    Args:
        nll_sum: summed NLL in nats over all target tokens (every batch).
        tokens: number of target tokens (every batch).

    Returns:
        The perplexity; ``inf`` when the mean NLL is too large for a float.

    Raises:
        ValueError: ``tokens`` is not positive.
    """
    if tokens <= 0:
        raise ValueError(f"perplexity needs at least one target token (got {tokens})")
    try:
        return math.exp(nll_sum / tokens)
    except OverflowError:
        return math.inf


@dataclass(frozen=True)
class EvalResult:
    """One held-out evaluation.

    Attributes:
        perplexity: ``exp(mean_nll)``.
        mean_nll: ``nll_sum / tokens``, nats per target token.
        nll_sum: summed NLL in nats.
        tokens: number of target tokens counted.
        blocks: number of blocks evaluated.
        seconds: wall-clock seconds of the evaluation loop.
        correct: targets that are the argmax of their logits (next-token accuracy = correct / tokens).
        metric: the metric, in words (:data:`core.protocol.events.METRIC`).
    """

    perplexity: float
    mean_nll: float
    nll_sum: float
    tokens: int
    blocks: int
    seconds: float
    correct: int = 0
    metric: str = METRIC

    @property
    def accuracy(self) -> float:
        """Next-token accuracy: ``correct / tokens``, a share in [0, 1]."""
        return self.correct / self.tokens


def evaluate_perplexity(model: Any, blocks: Sequence[dict[str, Any]], batch_size: int, device: Any = "cpu",
                        autocast: str | None = None,
                        on_batch: Callable[[int, int], None] | None = None) -> EvalResult:
    """Token-weighted perplexity of ``model`` over ``blocks``.

    The model runs in eval mode under ``torch.inference_mode()`` with ``input_ids`` and ``attention_mask`` only (no
    labels: the loss is computed here, see :func:`masked_token_nll`); its previous training flag is restored afterwards,
    also on error. With ``autocast`` (a dtype name, ``bf16`` / ``fp16``) the forward runs under ``torch.autocast`` as
    the training step does, before training and after it alike (Trainer leaves the model's forward wrapped in
    autocast after training; doing it explicitly keeps both evaluations on the same numerics).

    Args:
        model: a causal LM whose output has ``.logits`` (batch, seq, vocab), already on ``device``.
        blocks: dicts with ``input_ids`` and ``attention_mask`` of equal length (:func:`core.data.make_blocks`).
        batch_size: blocks per forward pass (the last batch may be smaller).
        device: where the inputs go (the model's first device).
        on_batch: called after each forward pass with (blocks evaluated, blocks in all).

    Raises:
        DataError: no blocks, or blocks of different lengths.
        ValueError: ``batch_size`` below 1, or no target token at all.
    """
    import torch

    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1 (got {batch_size})")
    if not blocks:
        raise DataError("no held-out blocks to evaluate; give more text or raise heldout_fraction")
    lengths = {len(block["input_ids"]) for block in blocks}
    if len(lengths) != 1:
        raise DataError(f"held-out blocks have different lengths {sorted(lengths)}; cut them with make_blocks")

    from core.dtypes import TORCH_DTYPE_NAMES

    was_training = model.training
    nll_sum, tokens, correct = 0.0, 0, 0
    start = time.perf_counter()
    model.eval()
    device_type = "cuda" if str(device).startswith("cuda") else "cpu"
    cast = getattr(torch, TORCH_DTYPE_NAMES[autocast]) if autocast else None
    try:
        if on_batch is not None:
            on_batch(0, len(blocks))  # the count from the start, even for an evaluation of one forward pass
        with torch.inference_mode(), torch.autocast(device_type, dtype=cast, enabled=cast is not None):
            for first in range(0, len(blocks), batch_size):
                batch = blocks[first : first + batch_size]
                input_ids = torch.tensor([b["input_ids"] for b in batch], dtype=torch.long, device=device)
                attention_mask = torch.tensor([b["attention_mask"] for b in batch], dtype=torch.long, device=device)
                logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
                batch_nll, batch_tokens = masked_token_nll(logits, input_ids, attention_mask)
                nll_sum += batch_nll
                tokens += batch_tokens
                correct += masked_token_correct(logits, input_ids, attention_mask)
                if on_batch is not None:
                    on_batch(min(first + batch_size, len(blocks)), len(blocks))
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - start
    if tokens == 0:
        raise ValueError("the blocks hold no target token (every block is padding or a single token)")
    return EvalResult(
        perplexity=perplexity(nll_sum, tokens),
        mean_nll=nll_sum / tokens,
        nll_sum=nll_sum,
        tokens=tokens,
        blocks=len(blocks),
        seconds=seconds,
        correct=correct,
    )


def evaluation_event(when: str, result: EvalResult) -> Any:
    """The ``evaluation`` event (:class:`core.protocol.events.Evaluation`) of ``result``, ``when`` "before" / "after"."""
    from core.protocol.events import Evaluation

    return Evaluation(when=when, perplexity=result.perplexity, mean_nll=result.mean_nll, nll_sum=result.nll_sum,
                      tokens=result.tokens, blocks=result.blocks, seconds=result.seconds, metric=result.metric,
                      correct=result.correct)
