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


def planned_only(spec: Any) -> None:
    """A method this version plans but does not run.

    Raises:
        SpecError: on ``mode``, always.
    """
    raise SpecError("mode", f"{spec.mode} is planned (gpuaccept plan), not run by gpuaccept's own recipe in this "
                            "version; run your own trainer on it in command mode (gpuaccept run --command ...)")


BADAM = Method(
    name="badam", label="BAdam (block coordinate descent, variant of full fine-tuning)",
    summary="BAdam (Luo et al. 2024, arXiv 2404.02827): every parameter is trained over the run, one decoder layer at "
            "a time: the active layer's gradients, an fp32 copy of it and AdamW's fp32 states for it, the rest frozen. "
            "Planned only in this version.",
    trains=True, adapters=False, layout="full", groups=TRAINING_GROUPS | {"distributed"},
    steps=12, learning_rate=5e-5, checkpoint_every=4, kill_after_checkpoint=2, trained_block=True, runs=False,
    checks=(check_training,), run_checks=(planned_only,))
