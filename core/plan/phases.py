"""The phases of a step, and which memory is alive at each one's peak (the plan's total is the largest of them).

A training step does not hold each component's maximum at once: at the end of the forward the activations are all
saved but no gradient exists yet (unless accumulated from an earlier micro-batch); in backward the gradients appear
while the activations are freed; at the optimizer step the activations are gone and the optimizer's transient
buffers appear. Summing each component's maximum (what the plan did before) over-estimates the peak by the
activations or the gradients, whichever is smaller; the traced plan showed it (27 % on the embedded full
fine-tuning default).

The phases (as torch runs them, and as :mod:`core.plan.traced` measures them):

- ``forward``: weights, optimizer states (steady state: created by the first step), gradients of earlier
  micro-batches (gradient accumulation), every layer's saved activations, autocast's weight cache, and the loss at
  the end (logits, their fp32 copy, ``log_softmax``).
- ``backward``: the largest of five moments, each named: the loss's gradient (start of backward: the saved
  activations, ``log_softmax`` and two fp32 gradients of b·s·V), the LM head's backward (its weight gradient
  appears), the last layer recomputed (gradient checkpointing), the first layer's backward (nearly every gradient
  exists, that layer's activations remain) and the end of backward (every gradient; a tied embedding's gradient is
  the sum of two parts, both alive while they are added).
- ``optimizer_step``: weights, gradients, optimizer states and the step's transient buffers (foreach AdamW: one more
  state's worth; per-tensor AdamW on the CPU: two copies of the largest parameter; Adafactor: fp32 copies of the
  largest parameter).

Inference has one phase, ``forward``: weights and the KV cache, with the logits and the loss over them at its end,
or a decoder layer's working set before that, whichever is larger.

A phase is its largest moment; each component's line in the plan is its largest value over every moment weighed.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The phases of a training step, in order (inference has only ``forward``).
PHASES = ("forward", "backward", "optimizer_step")
#: The components a phase lists (:data:`core.plan.memory.COMPONENTS`, in the same order).
PHASE_COMPONENTS = ("weights", "gradients", "optimizer_states", "activations", "temporaries", "overhead", "kv_cache")


@dataclass(frozen=True)
class Phase:
    """The bytes alive at one phase's peak, per component.

    Attributes:
        name: one of :data:`PHASES`.
        components: bytes per component (every name in :data:`PHASE_COMPONENTS`).
        at: where in the phase the peak is, in words (e.g. "the loss's gradient, at the start of backward").
    """

    name: str
    components: dict[str, int]
    at: str

    @property
    def total_bytes(self) -> int:
        """The sum of the components alive at this moment."""
        return sum(self.components.values())


@dataclass(frozen=True)
class StepTerms:
    """What one device holds during a training step, as the terms the phases are made of (bytes).

    Attributes:
        weights, gradients, optimizer_states: this device's share (all gradients, states in steady state).
        step_temporaries: the optimizer step's transient buffers.
        accumulated_gradients: gradients alive through forward and backward from earlier micro-batches (gradient
            accumulation), else 0.
        layers: every layer's saved activations at the end of forward (with checkpointing: each layer's input).
        first_layer: what the first layer on this device keeps when its backward runs (with checkpointing: its input
            and its recomputed activations).
        head: the final norm's and the LM head's saved tensors (and RoPE's shared cos and sin); 0 without the head.
        logits_forward, logits_saved, logits_backward, logits_grad: the loss's terms (see
            :class:`core.plan.activations.StepActivations`); 0 on a device without the head.
        hidden_grad: the gradient of the hidden states flowing back.
        recompute: with checkpointing, one layer recomputed in backward; else 0.
        forward_cache: autocast's cached weight copies nothing saves (alive to the end of the forward).
        head_gradient: the LM head's weight gradient created when its backward runs (an untied head trained in full).
        head_gradient_transient: under amp, the 16-bit gradient of the cast head weight beside its fp32 copy.
        tied_buffer: a trained tied embedding: the LM head's part of its gradient, held from the head's backward to
            the embedding's, where the two parts are added (both, and their sum, alive at once).
        first_gradients: gradients of the embedding and of the first layer (not yet made when that layer's backward
            runs).
        every_phase: temporaries alive through the whole step (DDP's gradient buckets).
        gathered: temporaries alive in forward and backward only (ZeRO-3 / FSDP gathered units).
        overhead: the CUDA context (and NCCL buffers), not a tensor.
        kv_cache: inference only.
        dequantised: QLoRA, the largest 4-bit layer's weight dequantised as it runs: in the last layer's forward
            (every layer's activations saved but the loss not yet made), in the first layer's backward and in a
            recomputed layer; else 0.
        forward_working: a LoRA variant's working set inside one adapted layer's forward (DoRA's weight norm), at
            its largest in the last layer's forward; else 0.
        reference_forward: a preference objective's forward without gradient (the reference's, and KTO's KL rows),
            run after the policy's forward while its saved activations are alive: its logits and one layer's working
            set; else 0.
        logits_held: the policy's logits still referenced while that forward runs (the loss's caller holds them).
    """

    weights: int
    gradients: int
    optimizer_states: int
    step_temporaries: int
    accumulated_gradients: int
    layers: int
    first_layer: int
    head: int
    logits_forward: int
    logits_saved: int
    logits_backward: int
    logits_grad: int
    hidden_grad: int
    recompute: int
    forward_cache: int
    head_gradient: int = 0
    head_gradient_transient: int = 0
    tied_buffer: int = 0
    first_gradients: int = 0
    every_phase: int = 0
    gathered: int = 0
    overhead: int = 0
    kv_cache: int = 0
    dequantised: int = 0
    forward_working: int = 0
    reference_forward: int = 0
    logits_held: int = 0


def _phase(name: str, at: str, **parts: int) -> Phase:
    return Phase(name, {c: int(parts.get(c, 0)) for c in PHASE_COMPONENTS}, at)


def training_moments(t: StepTerms) -> list[Phase]:
    """Every moment of a training step the plan weighs (see the module docstring): the end of the forward, the five
    moments of the backward, the optimizer step; each with the components alive then."""
    fixed = {"weights": t.weights, "overhead": t.overhead}
    during = dict(fixed, optimizer_states=t.optimizer_states)
    extra = t.every_phase + t.gathered
    moments = [
        _phase("forward", "the loss at the end of the forward", **during, gradients=t.accumulated_gradients,
               activations=t.layers + t.head + t.logits_forward + t.forward_cache, temporaries=extra),
        *([_phase("forward", "a 4-bit layer's weight dequantised in the last layer's forward", **during,
                  gradients=t.accumulated_gradients, activations=t.layers + t.forward_cache,
                  temporaries=t.dequantised + extra)] if t.dequantised else []),
        *([_phase("forward", "a LoRA variant's working set in the last layer's forward", **during,
                  gradients=t.accumulated_gradients, activations=t.layers + t.forward_cache,
                  temporaries=t.forward_working + extra)] if t.forward_working else []),
        *([_phase("forward", "the reference's forward without gradient, after the policy's", **during,
                  gradients=t.accumulated_gradients, activations=t.layers + t.head + t.logits_saved + t.logits_held,
                  temporaries=t.reference_forward + extra)] if t.reference_forward else []),
        _phase("backward", "the loss's gradient, at the start of backward", **during,
               gradients=t.accumulated_gradients, activations=t.layers + t.head + t.logits_saved,
               temporaries=t.logits_backward + extra),
        _phase("backward", "the LM head's backward", **during,
               gradients=t.accumulated_gradients + t.head_gradient, activations=t.layers + t.head,
               temporaries=t.logits_grad + t.hidden_grad + t.head_gradient_transient + t.tied_buffer + extra),
        _phase("backward", "the first layer's backward", **during,
               gradients=max(t.accumulated_gradients, t.gradients - t.first_gradients), activations=t.first_layer,
               temporaries=t.hidden_grad + t.tied_buffer + t.dequantised + extra),
        _phase("backward", "the end of backward", **during, gradients=t.gradients,
               temporaries=2 * t.tied_buffer + extra),
    ]
    if t.recompute:
        moments.append(_phase("backward", "the last layer recomputed (gradient checkpointing)", **during,
                              gradients=t.accumulated_gradients + t.head_gradient,
                              activations=t.layers + t.head + t.recompute,
                              temporaries=t.hidden_grad + t.tied_buffer + t.dequantised + extra))
    moments.append(_phase("optimizer_step", "the optimizer step", **fixed, gradients=t.gradients,
                          optimizer_states=t.optimizer_states, temporaries=t.step_temporaries + t.every_phase))
    return moments


def inference_moments(weights: int, activations: int, temporaries: int, kv_cache: int, overhead: int) -> list[Phase]:
    """Inference, one forward: the loss at its end (weights, the KV cache, the logits with the loss over them and the
    last hidden state) or, when larger, a decoder layer's working set (the layers' intermediates are freed before the
    loss)."""
    return [_phase("forward", "the loss at the end of the forward", weights=weights, activations=activations,
                   kv_cache=kv_cache, overhead=overhead),
            _phase("forward", "a decoder layer's working set", weights=weights, temporaries=temporaries,
                   kv_cache=kv_cache, overhead=overhead)]


def phases_of(moments: list[Phase]) -> dict[str, Phase]:
    """Each phase's peak: its moment with the most bytes alive (the first of equal ones), in :data:`PHASES` order."""
    out: dict[str, Phase] = {}
    for m in moments:
        if m.name not in out or m.total_bytes > out[m.name].total_bytes:
            out[m.name] = m
    return {name: out[name] for name in PHASES if name in out}


def training_phases(t: StepTerms) -> dict[str, Phase]:
    """The three phases of a training step from its terms, each at its own peak (see :func:`training_moments`)."""
    return phases_of(training_moments(t))


def peak(phases: dict[str, Phase]) -> Phase:
    """The phase with the most bytes alive (the first in :data:`PHASES` order on a tie)."""
    return max(phases.values(), key=lambda p: (p.total_bytes, -PHASES.index(p.name)))
