"""How the loss turns the last hidden state into a loss: the plain cross-entropy over full logits, or one of the
chunked and fused forms real recipes use to save memory. One object per form (:class:`Loss`), holding its memory
terms, derived from the library's code and measured on this CPU against the libraries' own code
(docs/losses.md, which cites each line), and the names each trainer gives it. Code outside this module asks the loss
(``spec.loss_kind``).

Notation: N tokens through the policy in one micro-batch (b·s, every row of a preference pair counted), V the
vocabulary, h the hidden size, c the bytes of the logits' dtype (the compute dtype), n chunks, C rows of a chunk.

Each form gives four terms (:class:`LossTerms`): what is alive at the loss's peak at the end of the forward, what is
kept for backward, what the start of backward adds, and the logits' gradient alive when the LM head's backward runs.
Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

FP32 = 4
#: TRL's chunked NLL: rows of valid tokens per checkpointed chunk (``_CHUNKED_LM_HEAD_CHUNK_SIZE``, sft_trainer.py)
TRL_CHUNK = 256
#: LitGPT's finetune scripts: ``model(input_ids, lm_head_chunk_size=128)`` and ``chunked_cross_entropy(chunk_size=128)``
LITGPT_CHUNK = 128


@dataclass(frozen=True)
class LossInput:
    """The sizes a loss's terms are made of.

    Attributes:
        tokens: N, tokens through the policy with gradients in one micro-batch.
        rows: the micro-batch's sequences (a chunk split along the sequence copies when rows > 1).
        vocab: V. hidden: h.
        logit_bytes: c, bytes of the logits' dtype (the compute dtype).
        head_bytes: bytes per element of the LM head's weight as stored (a ``w.float()`` copy is 4 B per element).
        head_trained: the LM head's weight is trained (full fine-tuning, a LoRA ``modules_to_save`` head).
        chunks: n, the chunks of a chunked loss (torchtune's ``num_output_chunks``).
        compiled: the loss runs compiled (torchtune's ``compile: True`` compiles each chunk's cross-entropy).
        autocast: the step runs under autocast (mixed precision: LitGPT's ``bf16-mixed`` returns fp32 outputs).
    """

    tokens: int
    rows: int
    vocab: int
    hidden: int
    logit_bytes: int
    head_bytes: int
    head_trained: bool
    chunks: int = 8
    compiled: bool = False
    autocast: bool = False


@dataclass(frozen=True)
class LossTerms:
    """The loss's memory terms (bytes): ``forward`` alive at its peak at the end of the forward (``saved``
    included), ``saved`` kept for backward, ``backward`` added at the start of backward, ``grad`` the logits' gradient
    when the LM head's backward runs; ``text`` the formula with its numbers."""

    forward: int
    saved: int
    backward: int
    grad: int
    text: str


@dataclass(frozen=True)
class Loss:
    """One form of the loss.

    Attributes:
        name: the spec's ``loss`` value. label: in a few words. summary: what it does to memory.
        terms: its :class:`LossTerms` for a :class:`LossInput`.
        projects: the LM head's projection runs inside the loss (its input is the loss's to keep: the model's head
            saves none).
        chunked: takes the spec's ``loss_chunks``.
        names: the names each tool gives it (torchtune loss classes, TRL ``loss_type``, axolotl keys).
    """

    name: str
    label: str
    summary: str
    terms: Callable[[LossInput], LossTerms]
    projects: bool = False
    chunked: bool = False
    names: dict[str, tuple[str, ...]] = field(default_factory=dict)


def _cdiv(a: int, b: int) -> int:
    return -(-a // max(b, 1))


def _standard(x: LossInput) -> LossTerms:
    """transformers' ``ForCausalLMLoss`` (loss_utils.py): logits N·V·c, ``logits.float()`` N·V·4 (the same tensor in
    fp32), ``log_softmax`` N·V·4 saved; at the start of backward its gradient and the logits' (fp32 each)."""
    n, v, c = x.tokens, x.vocab, x.logit_bytes
    copies = c + (FP32 if c != FP32 else 0) + FP32
    return LossTerms(n * v * copies, n * v * FP32, 2 * n * v * FP32, n * v * c,
                     f"the loss at the end of the forward: logits b·s·V x ({c if c != FP32 else ''}"
                     f"{' + 4' if c != FP32 else '4'} + 4) B (compute dtype, fp32 copy, log_softmax), V={v:,}")


def _chunked(x: LossInput) -> LossTerms:
    """torchtune's ``CEWithChunkedOutputLoss`` (ce_chunked_output_loss.py; ``TransformerDecoder.chunked_output``) and
    axolotl's copy of it: the n chunks of bf16 logits all made, each upcast to fp32 only inside its cross-entropy,
    whose fp32 ``log_softmax`` is kept (N·V·4 in all); at the start of backward one chunk's two fp32 gradients.
    Compiled (torchtune compiles each chunk's cross-entropy): each chunk keeps its bf16 logits and two fp32 values per
    row instead (N·V·c + 8·N)."""
    n, v, c, k = x.tokens, x.vocab, x.logit_bytes, max(x.chunks, 1)
    chunk = _cdiv(n, k)
    copy = n * x.hidden * c if x.head_trained and x.rows > 1 else 0  # non-contiguous chunks copied by the matmul
    if x.compiled:
        saved = n * v * c + 8 * n + copy
        return LossTerms(saved + chunk * v * FP32, saved, chunk * v * (FP32 + c), n * v * c,
                         f"chunked cross-entropy, compiled ({k} chunks): each chunk keeps its logits in the compute "
                         f"dtype and 2 fp32 values per row: b·s·V x {c} B + 8 B x b·s, V={v:,}")
    saved = n * v * FP32 + copy
    return LossTerms(n * v * c + saved + chunk * v * FP32, saved, 2 * chunk * v * FP32, n * v * c,
                     f"chunked cross-entropy ({k} chunks): the logits b·s·V x {c} B made, each chunk's fp32 copy in "
                     f"turn, every chunk's fp32 log_softmax kept (b·s·V x 4 B); at the start of backward one chunk's "
                     f"2 fp32 gradients, V={v:,}")


def _linear_chunked(x: LossInput) -> LossTerms:
    """torchtune's ``LinearCrossEntropyLoss`` (cross_entropy_loss.py): the projection runs per chunk of the labelled
    rows inside the loss; each chunk's fp32 ``log_softmax`` kept; the rows' hidden copy kept when the head is trained.
    Planned with every token labelled (fewer labelled tokens keep less: an upper bound). Compiled: each chunk keeps
    its logits in the compute dtype and 2 fp32 values per row."""
    n, v, c, h, k = x.tokens, x.vocab, x.logit_bytes, x.hidden, max(x.chunks, 1)
    chunk = _cdiv(n, k)
    hidden = n * h * c if x.head_trained else 0  # a frozen head's linear saves its weight, not its input
    per_logit = c if x.compiled else FP32
    saved = n * v * per_logit + hidden + (8 * n if x.compiled else 0)
    how = "compiled: logits in the compute dtype" if x.compiled else "fp32 log_softmax"
    return LossTerms(saved + chunk * v * (c + FP32), saved, 2 * chunk * v * FP32, chunk * v * c,
                     f"linear cross-entropy ({k} chunks of the labelled rows, the projection inside the loss; every "
                     f"token planned as labelled): kept b·s·V x {per_logit} B ({how}) + the rows' hidden b·s·h x {c} B; "
                     f"one chunk's logits and their fp32 copy at a time, V={v:,}")


def _chunked_nll(x: LossInput) -> LossTerms:
    """TRL's ``chunked_nll`` (the ``SFTConfig.loss_type`` default since TRL 1.7; sft_trainer.py
    ``_chunked_cross_entropy_loss``): the hidden states reordered (a copy, N·h·c) and chunks of 256 valid rows, each
    under activation checkpointing: ``h.float() @ w.float().t()`` makes an fp32 copy of the whole LM head (V·h·4,
    none when the head is fp32) and the chunk's fp32 logits, log_softmax, exp and their product; nothing of N·V is
    kept. Backward recomputes each chunk (the fp32 head copy again); a trained head adds its fp32 gradient beside it."""
    n, v, h, c = x.tokens, x.vocab, x.hidden, x.logit_bytes
    saved = n * h * c + 16 * n
    head_copy = v * h * FP32 if x.head_bytes != FP32 else 0
    chunk = min(TRL_CHUNK, n)
    forward = saved + max(head_copy + chunk * v * FP32 + chunk * h * FP32, 4 * chunk * v * FP32)
    backward = head_copy + (v * h * FP32 + 3 * chunk * v * FP32 if x.head_trained else 4 * chunk * v * FP32)
    return LossTerms(forward, saved, backward, 0,
                     f"TRL's chunked NLL ({TRL_CHUNK} rows a chunk, checkpointed): kept the reordered hidden b·s·h x "
                     f"{c} B + 16 B a token; each chunk makes an fp32 copy of the LM head (V·h x 4 B = {head_copy:,} B) "
                     f"and its fp32 logits; no b·s·V term, V={v:,}")


def _fused_linear(x: LossInput) -> LossTerms:
    """Liger's fused linear cross-entropy (``LigerFusedLinearCrossEntropyFunction``): the gradients of the input
    (N·h, the input's dtype) and of the LM head (V·h, the weight's dtype, when trained) are computed in the forward and
    kept; per chunk of ``next_pow2(ceil(N / ceil(V/h)))`` rows the logits (the compute dtype) and, with 16-bit weights,
    the weight gradient's chunk product and its fp32 copy (V·h·(c + 4)). The backward adds nothing."""
    n, v, h, c = x.tokens, x.vocab, x.hidden, x.logit_bytes
    inc = _cdiv(v, h)
    rows = 1 << max(0, (_cdiv(n, inc) - 1).bit_length())
    weight_grad = v * h * x.head_bytes if x.head_trained else 0
    saved = n * h * c + weight_grad
    product = v * h * (c + FP32) if x.head_trained and x.head_bytes != FP32 else 0
    return LossTerms(saved + product + min(rows, n) * v * c, saved, 0, 0,
                     f"Liger's fused linear cross-entropy: no logits kept; the input's gradient b·s·h x {c} B"
                     + (f" and the LM head's V·h x {x.head_bytes} B" if weight_grad else "")
                     + f" made in the forward and kept; chunks of {min(rows, n):,} rows, V={v:,}")


def _cut(x: LossInput) -> LossTerms:
    """Cut Cross-Entropy (apple/ml-cross-entropy ``LinearCrossEntropyFunction``): logits never made; kept the hidden
    (N·h·c), the per-row log-sum-exp and the valid rows (8 B a token) and a V-sized fp32 average; the gradients of the
    hidden and of the head are allocated in backward."""
    n, v, h, c = x.tokens, x.vocab, x.hidden, x.logit_bytes
    saved = n * h * c + 8 * n + v * FP32
    backward = n * h * c + (v * h * x.head_bytes if x.head_trained else 0)
    return LossTerms(saved, saved, backward, 0,
                     f"Cut Cross-Entropy: no logits; kept the hidden b·s·h x {c} B and 8 B a token; the gradients "
                     f"allocated in backward, V={v:,}")


def _litgpt(x: LossInput) -> LossTerms:
    """LitGPT's finetune loop (lora.py ``model(input_ids, lm_head_chunk_size=128)``, ``chunked_cross_entropy``):
    the chunks' logits are held by the loop through backward, each chunk's ``log_softmax`` (in the logits' dtype: bf16
    under ``bf16-true``; fp32 under ``bf16-mixed``, whose Fabric wrapper returns fp32 outputs) kept; no fp32 gradient
    of the whole logits at the start of backward."""
    n, v = x.tokens, x.vocab
    c = FP32 if x.autocast else x.logit_bytes  # Fabric's bf16-mixed converts the outputs to fp32
    chunk = min(LITGPT_CHUNK, n) * max(x.rows, 1)
    saved = 2 * n * v * c
    return LossTerms(saved + chunk * v * FP32, saved, chunk * v * 2 * FP32, n * v * c,
                     f"LitGPT's chunked head and cross-entropy ({LITGPT_CHUNK}-token chunks): the logits held by the "
                     f"loop and their log_softmax kept, b·s·V x 2 x {c} B, V={v:,}")


STANDARD = Loss("standard", "cross-entropy over full logits",
                "transformers' cross-entropy: the logits, their fp32 copy and log_softmax at the end of the forward",
                _standard, names={"torchtune": ("torch.nn.CrossEntropyLoss",), "trl": ("nll", "dft")})
CHUNKED = Loss("chunked", "chunked cross-entropy",
               "the logits made whole, the cross-entropy in n chunks (torchtune's CEWithChunkedOutputLoss)", _chunked,
               chunked=True, names={"torchtune": ("torchtune.modules.loss.CEWithChunkedOutputLoss",)})
LINEAR_CHUNKED = Loss("linear_chunked", "linear cross-entropy (chunked projection)",
                      "the LM head's projection and the cross-entropy per chunk of the labelled rows (torchtune's "
                      "LinearCrossEntropyLoss)", _linear_chunked, projects=True, chunked=True,
                      names={"torchtune": ("torchtune.modules.loss.LinearCrossEntropyLoss",)})
CHUNKED_NLL = Loss("chunked_nll", "TRL chunked NLL",
                   "TRL's chunked_nll: 256-row checkpointed chunks, an fp32 copy of the LM head a chunk",
                   _chunked_nll, projects=True, names={"trl": ("chunked_nll",)})
FUSED_LINEAR = Loss("fused_linear", "Liger fused linear cross-entropy",
                    "Liger's fused linear cross-entropy: the gradients made in the forward, no logits",
                    _fused_linear, projects=True)
CUT = Loss("cut", "Cut Cross-Entropy", "Cut Cross-Entropy: no logits, the gradients allocated in backward", _cut,
           projects=True)
LITGPT = Loss("litgpt_chunked", "LitGPT chunked head",
              "LitGPT's chunked LM head and cross-entropy: logits held by the loop", _litgpt)

#: every form of the loss by its spec name
LOSSES: dict[str, Loss] = {x.name: x for x in (STANDARD, CHUNKED, LINEAR_CHUNKED, CHUNKED_NLL, FUSED_LINEAR, CUT,
                                                LITGPT)}


def loss_names() -> tuple[str, ...]:
    """The spec's ``loss`` values."""
    return tuple(LOSSES)


def loss_of(name: str) -> Loss:
    """The loss named ``name``.

    Raises:
        KeyError: none has it.
    """
    return LOSSES[name]


def named(tool: str, name: str) -> Loss | None:
    """The loss ``tool`` calls ``name`` (a torchtune loss class, a TRL ``loss_type``), or None."""
    return next((x for x in LOSSES.values() if name in x.names.get(tool, ())), None)


__all__ = ["LOSSES", "Loss", "LossInput", "LossTerms", "loss_names", "loss_of", "named"]
