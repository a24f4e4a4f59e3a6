"""DoRA (Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank Adaptation", arXiv 2402.09353), a variant of LoRA, labelled
as one: each adapted weight is split into a magnitude (one trained value per output feature) and a direction (the
frozen weight plus LoRA's B @ A, normalised per output feature). peft runs it with ``LoraConfig(use_dora=True)``.

What it adds to LoRA's memory, read in peft 0.21.2 (``peft/tuners/lora/dora.py`` ``DoraLinearLayer``,
``peft/tuners/lora/variants.py`` ``DoraLinearVariant.forward``) and measured on this CPU (tests/unit/test_dora.py):

- parameters: ``lora_magnitude_vector``, fan_out values per adapted layer, trained (weights, gradients and optimizer
  states as every trained parameter; the plan's meta model is built by peft with ``use_dora=True`` and counts them);
- saved for backward, per adapted layer: ``(m / ||W + s·BA|| - 1) * base_result`` keeps the base layer's output and
  ``m / ||W + s·BA|| * lora_result`` keeps LoRA's output (b·s·fan_out each), and three fan_out vectors (the norm,
  the scale and the scale minus one);
- a working set inside each adapted layer's forward, freed before the next layer: ``get_lora_weight`` multiplies an
  identity ``eye(fan_in)`` through A and B (fan_in², fan_in·r and the fan_in·fan_out product, kept by their graph to
  the layer's end), then ``||W + s·BA||`` makes ``s·BA`` and the sum (fan_out·fan_in each) and the norm.

This version runs DoRA in fp32, in one process, without gradient checkpointing: what the plan above is measured for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.errors import SpecError
from core.methods.base import AdaptedLinear, AdapterTerms, Method
from core.methods.lora import check_adapters
from core.methods.training import TRAINING_GROUPS, check_training

FP32 = 4


def check_dora(spec: Any) -> None:
    """What this version runs DoRA with: fp32, strategy single, no gradient checkpointing (the cases its plan is
    measured for against the traced plan); it plans the others (its terms in each one's bytes).

    Raises:
        SpecError: naming the field and what to change.
    """
    if spec.dtype != "fp32":
        raise SpecError("dtype", f"dora is run in fp32 in this version, not {spec.dtype} (it plans in {spec.dtype}): "
                                 "set dtype = \"fp32\" to run it, or use mode lora for 16-bit training")
    if spec.gradient_checkpointing:
        raise SpecError("gradient_checkpointing", "dora is run without gradient checkpointing in this version (it "
                                                  "plans with it): set it off to run it")
    if spec.strategy != "single":
        raise SpecError("strategy", f"dora runs in one process in this version (strategy single), not "
                                    f"{spec.strategy}: use mode lora for {spec.strategy}")


def saved(layer: AdaptedLinear) -> Mapping[str, int]:
    """What DoRA saves for backward beyond LoRA's, in one adapted layer (bytes; see the module docstring)."""
    out = layer.tokens * layer.fan_out
    return {"DoRA: the base layer's output (for the magnitude's gradient)": out * layer.adapter_bytes,
            "DoRA: LoRA's output (for the magnitude's gradient)": out * layer.adapter_bytes,
            "DoRA: the norm, the scale and the scale - 1 (fan_out each)": 3 * layer.fan_out * FP32}


def working(layer: AdaptedLinear) -> int:
    """DoRA's working set at its largest inside one adapted layer's forward (bytes): the identity, its image through A,
    B·A, s·B·A, W + s·B·A and the norm (see the module docstring)."""
    i, o = layer.fan_in, layer.fan_out
    return (i * i + i * layer.r + 3 * i * o + o) * FP32


DORA = Method(
    name="dora", label="DoRA (LoRA variant)",
    summary="LoRA with each adapted weight split into a trained magnitude (one value per output feature) and a "
            "direction (the frozen weight plus B @ A, normalised): peft's use_dora. Adds the magnitudes, two "
            "b·s·out activations per adapted layer and a weight-sized working set in its forward. fp32, one process "
            "in this version; slower steps than LoRA.",
    trains=True, adapters=True, layout="lora", groups=TRAINING_GROUPS | {"adapter"},
    steps=30, learning_rate=1e-3, checkpoint_every=10, kill_after_checkpoint=2,
    dtype_note=" (fp32 in this version)",
    checks=(check_training, check_adapters), run_checks=(check_dora,),
    peft_options={"use_dora": True},
    adapter_terms=AdapterTerms(
        saved=saved, working=working,
        method="per adapted layer the base output and LoRA's output b·s·out x 4 B each and three out-vectors saved; "
               "in its forward (B·A from eye(in), s·B·A, W + s·B·A, the norm) (in² + in·r + 3·in·out + out) x 4 B "
               "(peft 0.21.2 tuners/lora/dora.py)"))
