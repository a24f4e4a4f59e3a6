"""Inference: fixed weights, forward passes only (no backward, no gradients, no optimizer, no update)."""

from __future__ import annotations

from typing import Any

from core.errors import SpecError
from core.methods.base import Method


def check_inference(spec: Any) -> None:
    """No training steps, no training criteria, no master copy (amp).

    Raises:
        SpecError: naming the field and what to change.
    """
    if spec.steps != 0:
        raise SpecError("steps", "inference runs no training steps; set steps = 0 or choose a training mode "
                                 "(full, lora, qlora)")
    for name, default in (("min_improvement", 0.0), ("resume_tier", "auto")):  # refused, not stored unjudged
        if getattr(spec.accept, name) != default:
            raise SpecError(f"accept.{name}", "applies to training (inference trains nothing and resumes nothing); "
                                              "remove it or choose a training mode")
    if spec.precision == "amp":
        raise SpecError("precision", "amp keeps fp32 master weights for training; inference loads the weights in "
                                     "dtype: set precision = \"pure\" (the default) or choose mode full or lora")


INFERENCE = Method(
    name="inference", label="Inference",
    summary="Fixed weights: forward passes only. No backward, no gradients, no optimizer, no update. Memory: weights "
            "+ KV cache + one layer's working set. Evaluated once on held-out text.",
    trains=False, adapters=False, layout="inference", groups=frozenset({"all"}),
    steps=0, learning_rate=0.0, checkpoint_every=10, kill_after_checkpoint=1,
    checks=(check_inference,))
