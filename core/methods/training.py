"""The rules every training method shares (full fine-tuning, LoRA and its variants): steps, a learning rate and a
warmup within the steps."""

from __future__ import annotations

from typing import Any

from core.errors import SpecError

#: the settings groups of every training method (core/methods/base.py SETTING_GROUPS)
TRAINING_GROUPS = frozenset({"all", "training"})


def check_training(spec: Any) -> None:
    """A training run needs steps, a positive learning rate, and a warmup no longer than its steps.

    Raises:
        SpecError: naming the field.
    """
    if spec.steps < 1:
        raise SpecError("steps", f"a training mode needs at least 1 step (got {spec.steps})")
    if spec.learning_rate <= 0:
        raise SpecError("learning_rate", f"must be positive for training (got {spec.learning_rate})")
    if spec.warmup_steps > spec.steps:
        raise SpecError("warmup_steps", f"{spec.warmup_steps} is more than steps ({spec.steps}); lower it")
