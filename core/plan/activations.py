"""What a training step saves for backward, op by op, for the Llama-family decoder (the plan's activation model).

The analytic plan's activations used to be Korthikanti et al. 2022's 34·s·b·h per layer (a GPT layer in 16 bits). Real
runs differ from it in ways that decide whether a job fits: a Llama layer has a gated MLP and RMSNorms that upcast to
fp32; under autocast every linear layer saves a 16-bit copy of its input, and with an fp32 model (amp) a 16-bit copy of
its weight too; a frozen linear layer saves no input (its weight needs no gradient); LoRA saves a copy of each adapted
layer's input. This module follows the code of transformers' ``LlamaDecoderLayer`` (also Mistral's and Qwen2's) and
torch's rules for what each op saves, tensor by tensor, with shared storages counted once:

- ``LlamaRMSNorm``: ``x.to(fp32)`` is saved by ``pow`` and by the multiplication with ``rsqrt`` (4 B per element,
  plus the ``rsqrt`` column b·s·4 B) when ``x`` needs a gradient; ``weight * normed.to(x.dtype)`` saves the normed
  copy when the weight is trained;
- a linear layer (``addmm``/``mm``) saves its input only when its weight is trained, and its weight only when its input
  needs a gradient; under autocast both are cast to the compute dtype first: a cast weight of a trained fp32
  parameter is cached for the whole forward (``torch.autocast``'s weight cache), a frozen one is cast per call;
- RoPE saves only cos and sin (shared by every layer); SDPA / flash attention saves q, k, v, its output and a fp32
  log-sum-exp per row and head (grouped-query attention: k and v at the KV heads, no ``repeat_kv`` when no mask is
  passed); with padding in the batch a mask reaches SDPA: transformers repeats k and v to every head
  (``use_gqa_in_sdpa`` wants no mask) and SDPA keeps the mask, made additive in the compute dtype, b·s·s per layer;
  eager attention saves q, the repeated k and v, the fp32 softmax and its copy in the compute dtype;
- SiLU saves its input, the gated product saves both factors;
- LoRA (peft's ``Linear``): the input cast to the adapter's fp32 (and by autocast back to the compute dtype) is saved
  by ``lora_A``, ``lora_A``'s rank-r output by ``lora_B``, a 1 B dropout mask when dropout > 0, and under autocast the
  cast adapter weights.

The loss (transformers' ``ForCausalLMLoss``): logits in the compute dtype, an fp32 copy, and ``log_softmax`` (fp32,
saved); at the start of backward its gradient and the logits' gradient (fp32 each).

Checked against the traced plan (torch MemTracker over the model's own code) to the byte on the layers
(tests/unit/test_activations.py) and over the plan-accuracy matrix (benchmarks/plan_accuracy.py). Other architectures use
Korthikanti's formula (:mod:`core.plan.lines`), said so in the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from core.losses import LossTerms
from core.methods.base import AdaptedLinear, AdapterTerms

#: model_type values whose decoder layer is transformers' Llama layer (RMSNorm, RoPE, gated SiLU MLP); Mistral and
#: Qwen2 are written from it ("modular" files) with the same forward.
LLAMA_FAMILY = ("llama", "mistral", "qwen2")
FP32 = 4
MASK_BYTES = 1  # a bool dropout mask element


@dataclass(frozen=True)
class Dims:
    """Sizes of one micro-batch through the model: batch b, sequence s, hidden h, MLP width, heads, KV heads, head
    dimension, vocabulary V, layers L, tied embeddings."""

    b: int
    s: int
    h: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int
    tied: bool

    @property
    def tokens(self) -> int:
        return self.b * self.s


@dataclass(frozen=True)
class Numerics:
    """How the step computes.

    Attributes:
        param_bytes: bytes per element of the base parameters (fp32 under amp; the dtype under pure).
        compute_bytes: bytes of the compute dtype (the autocast dtype; the parameter dtype without autocast).
        autocast: the step runs under ``torch.autocast``.
        quantised_base: QLoRA, the decoder's linear layers are bitsandbytes' ``Linear4bit``: the input cast to the
            compute dtype, the weight dequantised inside the op (nothing saved but the packed weight), the output
            cast back to the input's dtype (``bitsandbytes/nn/modules.py``); autocast never sees a base weight.
        keeps_quantised_input: bitsandbytes before 0.43.2: each 4-bit layer keeps its input (in the compute dtype)
            for backward whenever it needs a gradient (core/methods/lora.py :func:`keeps_4bit_input`).
    """

    param_bytes: int
    compute_bytes: int
    autocast: bool
    quantised_base: bool = False
    keeps_quantised_input: bool = False

    @property
    def residual_bytes(self) -> int:
        """The hidden states between layers: the embedding's dtype (the parameters'); under amp fp32, since an fp32
        residual plus a 16-bit branch promotes to fp32."""
        return self.param_bytes

    @property
    def cast_weights(self) -> bool:
        """Autocast casts the base weights (they are fp32 and the compute dtype is 16-bit): amp, not a 4-bit base."""
        return self.autocast and self.param_bytes != self.compute_bytes and not self.quantised_base


@dataclass(frozen=True)
class Adapter:
    """LoRA on one linear layer: rank r, dropout > 0, and the bytes per element dropout saves: on CUDA a bool mask
    (``native_dropout``, 1 B), on the CPU the scaled noise in the input's dtype (``input * noise``, 4 B for peft's fp32
    input); ``terms``: a LoRA variant's own terms (core/methods/base.py ``AdapterTerms``: DoRA's), else None."""

    r: int
    dropout: bool
    mask_bytes: int = MASK_BYTES
    terms: AdapterTerms | None = None
    nbytes: int = FP32  # the adapters' dtype: fp32 (peft's default) or the base's


@dataclass
class _T:
    """A symbolic tensor: a storage key, elements, bytes per element, needs a gradient."""

    key: str
    numel: int
    nbytes: int
    grad: bool

    @property
    def bytes(self) -> int:
        return self.numel * self.nbytes


@dataclass
class Saved:
    """Storages saved for backward, each once, with what saved it; and autocast's weight cache.

    ``cache``: 16-bit copies of trained fp32 parameters that autocast keeps from their first use to the end of the
    forward (``torch.autocast``'s cache of leaf tensors that require a gradient), saved for backward or not."""

    items: dict[str, tuple[int, str]] = field(default_factory=dict)
    cache: dict[str, int] = field(default_factory=dict)
    working: int = 0  # the largest working set alive inside one op of the forward only (a LoRA variant's)

    def save(self, t: _T | None, why: str) -> None:
        if t is not None and t.key not in self.items:
            self.items[t.key] = (t.bytes, why)

    def add(self, key: str, nbytes: int, why: str) -> None:
        if key not in self.items:
            self.items[key] = (nbytes, why)

    @property
    def total(self) -> int:
        return sum(b for b, _ in self.items.values())

    @property
    def cache_only(self) -> int:
        """Cached casts that nothing saves: alive until the end of the forward only."""
        return sum(b for k, b in self.cache.items() if k not in self.items)

    def by_reason(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for nbytes, why in self.items.values():
            out[why] = out.get(why, 0) + nbytes
        return out


class _Layer:
    """One decoder layer's forward, op by op, recording what is saved (see the module docstring)."""

    def __init__(self, dims: Dims, num: Numerics, tag: str, saved: Saved, *, full: bool,
                 adapters: dict[str, Adapter], attention: str, biases: frozenset[str] = frozenset(),
                 masked: bool = False, trained: frozenset[str] = frozenset()) -> None:
        self.d, self.n, self.tag, self.saved = dims, num, tag, saved
        self.full, self.adapters, self.attention, self.trained = full, adapters, attention, trained
        self.biases, self.masked = biases, masked
        self._count = 0

    def _new(self, numel: int, nbytes: int, grad: bool) -> _T:
        self._count += 1
        return _T(f"{self.tag}.{self._count}", numel, nbytes, grad)

    def _to(self, t: _T, nbytes: int) -> _T:
        return t if t.nbytes == nbytes else self._new(t.numel, nbytes, t.grad)

    def _autocast_in(self, t: _T) -> _T:
        return self._to(t, self.n.compute_bytes) if self.n.autocast else t

    def norm(self, x: _T) -> _T:
        """LlamaRMSNorm: fp32 copy saved (with the rsqrt column) when x needs a gradient; the normed copy in x's dtype
        saved when the weight is trained."""
        n, tokens = x.numel, self.d.tokens
        hs = self._to(x, FP32)
        if x.grad:
            self.saved.save(hs, "RMSNorm input (fp32)")
            self.saved.add(f"{self.tag}.rsqrt{self._count}", tokens * FP32, "RMSNorm rsqrt (fp32)")
        normed = self._new(n, FP32, x.grad)
        cast = self._to(normed, x.nbytes)
        if self.full:
            self.saved.save(cast, "RMSNorm normed input (weight trained)")
        return self._new(n, max(x.nbytes, self.n.param_bytes), x.grad or self.full)

    def linear(self, name: str, x: _T, fan_in: int, fan_out: int) -> _T:
        """A linear layer (and LoRA when it is adapted); returns its output. Under QLoRA every decoder linear is
        4-bit; the LM head is not (transformers keeps the output embedding unquantised)."""
        tokens, c = self.d.tokens, self.n.compute_bytes
        four_bit = self.n.quantised_base and name != "lm_head"
        x_in = self._autocast_in(x)
        weight_trained = self.full or name in self.trained
        if weight_trained:
            self.saved.save(x_in, "linear input (weight trained)")
        weight16 = f"{self.tag}.{name}.weight16"
        if weight_trained and self.n.cast_weights:  # a trained fp32 weight (and bias): cast once, cached to the forward's end
            self.saved.cache[weight16] = fan_in * fan_out * c
            if name in self.biases:
                self.saved.cache[weight16 + ".bias"] = fan_out * c
        if x.grad and (self.n.cast_weights or (self.n.quantised_base and self.n.autocast and not four_bit)):
            # the 16-bit weight the input's gradient is computed with (QLoRA: the fp32 LM head under autocast)
            self.saved.add(weight16, fan_in * fan_out * c, "16-bit weight copy (autocast over fp32 weights)")
        lora_bytes = out_bytes = c if self.n.autocast else self.n.param_bytes
        if four_bit:  # Linear4bit returns its output in its input's dtype (and peft adds in it)
            out_bytes = x.nbytes
            if self.n.keeps_quantised_input and x.grad:  # MatMul4Bit's ctx.tensors = (A, B) before 0.43.2
                self.saved.save(self._to(x, c), "4-bit layer input (bitsandbytes < 0.43.2 keeps it)")
        adapter = self.adapters.get(name)
        out = self._new(tokens * fan_out, out_bytes, x.grad or weight_trained or adapter is not None)
        if adapter is not None:
            x32 = self._to(x, adapter.nbytes)  # peft casts the input to the adapter's dtype
            if adapter.dropout:
                self.saved.add(f"{self.tag}.{name}.mask", x32.numel * adapter.mask_bytes, "LoRA dropout mask")
                x32 = self._new(x32.numel, adapter.nbytes, x32.grad)
            a_in = self._autocast_in(x32)
            self.saved.save(a_in, "LoRA input")
            self.saved.add(f"{self.tag}.{name}.lora_a", tokens * adapter.r * lora_bytes, "LoRA rank-r output")
            if self.n.autocast:  # fp32 adapters: cast and cached by autocast, saved for the input's gradients
                key = f"{self.tag}.{name}.lora_w16"
                self.saved.cache[key] = adapter.r * (fan_in + fan_out) * c
                self.saved.add(key, adapter.r * (fan_in + fan_out) * c, "LoRA weights cast by autocast")
            if adapter.terms is not None:  # a LoRA variant's own (core/methods/: DoRA's magnitude scaling)
                linear = AdaptedLinear(tokens, fan_in, fan_out, adapter.r, a_in.nbytes, self.n.param_bytes)
                for why, nbytes in adapter.terms.saved(linear).items():
                    self.saved.add(f"{self.tag}.{name}.{why}", nbytes, why)
                self.saved.working = max(self.saved.working, adapter.terms.working(linear))
        return out

    def attention_block(self, y: _T) -> _T:
        d, c = self.d, self.n.compute_bytes
        tokens = d.tokens
        q_width, kv_width = d.heads * d.head_dim, d.kv_heads * d.head_dim
        q = self.linear("q_proj", y, d.h, q_width)
        k = self.linear("k_proj", y, d.h, kv_width)
        v = self.linear("v_proj", y, d.h, kv_width)
        rope = max(q.nbytes, self.n.residual_bytes)  # q * cos (cos in the residual dtype) promotes
        q = self._new(q.numel, rope, q.grad)
        k = self._new(k.numel, rope, k.grad)
        grad = q.grad or k.grad or v.grad
        if self.attention == "eager":
            rep = d.heads // d.kv_heads
            qc = self._autocast_in(q)
            kr = self._new(tokens * q_width, k.nbytes, k.grad) if rep > 1 else k
            vr = self._new(tokens * q_width, v.nbytes, v.grad) if rep > 1 else v
            kr, vr = self._autocast_in(kr), self._autocast_in(vr)
            scores = d.b * d.heads * d.s * d.s
            probs = self._new(scores, FP32, grad)
            weights = self._to(probs, q.nbytes)  # softmax(..., dtype=fp32).to(query dtype)
            if grad:
                self.saved.save(qc, "attention q")
                self.saved.save(kr, "attention k (repeated to every head)")
                self.saved.save(probs, "eager attention softmax (fp32)")
                self.saved.save(self._autocast_in(weights), "eager attention weights")
                self.saved.save(vr, "attention v (repeated to every head)")
            out_bytes = c if self.n.autocast else qc.nbytes
            out = self._new(tokens * q_width, out_bytes, grad)  # transpose(1, 2).contiguous(): a copy
        else:
            if self.masked and d.heads != d.kv_heads:  # repeat_kv: no grouped-query SDPA with a mask
                k = self._new(tokens * q_width, k.nbytes, k.grad)
                v = self._new(tokens * q_width, v.nbytes, v.grad)
            qc, kc, vc = self._autocast_in(q), self._autocast_in(k), self._autocast_in(v)
            out = self._new(tokens * q_width, qc.nbytes, grad)
            if grad:
                for t, what in ((qc, "q"), (kc, "k"), (vc, "v"), (out, "output")):
                    self.saved.save(t, f"attention {what}")
                self.saved.add(f"{self.tag}.lse", d.b * d.heads * d.s * FP32, "attention log-sum-exp (fp32)")
                if self.masked:
                    self.saved.add(f"{self.tag}.mask", d.b * d.s * d.s * qc.nbytes,
                                   "attention mask (padding), additive, b·s·s")
        return self.linear("o_proj", out, q_width, d.h)

    def mlp(self, y: _T) -> _T:
        d = self.d
        gate = self.linear("gate_proj", y, d.h, d.inter)
        up = self.linear("up_proj", y, d.h, d.inter)
        if gate.grad:
            self.saved.save(gate, "SiLU input")
        act = self._new(gate.numel, gate.nbytes, gate.grad)
        product_grad = act.grad or up.grad
        if product_grad:  # act * up saves each factor for the other's gradient
            if up.grad:
                self.saved.save(act, "gated product: SiLU output")
            if act.grad:
                self.saved.save(up, "gated product: up_proj output")
        prod = self._new(gate.numel, max(act.nbytes, up.nbytes), product_grad)
        return self.linear("down_proj", prod, d.inter, d.h)

    def forward(self, x: _T) -> _T:
        y = self.norm(x)
        a = self.attention_block(y)
        h1 = self._new(x.numel, max(x.nbytes, a.nbytes), x.grad or a.grad)
        y2 = self.norm(h1)
        m = self.mlp(y2)
        return self._new(h1.numel, max(h1.nbytes, m.nbytes), h1.grad or m.grad)


def decoder_layer(dims: Dims, num: Numerics, *, full: bool, adapters: dict[str, Adapter], attention: str,
                  input_grad: bool, biases: frozenset[str] = frozenset(), masked: bool = False) -> Saved:
    """What one Llama-family decoder layer saves for backward.

    Args:
        dims: the micro-batch and model sizes.
        num: parameter and compute bytes, autocast.
        full: the base weights are trained (full fine-tuning).
        adapters: LoRA adapters by module short name (``q_proj`` ...).
        attention: ``sdpa`` / ``flash_attention_2`` (fused kernels) or ``eager``.
        input_grad: the layer's input needs a gradient (False for the first layer of LoRA without gradient
            checkpointing: the frozen embedding's output does not).
        biases: the short names of the linear layers with a bias (Qwen2: q, k and v).
        masked: an attention mask reaches SDPA (the batch holds padding); flash_attention_2 unpads instead and eager
            adds its mask to the scores, so this changes only ``sdpa``.

    Returns:
        the saved storages (bytes and why), each once.
    """
    saved = Saved()
    x = _T("layer input", dims.tokens * dims.h, num.residual_bytes, input_grad)
    _Layer(dims, num, "layer", saved, full=full, adapters=adapters, attention=attention, biases=biases,
           masked=masked and attention == "sdpa").forward(x)
    return saved


@dataclass(frozen=True)
class StepActivations:
    """The activation terms of one micro-batch's forward and backward (bytes), for the phases of the plan.

    Attributes:
        layer: one decoder layer's saved tensors (a layer whose input needs a gradient).
        first: the first layer's (its input is the embedding's output: in LoRA without checkpointing it needs no
            gradient, and the layer saves less).
        layer_input: one layer's input, b·s·h in the residual dtype (what checkpointing keeps per layer).
        layers: every layer's, as kept at the end of forward (with gradient checkpointing: each layer's input only).
        head: the final norm's and the LM head's saved tensors, and RoPE's cos and sin (shared by every layer).
        logits_forward: the loss at the end of forward: the logits in the compute dtype, their fp32 copy (16-bit
            compute only) and ``log_softmax`` (fp32).
        logits_saved: ``log_softmax``'s fp32 output, kept for backward.
        logits_backward: at the start of backward, the fp32 gradients of ``log_softmax``'s output and of the logits.
        logits_grad: the logits' gradient in the compute dtype when the LM head's backward runs.
        hidden_grad: the gradient of the hidden states flowing back (b·s·h, compute dtype).
        recompute: gradient checkpointing: one layer recomputed in backward (its saved tensors), else 0.
        forward_cache: 16-bit copies of trained fp32 weights autocast keeps to the end of the forward that nothing
            saves (amp: biases; with gradient checkpointing every layer's weights), else 0.
        breakdown: one layer's saved bytes by what saved them (for the method text).
        working: the largest working set alive inside one adapted layer's forward only (a LoRA variant's, e.g.
            DoRA's weight norm), else 0.
    """

    layer: int
    first: int
    layer_input: int
    layers: int
    head: int
    logits_forward: int
    logits_saved: int
    logits_backward: int
    logits_grad: int
    hidden_grad: int
    recompute: int
    forward_cache: int
    breakdown: dict[str, int]
    working: int = 0

    @property
    def saved(self) -> int:
        """What backward starts from: every layer's saved tensors, the head's and the saved log-softmax."""
        return self.layers + self.head + self.logits_saved


def step_activations(dims: Dims, num: Numerics, *, full: bool, adapters: dict[str, Adapter], attention: str,
                     checkpointing: bool, biases: frozenset[str] = frozenset(), masked: bool = False,
                     loss: LossTerms | None = None, loss_projects: bool = False, trained: frozenset[str] = frozenset(),
                     compiled: Callable[[Saved], int] | None = None) -> StepActivations:
    """The activation terms of one micro-batch through a Llama-family model (see :class:`StepActivations`).

    The first layer's input is the embedding's output: it needs a gradient in full fine-tuning, and in LoRA only with
    gradient checkpointing (peft's ``enable_input_require_grads``); without it the first layer saves less.
    Gradient checkpointing (non-reentrant, Trainer's): each layer keeps its input (b·s·h in the residual dtype) and one
    layer is recomputed at a time in backward.

    Args:
        loss: the loss's terms (core/losses.py); None: transformers' cross-entropy over full logits.
        loss_projects: the loss runs the LM head's projection itself (its input is the loss's to keep).
        trained: modules outside the layers whose weights are trained besides adapters (``lm_head``: a LoRA
            ``modules_to_save`` head): they save their input.
        compiled: a compiled layer's saved bytes for the eager layer's :class:`Saved` (``torch.compile``: measured by
            the partitioner, core/plan/compiled.py), or None.
    """
    tokens = dims.tokens
    steady = decoder_layer(dims, num, full=full, adapters=adapters, attention=attention, input_grad=True,
                           biases=biases, masked=masked)
    steady_bytes = compiled(steady) if compiled is not None else steady.total
    layer_input = tokens * dims.h * num.residual_bytes
    if checkpointing:  # nothing inside a layer is kept; autocast's cache still holds every cast weight to the end
        first_bytes = steady_bytes
        layers = dims.layers * layer_input
        recompute = steady_bytes
        cache = dims.layers * sum(steady.cache.values())
        first = steady
    else:
        first = decoder_layer(dims, num, full=full, adapters=adapters, attention=attention, input_grad=full,
                              biases=biases, masked=masked)
        first_bytes = first.total if compiled is None else first.total * steady_bytes // max(steady.total, 1)
        layers = first_bytes + (dims.layers - 1) * steady_bytes
        recompute = 0
        cache = first.cache_only + (dims.layers - 1) * steady.cache_only
    head = Saved()
    final = _Layer(dims, num, "head", head, full=full, adapters={k: v for k, v in adapters.items() if k == "lm_head"},
                   attention=attention, trained=trained)
    y = final.norm(_T("last layer output", tokens * dims.h, num.residual_bytes, True))
    if not loss_projects:  # a loss that projects keeps the head's input itself (its terms)
        final.linear("lm_head", y, dims.h, dims.vocab)
    cos_sin = 2 * tokens * dims.head_dim * num.residual_bytes  # RoPE's cos and sin, saved once for every layer
    c = num.compute_bytes if num.autocast else num.param_bytes
    logits = tokens * dims.vocab
    if loss is None:
        loss = LossTerms(logits * (c + (FP32 if c != FP32 else 0) + FP32), logits * FP32, 2 * logits * FP32,
                         logits * c, "")
    return StepActivations(
        layer=steady_bytes,
        first=first_bytes,
        layer_input=layer_input,
        layers=layers,
        head=head.total + cos_sin,
        logits_forward=loss.forward,
        logits_saved=loss.saved,
        logits_backward=loss.backward,
        logits_grad=loss.grad,
        hidden_grad=tokens * dims.h * c,
        recompute=recompute,
        forward_cache=cache + head.cache_only,
        breakdown=steady.by_reason(),
        working=max(steady.working, first.working),
    )
