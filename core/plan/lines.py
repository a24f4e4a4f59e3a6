"""The component lines of one device's step: each component's bytes with the formula it used (:class:`Line`), and the
terms of the phases they come from (docs/architecture.md §3; every rule with its source in docs/plan.md).

One function per component, each given the part of the model the device holds (a
:class:`core.plan.meta.ModelSummary`: its parameters, LoRA adapters included, each in its dtype):

- weights: :func:`weights_line` (every parameter in its dtype), :func:`qlora_weights_line` (QLoRA's 4-bit base,
  :class:`core.plan.quant.QuantisedBase`);
- gradients: :func:`gradients_line` (the trainable parameters in their dtype) and :func:`gradient_terms` (the gradient
  terms of the backward's moments: the LM head's, a tied embedding's buffer, the first layer's);
- optimizer states: :func:`optimizer_states_line` (AdamW, SGD with momentum, Adafactor; bitsandbytes' 8-bit AdamW,
  :mod:`core.plan.quant`);
- activations: :func:`activation_terms` (op by op for the Llama family, :mod:`core.plan.activations`, the LoRA adapters'
  saved tensors included; Korthikanti et al. 2022, arXiv 2205.05198, otherwise, plus the adapters' inputs), and
  :func:`inference_activations_line` (the logits and the loss);
- temporaries: :func:`step_temporaries` (the optimizer step's buffers), :func:`temporaries_text` (the line's formula),
  :func:`inference_temporaries_line` (one layer's working set);
- kv_cache: :func:`kv_cache_line`; overhead: :func:`overhead_line` (a line of its own: the CUDA context, NCCL buffers,
  the CPU process's runtime).

How a strategy divides the model between devices is :mod:`core.plan.strategies`; the phases and the peak,
:mod:`core.plan.phases` and :mod:`core.plan.memory`. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from core.devicespec import Strategy
from core.dtypes import dtype_bytes
from core.losses import LossInput, LossTerms
from core.methods.lora import keeps_4bit_input
from core.plan.activations import LLAMA_FAMILY, Adapter, Dims, Numerics, StepActivations, step_activations
from core.plan.devices import DeviceInfo
from core.plan.meta import AdapterInfo, ModelShape, ModelSummary, ParamInfo
from core.plan.quant import QuantisedBase
from core.spec import RunSpec

#: Per-process memory of a CPU run beyond its tensors: the Python, torch and transformers runtime and the allocator's free
#: memory, an estimate (measured here: the probe's peak RSS 0.44-0.59 GiB above its peak of live tensors on the embedded
#: model, LoRA and full fine-tuning, fp32 and bf16). The CPU fit counts it, as the probe's RSS does.
CPU_RUNTIME_BYTES = 640 * 2**20
#: Bytes per logit element: transformers' causal-LM loss upcasts logits to fp32.
LOGITS_BYTES = 4
#: Korthikanti et al. 2022, eq. (1): bytes per token per hidden unit of one transformer layer in 16-bit, without the
#: attention-score term 5·a·s/h (which is kept only when the attention implementation materialises the scores).
KORTHIKANTI_SBH_BYTES_16BIT = 34
#: Of those 34, the MLP's (a plain 4h MLP with GeLU and dropout): its input 2, GeLU's input 8, the second linear's input
#: 8, the dropout mask 1; the rest is attention (11) and the two layer norms (4).
KORTHIKANTI_MLP_UNITS = 19
#: Activations transformers writes as Python arithmetic (transformers/activations.py), each of whose ops keeps its own
#: I-wide tensor for backward, by how many more than a fused activation (which keeps its input only):
#: NewGELUActivation ``0.5 * x * (1 + tanh(c * (x + 0.044715 * x**3)))`` keeps tanh's output, 1 + it and 0.5 * x;
#: FastGELUActivation also the inner factor; QuickGELUActivation ``x * sigmoid(1.702 * x)`` the sigmoid's output.
PYTHON_ACTIVATION_TENSORS = {"gelu_new": 3, "gelu_fast": 4, "quick_gelu": 1}
#: Module names of the first (up / gate) and second (down) MLP linear layers across common architectures.
_MLP_IN_NAMES = frozenset({"gate_proj", "up_proj", "c_fc", "fc_in", "fc1", "w1", "w3", "dense_h_to_4h"})
_MLP_OUT_NAMES = frozenset({"down_proj", "c_proj", "fc_out", "fc2", "w2", "dense_4h_to_h"})


@dataclass(frozen=True)
class Line:
    """One component of a device plan.

    Attributes:
        component: one of :data:`core.plan.memory.COMPONENTS`.
        bytes: the estimate, in bytes (0 where the component does not apply).
        method: one line saying how it was estimated (the formula with its numbers), or why it is 0.
    """

    component: str
    bytes: int
    method: str


def _groups(groups: dict[str, int]) -> str:
    """``"70,553,706,496 x 2 B (bf16)"``, or a sum of such terms when dtypes are mixed (LoRA adapters in fp32)."""
    if not groups:
        return "0 parameters"
    return " + ".join(f"{n:,} x {dtype_bytes(d)} B ({d})" for d, n in sorted(groups.items(), key=lambda kv: -kv[1]))


def _group_bytes(groups: dict[str, int]) -> int:
    return sum(n * dtype_bytes(d) for d, n in groups.items())


def weights_line(summary: ModelSummary, scope: str | None = None) -> Line:
    """weights = P x bytes of each parameter's dtype (the parameter dtype; LoRA adapters fp32). ``scope``: what part of
    the model ``summary`` is, for a device holding part of it (device_map, tp)."""
    if scope is not None:
        return Line("weights", _group_bytes(summary.weight_groups),
                    f"P here x bytes: {_groups(summary.weight_groups)}; {scope}")
    return Line(
        "weights",
        _group_bytes(summary.weight_groups),
        f"P x bytes: {_groups(summary.weight_groups)}; every parameter incl. LM head, tied weights once",
    )


def qlora_weights_line(q: QuantisedBase) -> Line:
    """A quantised base's weights line: QLoRA's 4-bit layers (packed and constants), or LLM.int8's 8-bit ones, the
    rest of the base, the adapters."""
    if q.quant_type == "int8":
        return Line("weights", q.weights_bytes,
                    f"LoRA over an 8-bit base (a variant, LLM.int8): {q.layers:,} decoder linear layers in int8, "
                    f"{q.quantised_parameters:,} parameters x 1 B + an fp32 scale per row {q.constants_bytes:,} B; "
                    f"embeddings, norms and LM head not quantised, {q.unquantised_bytes:,} B in the model's dtype; "
                    f"LoRA adapters fp32 {q.adapter_bytes:,} B")
    constants = ("uint8 absmax per block of 64 + fp32 absmax per 256 blocks + 1,024 B map + 4 B offset + 64 B code "
                 "table per layer (double quantisation)" if q.double_quant else
                 "fp32 absmax per block of 64 + 64 B code table per layer")
    return Line("weights", q.weights_bytes,
                f"QLoRA (a variant: the base stored in 4 bits): {q.layers:,} decoder linear layers in "
                f"{q.quant_type.upper()}, {q.quantised_parameters:,} parameters x 0.5 B = {q.packed_bytes:,} B packed "
                f"+ {q.constants_bytes:,} B constants ({constants}); embeddings, norms and LM head not quantised, fp32 "
                f"after peft's prepare_model_for_kbit_training {q.unquantised_bytes:,} B; LoRA adapters fp32 "
                f"{q.adapter_bytes:,} B")


def gradients_line(spec: RunSpec, summary: ModelSummary) -> Line:
    """gradients = T x bytes of each trainable parameter's dtype; none for inference."""
    if not spec.training:
        return Line("gradients", 0, "inference: no backward pass, no gradients")
    text = f"T x bytes (each parameter's dtype): {_groups(summary.grad_groups)}"
    if spec.grad_accum > 1:
        text += "; gradient accumulation keeps them from the second micro-batch's forward on"
    return Line("gradients", _group_bytes(summary.grad_groups), text)


def gradient_terms(spec: RunSpec, shape: ModelShape, summary: ModelSummary) -> dict[str, int]:
    """The gradient terms of the backward's moments: the LM head's weight gradient (an untied head trained), its
    16-bit transient under amp, a tied embedding's buffer, and the first layer's and embedding's gradients."""
    head = tied = first = 0
    vocab_matrix = shape.vocab * shape.hidden
    for p in summary.params:
        if not p.trainable:
            continue
        nbytes = p.numel * dtype_bytes(p.dtype)
        if p.unit == "embeddings":
            first += nbytes
            if shape.tied and p.numel == vocab_matrix:
                tied = nbytes
        elif p.layer == 0:
            first += nbytes
        elif p.unit == "head" and p.kind == "linear" and p.numel == vocab_matrix:
            head = nbytes
    cast = spec.param_dtype != spec.dtype and spec.autocast and (head or tied)
    return {"head_gradient": head, "head_gradient_transient": vocab_matrix * spec.dtype_bytes if cast else 0,
            "tied_buffer": tied, "first_gradients": first}


def _trainable(summary: ModelSummary) -> list[ParamInfo]:
    return [p for p in summary.params if p.trainable]


def optimizer_states_line(spec: RunSpec, summary: ModelSummary, kind: str = "cuda") -> Line:
    """Optimizer states in the steady state, each in the dtype the optimizer creates it in: the optimizer's own rule
    (core/optim/: torch's AdamW 2 moments x T in each parameter's dtype, SGD one buffer, Adafactor factored fp32
    statistics, bitsandbytes' 8-bit and paged states), over this device's trained tensors; none for inference."""
    if not spec.training:
        return Line("optimizer_states", 0, "inference: no optimizer")
    nbytes, text = spec.optimizer_kind.state_bytes(_trainable(summary), kind)
    pageable, _ = spec.optimizer_kind.pageable_bytes(_trainable(summary), kind)
    return Line("optimizer_states", nbytes - pageable, text + (f"; {pageable:,} B of them off the device's plan"
                                                             if pageable else ""))


def paged_states_line(spec: RunSpec, summary: ModelSummary, kind: str = "cuda") -> Line | None:
    """The optimizer states the CUDA driver may page to the host (bitsandbytes' paged states beyond the tensor being
    stepped), off the device's plan; None when there are none."""
    if not spec.training:
        return None
    nbytes, text = spec.optimizer_kind.pageable_bytes(_trainable(summary), kind)
    return Line("optimizer_states", nbytes, text) if nbytes else None


def step_temporaries(spec: RunSpec, summary: ModelSummary, kind: str) -> tuple[int, str]:
    """The optimizer step's transient buffers (bytes, formula): the optimizer's own rule (core/optim/; e.g. foreach
    AdamW on CUDA one more state's worth, fused AdamW none), checked against the traced plan."""
    return spec.optimizer_kind.step_temporaries(_trainable(summary), kind)


def temporaries_text(act: StepActivations, step_text: str, grads: dict[str, int],
                     quantised: QuantisedBase | None = None) -> str:
    """The temporaries line's formula: the loss's gradients, the optimizer step's buffers, a tied embedding's parts,
    QLoRA's dequantised weight, a LoRA variant's working set."""
    parts = [f"start of backward: fp32 gradients of log_softmax and of the logits 2 x b·s·V x 4 B = "
             f"{act.logits_backward:,} B", f"optimizer step: {step_text}"]
    if quantised is not None:
        parts.append(f"4-bit layers: the largest one's weight dequantised to the compute dtype as it runs (forward, "
                     f"and backward for its input's gradient){' with its fp32 absmax' if quantised.double_quant else ''}"
                     f" {quantised.dequantised_bytes:,} B")
    if act.working:
        parts.append(f"a LoRA variant's working set inside one adapted layer's forward {act.working:,} B")
    if grads.get("tied_buffer"):
        parts.append(f"tied embedding: the LM head's part of its gradient {grads['tied_buffer']:,} B held from the "
                     "head's backward to the embedding's, where the two parts and their sum are alive at once")
    return "; ".join(parts)


def _numerics(spec: RunSpec) -> Numerics:
    param = dtype_bytes(spec.param_dtype)
    return Numerics(param_bytes=param, compute_bytes=spec.dtype_bytes if spec.autocast else param,
                    autocast=spec.autocast, quantised_base=bool(spec.method.quantised),
                    keeps_quantised_input=keeps_4bit_input(spec))


def loss_input(spec: RunSpec, shape: ModelShape, summary: ModelSummary, tp: int = 1) -> LossInput:
    """The sizes the spec's loss (core/losses.py) is made of, for the policy's rows of one micro-batch."""
    num = _numerics(spec)
    head = next((p for p in summary.params if p.unit == "head" and p.kind == "linear"
                 and p.numel == shape.vocab * shape.hidden), None)
    head_trained = spec.method.trains_base or "lm_head" in spec.lora.modules_to_save
    return LossInput(tokens=spec.policy_rows * spec.seq_len, rows=spec.policy_rows, vocab=-(-shape.vocab // tp),
                     hidden=shape.hidden, logit_bytes=num.compute_bytes,
                     head_bytes=dtype_bytes(head.dtype) if head is not None else num.param_bytes,
                     head_trained=head_trained, chunks=spec.loss_chunks, compiled=spec.compile,
                     autocast=num.autocast)


def _rows(spec: RunSpec) -> RunSpec:
    """``spec`` with its micro-batch counted in the policy's rows (a preference pair is two sequences), for the terms
    made of the micro-batch's tokens."""
    return dataclasses.replace(spec, batch_size=spec.policy_rows) if spec.policy_rows != spec.batch_size else spec


def activation_terms(spec: RunSpec, shape: ModelShape, summary: ModelSummary, kind: str,
                     tp: int = 1, config: Any = None) -> tuple[StepActivations, str]:
    """The activation terms of one micro-batch (see :class:`core.plan.activations.StepActivations`) and their formula.

    The Llama family, without tensor parallelism: op by op (:func:`core.plan.activations.step_activations`). Others:
    Korthikanti et al. 2022 (eq. 1; eq. 2 under tp) for the layers, an approximation stated in the method. The
    micro-batch is the policy's rows (a preference objective's pairs are two sequences each); the loss is the spec's
    (core/losses.py); with ``compile`` each layer's saved tensors are what AOTAutograd's partitioner keeps, measured on
    ``config``'s layer (core/plan/compiled.py)."""
    num = _numerics(spec)
    loss = spec.loss_kind.terms(loss_input(spec, shape, summary, tp))
    spec = _rows(spec)
    b, s, h, V = spec.batch_size, spec.seq_len, shape.hidden, shape.vocab
    mask = 1 if kind == "cuda" else 4
    terms = spec.method.adapter_terms
    adapters = {a.module: Adapter(a.r, spec.lora.dropout > 0, mask, terms, a.element_bytes) for a in summary.adapters}
    trained = frozenset(m for m in spec.lora.modules_to_save if m == "lm_head") if spec.adapters else frozenset()
    if shape.family in LLAMA_FAMILY and tp == 1:
        dims = Dims(b, s, h, shape.inter, shape.heads, shape.kv_heads, shape.head_dim, V, shape.layers, shape.tied)
        compiled, compiled_text = _compiled(spec, config, b, s)
        act = step_activations(dims, num, full=spec.method.trains_base, adapters=adapters, attention=shape.attention,
                               checkpointing=spec.gradient_checkpointing, biases=shape.biases,
                               masked=spec.padding == "padded", loss=loss, loss_projects=spec.loss_kind.projects,
                               trained=trained, compiled=compiled)
        top = sorted(act.breakdown.items(), key=lambda kv: -kv[1])
        parts = ", ".join(f"{why} {n:,}" for why, n in top)
        text = (f"op by op from the {shape.family} decoder's code (core/plan/activations.py): one layer saves "
                f"{act.layer:,} B ({compiled_text}{parts})")
        if spec.gradient_checkpointing:
            text += (f"; checkpointing: each of L={shape.layers} layers keeps its input {act.layer_input:,} B, one "
                     f"layer recomputed in backward")
        else:
            text += f"; L={shape.layers} layers" + (f" (the first {act.first:,} B)" if act.first != act.layer else "")
        text += f"; + final norm, LM head and RoPE {act.head:,} B; + {loss.text}"
        if spec.objective_kind.policy_rows > 1:
            text += (f"; {spec.objective_kind.label}: b = {b} rows (each pair's chosen and rejected sequences, "
                     "concatenated)")
        if act.forward_cache:
            text += f"; + autocast's cached {spec.dtype} weight copies {act.forward_cache:,} B to the forward's end"
        if terms is not None:
            text += f"; {spec.method.label}: {terms.method}"
        return act, text
    return _korthikanti_terms(spec, shape, summary, num, adapters, tp, loss)


def _compiled(spec: RunSpec, config: Any, batch: int, seq_len: int) -> tuple[Any, str]:
    """With ``compile``: the function giving a layer's saved bytes at micro-batch ``batch`` x ``seq_len`` as
    AOTAutograd's partitioner measures them (core/plan/compiled.py), and its words; (None, "") otherwise."""
    if not spec.compile or config is None:
        return None, ""
    from core.plan.compiled import compiled_layer_bytes

    num = _numerics(spec)
    autocast = spec.dtype if num.cast_weights else None
    layer = compiled_layer_bytes(config, spec.param_dtype, autocast, spec.lora if spec.adapters else None,
                                 spec.padding == "padded")
    saved = layer.saved_bytes(batch, seq_len)
    extra = "".join(f" + {words}" for amount, words in (
        (layer.constant, f"{layer.constant:,} B whatever the batch (16-bit weight copies)"),
        (layer.per_token_squared, f"{layer.per_token_squared:,.1f} B per row per token squared (the padding mask)"))
        if amount)
    return (lambda eager: saved), (f"compiled: {layer.per_token:,.1f} B a token{extra} as AOTAutograd's min-cut "
                                    f"partitioner keeps them, measured on this layer here; eager it would keep ")


def _korthikanti_terms(spec: RunSpec, shape: ModelShape, summary: ModelSummary, num: Numerics,
                       adapters: dict[str, Adapter], tp: int, loss: LossTerms) -> tuple[StepActivations, str]:
    """Activation terms for layers this planner has no op-by-op model of (or under tensor parallelism)."""
    c = num.compute_bytes
    spec = _rows(spec)
    s, b, h = spec.seq_len, spec.batch_size, shape.hidden
    per_layer, layer_text = _layer_activation_bytes(spec, shape, tp, c)
    lora_extra = _adapter_activation_bytes(spec, summary.adapters, c)
    cast = 0
    if num.cast_weights:  # amp: each linear weight's 16-bit copy is kept for the backward of its input
        cast = sum(p.numel for p in summary.params if p.kind == "linear" and p.unit == "layer") * c // max(tp, 1)
    per_layer_all = per_layer + (lora_extra + cast) // max(shape.layers, 1)
    layer_input = b * s * h * num.residual_bytes
    if spec.gradient_checkpointing:
        layers, recompute, cache = shape.layers * layer_input, per_layer_all, cast
    else:
        layers, recompute, cache = shape.layers * per_layer_all, 0, 0
    act = StepActivations(
        layer=per_layer_all, first=per_layer_all, layer_input=layer_input, layers=layers,
        head=b * s * h * (4 + c), logits_forward=loss.forward, logits_saved=loss.saved,
        logits_backward=loss.backward, logits_grad=loss.grad, hidden_grad=b * s * h * c, recompute=recompute,
        forward_cache=cache, breakdown={})
    text = (f"Korthikanti et al. 2022 (an approximation for {shape.family or 'this'} layers): L={shape.layers} x "
            f"{layer_text}, h={h}, s={s}, b={b}")
    if lora_extra:
        text += f"; + LoRA adapters' inputs {lora_extra:,} B"
    if cast:
        text += f"; + the {spec.dtype} copies of the linear weights under amp {cast:,} B"
    if keeps_4bit_input(spec):
        text += "; bitsandbytes < 0.43.2: every 4-bit layer keeps its input for backward"
    if spec.gradient_checkpointing:
        text += f"; checkpointing: each layer keeps its input {layer_input:,} B, one layer recomputed in backward"
    split = f" (vocab-parallel: V/{tp})" if tp > 1 else ""
    text += f"; + {loss.text}{split}"
    if spec.compile:
        text += "; torch.compile not measured for these layers (an eager upper bound)"
    if spec.method.adapter_terms is not None:
        text += f"; {spec.method.label}'s own saved tensors are not in this approximation (op by op: Llama family)"
    return act, text


def _mlp_units(spec: RunSpec, shape: ModelShape) -> tuple[float, str]:
    """Korthikanti's MLP share of a layer (16-bit s·b·h units), generalised to the MLP width I and to gating: the first
    linear's input (2), then I-wide tensors of 2 B each: a plain MLP keeps the activation's input and the second
    linear's input (2 x 2·I/h) and a 1 B dropout mask (Korthikanti's 19 at I = 4h); a gated one keeps the gate, the
    activation's output, up and their product (4 x 2·I/h); an activation written as Python arithmetic keeps more
    (:data:`PYTHON_ACTIVATION_TENSORS`). LoRA on frozen MLP linears drops the inputs of those it does not adapt (a
    frozen linear needs no weight gradient), except over a 4-bit base of bitsandbytes before 0.43.2, which keeps
    them (core/methods/lora.py :func:`keeps_4bit_input`)."""
    ratio = shape.inter / shape.hidden
    inner = 8 * ratio if shape.gated else 4 * ratio + 1
    inner += 2 * ratio * PYTHON_ACTIVATION_TENSORS.get(shape.activation, 0)
    first, second = 2.0, 2 * ratio
    if spec.adapters and not spec.all_linear and not keeps_4bit_input(spec):  # bitsandbytes < 0.43.2 keeps them
        targets = set(spec.lora.targets)
        first = first if targets & _MLP_IN_NAMES else 0.0
        if not targets & _MLP_OUT_NAMES:
            inner -= second  # the second linear's input is the product (gated) or the activation's output
    units = first + inner
    kind = "gated" if shape.gated else "plain"
    extra = PYTHON_ACTIVATION_TENSORS.get(shape.activation, 0)
    act = f", {shape.activation} keeps {extra} more I-wide tensors" if extra else ""
    return units, f"{kind} MLP {units:.1f} (I/h = {ratio:.2f}{act})"


def _layer_activation_bytes(spec: RunSpec, shape: ModelShape, tp: int = 1,
                            nbytes: int | None = None) -> tuple[int, str]:
    """One layer's saved activations, Korthikanti et al. 2022 eq. (1): ``s·b·h·(34 + 5·a·s/h)`` bytes in 16-bit, scaled by
    compute bytes / 2, its MLP share generalised to the MLP's width and gating (:func:`_mlp_units`); the ``5·a·s/h``
    score term only with eager attention. With tensor parallelism ``tp`` = t > 1, eq. (2) (no sequence parallelism):
    ``s·b·h·(10 + 24/t + 5·a·s/(h·t))``. Returns (bytes, formula text)."""
    s, b, h, a = spec.seq_len, spec.batch_size, shape.hidden, shape.heads
    nbytes = nbytes if nbytes is not None else spec.dtype_bytes
    if tp == 1:
        mlp, mlp_text = _mlp_units(spec, shape)
        units = KORTHIKANTI_SBH_BYTES_16BIT - KORTHIKANTI_MLP_UNITS + mlp
        per_layer = int(s * b * h * units * nbytes / 2)
        body = f"s·b·h·({KORTHIKANTI_SBH_BYTES_16BIT - KORTHIKANTI_MLP_UNITS} + {mlp_text}"
        if shape.materialises_scores:
            per_layer += 5 * a * s * s * b * nbytes // 2
            text = f"{body} + 5·a·s/h) x {nbytes} B / 2 (eager attention keeps the a·s·s scores)"
        else:
            text = f"{body}) x {nbytes} B / 2 ({shape.attention} attention: fused, no saved scores)"
        return per_layer, text
    per_layer = s * b * h * (10 * tp + 24) * nbytes // (2 * tp)
    if shape.materialises_scores:
        per_layer += 5 * a * s * s * b * nbytes // (2 * tp)
        text = (f"s·b·h·(10 + 24/t + 5·a·s/(h·t)) x {nbytes} B / 2, t={tp} (Korthikanti eq. 2; eager attention keeps "
                "the scores of its heads)")
    else:
        text = (f"s·b·h·(10 + 24/t) x {nbytes} B / 2, t={tp} (Korthikanti eq. 2, no sequence parallelism; "
                f"{shape.attention} attention: fused)")
    return per_layer, text


def _adapter_activation_bytes(spec: RunSpec, adapters: tuple[AdapterInfo, ...], c: int) -> int:
    """Per adapter: its input b·s·in (cast to the compute dtype) and its rank-r intermediate b·s·r, plus a dropout mask
    b·s·in x 1 B when dropout > 0."""
    s, b = spec.seq_len, spec.batch_size
    mask = 1 if spec.lora.dropout > 0 else 0
    return sum(b * s * (ad.in_features + ad.r) * c + b * s * ad.in_features * mask for ad in adapters)


def inference_activations_line(spec: RunSpec, shape: ModelShape, tp: int = 1) -> Line:
    """Inference at the loss (the probe and the held-out evaluation pass labels): the logits in the dtype, plus
    transformers' fp32 copy for the loss when the dtype is 16-bit, plus the fp32 log-softmax of the cross entropy
    (an fp32 model's ``.float()`` is the same tensor), and the last hidden state the LM head read (b·s·h); equal to the
    traced forward within its rounding."""
    nbytes = spec.dtype_bytes
    elements = -(-spec.batch_size * spec.seq_len * shape.vocab // tp)
    copies = nbytes + (LOGITS_BYTES if nbytes != LOGITS_BYTES else 0) + LOGITS_BYTES
    parts = f"{nbytes} B" + (f" + fp32 copy {LOGITS_BYTES} B" if nbytes != LOGITS_BYTES else "") + \
        f" + fp32 log-softmax {LOGITS_BYTES} B"
    split = f"/{tp} (vocab-parallel)" if tp > 1 else ""
    hidden = spec.batch_size * spec.seq_len * shape.hidden * nbytes
    return Line("activations", elements * copies + hidden,
                f"inference: logits of a full forward pass and the loss over them, b·s·V{split} x ({parts}) = "
                f"{spec.batch_size}·{spec.seq_len}·{shape.vocab:,}{split} x {copies} B, + the last hidden state b·s·h "
                f"x {nbytes} B (no activations are saved; a layer's working set is freed before the loss)")


def inference_temporaries_line(spec: RunSpec, shape: ModelShape, tp: int = 1) -> Line:
    """Inference: one layer's working set (one layer of Korthikanti activations), an estimate; it counts when it is
    above the loss's bytes (it is freed before the loss)."""
    per_layer, layer_text = _layer_activation_bytes(spec, shape, tp)
    return Line("temporaries", per_layer, f"inference: one layer's working set (estimate), {layer_text}")


def kv_cache_line(spec: RunSpec, shape: ModelShape, layers: int | None = None, tp: int = 1) -> Line:
    """Inference: 2 (K, V) x layers x kv_heads x head_dim x b x s x dtype bytes (grouped-query attention: kv_heads =
    ``num_key_value_heads``; head_dim = ``head_dim`` or hidden / heads), for ``layers`` decoder layers (default all)
    with the KV heads ÷ ``tp``. Training runs with ``use_cache`` off."""
    if spec.training:
        return Line("kv_cache", 0, "training: use_cache off, no KV cache")
    nbytes = spec.dtype_bytes
    layers = shape.layers if layers is None else layers
    kv_heads = shape.kv_heads // tp
    size = 2 * layers * kv_heads * shape.head_dim * spec.batch_size * spec.seq_len * nbytes
    heads = f"kv_heads/{tp}" if tp > 1 else "kv_heads"
    where = "L" if layers == shape.layers else "layers here"
    return Line(
        "kv_cache",
        size,
        f"2 (K,V) x {where} x {heads} x head_dim x b x s x {nbytes} B = 2 x {layers} x {kv_heads} x "
        f"{shape.head_dim} x {spec.batch_size} x {spec.seq_len} x {nbytes} B",
    )


def _torch_cuda() -> str | None:
    """The CUDA the loaded torch was built with (``torch.version.cuda``), without importing torch for it: None when
    torch is not loaded in this process or is a CPU build."""
    import sys

    torch = sys.modules.get("torch")
    version = getattr(getattr(torch, "version", None), "cuda", None)
    return str(version) if version else None


def _others_text(device: DeviceInfo) -> str:
    """What other processes hold on a GPU, as the overhead line says it (empty for a GPU planned from its size)."""
    if device.others_bytes is not None:
        return f"; + other processes on this GPU: {device.others_bytes / 2**20:,.0f} MiB ({device.others_source})"
    return f"; other processes on this GPU {device.others_source}" if device.others_source else ""


def overhead_line(device: DeviceInfo, strategy: Strategy = "single", n: int = 1, first: bool = True,
                  quantised_source: tuple[int, str] = (0, ""), training: bool = True) -> Line:
    """CUDA: the CUDA context outside torch's allocator per process per device, by GPU and mode
    (:func:`core.plan.context.cuda_context`, an estimate from the GPU's SMs and one H200's measurement; cuBLAS's
    workspaces are inside the allocator and in the traced replay), plus NCCL communicator buffers
    (:func:`core.plan.context.nccl_buffers`, estimate) for strategies that run collectives on N >= 2 devices (ddp, zero*, tp; not
    device_map, which is one process), plus what other processes hold on the GPU when planned (NVML, read by
    :func:`core.plan.devices.others_on_gpus`: NVML will show theirs beside ours). CPU: the process's runtime, :data:`CPU_RUNTIME_BYTES` (estimate): on the CPU the
    probe's fit is judged by the larger of its tensor peak and its RSS, which holds it."""
    if device.kind == "cuda":
        import os

        from core.plan.context import cuda_context, nccl_buffers

        context = cuda_context(device.label, training, os.environ, _torch_cuda())
        text, others = context.text, device.others_bytes or 0
        if strategy in ("single", "device_map") or n < 2:
            if strategy == "device_map":
                text += " (device_map: one process, a context on each device it uses; no NCCL)"
            return Line("overhead", context.bytes + others, text + _others_text(device))
        nccl, nccl_text = nccl_buffers(os.environ)
        return Line("overhead", context.bytes + nccl + others,
                    f"{text}; + {nccl_text}, for {strategy} over N={n} devices{_others_text(device)}")
    if strategy == "device_map" and not first:
        return Line("overhead", 0, "device_map runs in one process: its runtime is counted on the first device")
    text = (f"no CUDA context on the CPU; the process's Python, torch and transformers runtime and the allocator's "
            f"free memory (estimate; the probe's peak RSS was 0.44-0.59 GiB above its tensor peak on the embedded "
            f"model): {CPU_RUNTIME_BYTES // 2**20} MiB")
    source, name = quantised_source
    if source:
        text += (f"; + QLoRA's load: the checkpoint's pages of the layers quantised as they load, read and kept "
                 f"resident in the process ({name} in the checkpoint as config.json states it; measured here: the "
                 f"process's RSS after the 4-bit load of the embedded model 0.44 GiB above LoRA's load) {source:,} B")
    return Line("overhead", CPU_RUNTIME_BYTES + source, text)


# ------------------------------------------------------------------------------------------ preference objectives
def reference_weights(spec: RunSpec, summary: ModelSummary) -> tuple[int, str]:
    """A preference objective's reference copy (bytes, words): when the reference is a copy, every base parameter
    (adapters aside) once more, in ``reference_dtype`` (or each parameter's own); none when the reference is the
    policy with its adapters disabled, precomputed, or absent (core/objectives.py)."""
    source = spec.reference_source
    if not spec.training or source == "none":
        return 0, ""
    if source != "copy":
        return 0, {"adapters": "; the reference is the same model with its adapters disabled: no second copy",
                   "precomputed": "; the reference's log-probabilities are precomputed before training: no reference "
                                  "model held"}[source]
    base = [p for p in summary.params if p.kind != "adapter"]
    nbytes = sum(p.numel * dtype_bytes(spec.reference_dtype or p.dtype) for p in base)
    dtype = spec.reference_dtype or "each parameter's dtype"
    return nbytes, (f"; + the reference model, a frozen copy of the base in {dtype}: {sum(p.numel for p in base):,} "
                    f"parameters = {nbytes:,} B (no gradients, no optimizer states)")


def reference_forward(spec: RunSpec, shape: ModelShape, summary: ModelSummary) -> tuple[int, int, str]:
    """A preference objective's forward passes without gradient, after the policy's (the reference's, KTO's KL rows):
    (the transient at its peak, the policy's logits still held, words). The transient is its logits (the rows through
    it x s x V in the logits' dtype), one row's fp32 log-softmax and its exp, and one decoder layer's working set (an
    inference layer's, Korthikanti et al. 2022); the policy's logits (2b rows in the compute dtype) are still
    referenced by the loss's caller while it runs (TRL ``_compute_loss``, LLaMA-Factory ``concatenated_forward``,
    torchtune's recipes). None without such a forward (SFT, ORPO, SimPO; precomputed reference log-probabilities)."""
    objective = spec.objective_kind
    if not spec.training or not objective.preference:
        return 0, 0, ""
    rows = spec.batch_size * (objective.policy_rows + objective.no_grad_rows) if spec.reference_source not in (
        "none", "precomputed") else spec.batch_size * objective.no_grad_rows
    if rows == 0:
        return 0, 0, ""
    num = _numerics(spec)
    ref_bytes = dtype_bytes(spec.reference_dtype) if spec.reference_source == "copy" and spec.reference_dtype else \
        num.compute_bytes
    logits = rows * spec.seq_len * shape.vocab * ref_bytes + 2 * spec.seq_len * shape.vocab * 4
    layer, _ = _layer_activation_bytes(dataclasses.replace(spec, batch_size=rows), shape)
    held = spec.policy_rows * spec.seq_len * shape.vocab * num.compute_bytes
    what = "the reference's" if spec.reference_source not in ("none", "precomputed") else "the KL rows'"
    return logits + layer, held, (f"; {what} forward without gradient after the policy's, {rows} rows: its logits "
                                  f"{rows}·s·V x {ref_bytes} B + one row's fp32 log-softmax and exp + a layer's working "
                                  f"set {layer:,} B = {logits + layer:,} B, the policy's logits {held:,} B still held")


# ---------------------------------------------------------------------------- optimizer in backward, offloading
def in_backward(spec: RunSpec, summary: ModelSummary, kind: str) -> tuple[int, int, str]:
    """The optimizer stepped in backward (torchtune's ``optimizer_in_bwd``, ``OptimizerInBackward``: one optimizer
    per parameter, stepped and zeroed in its post-accumulate-grad hook): (the gradients alive at once, the step's
    temporaries, words). Only the gradient of the parameter being stepped is alive (the largest one at most); the step
    is the optimizer's over that one tensor."""
    trained = _trainable(summary)
    largest = max(trained, key=lambda p: p.numel * dtype_bytes(p.dtype), default=None)
    if largest is None:
        return 0, 0, ""
    grad = largest.numel * dtype_bytes(largest.dtype)
    step, step_text = spec.optimizer_kind.step_temporaries([largest], kind)
    return grad, step, (f"optimizer stepped in backward: each gradient freed as soon as its parameter steps; at most the "
                        f"largest, {largest.numel:,} x {dtype_bytes(largest.dtype)} B = {grad:,} B, alive at once; "
                        f"its step: {step_text}")


#: torchtune's ``OffloadActivations``: offloaded tensors kept on the device in flight (``max_fwd_stash_size``)
OFFLOAD_IN_FLIGHT = 5


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def offloaded_activations(spec: RunSpec, act: StepActivations, n_layers: int) -> tuple[int, int, str]:
    """Activation offloading (torchtune's ``OffloadActivations``, TRL's copy of it): saved tensors of at least 1 KiB
    are copied to pinned host memory as they are saved and brought back when their node runs in backward; up to
    :data:`OFFLOAD_IN_FLIGHT` stay on the device in flight. With checkpointing the saved tensors are each layer's input:
    (the layers' bytes left on the device, the pinned host bytes (each copy rounded up to a power of two by the CUDA
    host allocator), words). Without checkpointing a layer's saved tensors go the same way: one layer's worth is
    planned on the device."""
    if spec.gradient_checkpointing:
        device = min(n_layers, OFFLOAD_IN_FLIGHT) * act.layer_input
        host = n_layers * _pow2(act.layer_input)
        what = (f"each layer's input offloaded, {min(n_layers, OFFLOAD_IN_FLIGHT)} in flight on the device x "
                f"{act.layer_input:,} B")
    else:
        device = act.first
        host = n_layers * _pow2(act.layer)
        what = f"every layer's saved tensors offloaded, one layer's worth ({act.first:,} B) planned in flight"
    return device, host, (f"activation offloading: {what}; pinned host memory {host:,} B (each copy rounded up to a "
                          "power of two); the LM head's input and the loss stay on the device")
