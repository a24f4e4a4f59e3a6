"""Full fine-tuning: every parameter trained, with a gradient and optimizer states for each."""

from __future__ import annotations

from typing import Any

from core.errors import SpecError
from core.methods.base import Method
from core.methods.training import TRAINING_GROUPS, check_training


def check_full(spec: Any) -> None:
    """Pure fp16 full fine-tuning makes every gradient fp16, which the GradScaler fp16 training needs refuses
    (``torch.amp.GradScaler.unscale_``: "Attempting to unscale FP16 gradients."; tests/unit/test_precision.py).

    Raises:
        SpecError: on ``precision``.
    """
    if spec.precision == "pure" and spec.dtype == "fp16":
        raise SpecError("precision", "pure fp16 full fine-tuning makes every gradient fp16, and the GradScaler "
                                     "fp16 training needs refuses them (\"Attempting to unscale FP16 gradients\"); "
                                     "set precision = \"amp\" (fp32 master weights) or dtype = \"bf16\"")


FULL = Method(
    name="full", label="Full fine-tuning",
    summary="Every parameter is trained: backward through the whole model, a gradient and optimizer states for every "
            "parameter (AdamW: 16 B per parameter in mixed precision), plus activations.",
    trains=True, adapters=False, layout="full", groups=TRAINING_GROUPS | {"precision", "distributed"},
    steps=12, learning_rate=5e-5, checkpoint_every=4, kill_after_checkpoint=2,
    trains_base=True, dtype_note=" (precision: what is kept in it)",
    checks=(check_training, check_full))
