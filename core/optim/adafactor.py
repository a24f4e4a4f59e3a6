"""transformers' Adafactor (Shazeer & Stern 2018, arXiv 1804.04235; ``transformers/optimization.py``) as Trainer runs
it (``optim="adafactor"``: no first moment, ``scale_parameter=False, relative_step=False``).

States: the gradient is upcast to fp32 before its statistics are made, so a factored second moment of (rows + cols) x
4 B per matrix (over its last two dimensions, times the leading ones) and n x 4 B per vector, whatever the dtype.
Step: ``grad ** 2 + eps`` and the update, 2 fp32 copies of the largest trained tensor, and for a 16-bit parameter its
fp32 gradient and fp32 weight as well (4 copies)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from core.dtypes import dtype_bytes
from core.optim.base import FP32, Optimizer, Param, Term, largest


def states(params: Sequence[Param], kind: str) -> Term:
    elements = 0
    for p in params:
        shape = p.shape or (p.numel,)
        if len(shape) >= 2:
            elements += math.prod(shape[:-2]) * (shape[-2] + shape[-1])
        else:
            elements += math.prod(shape)
    return (elements * FP32, f"Adafactor factored second moment in fp32 (the gradient is upcast first): (rows + cols) "
                             f"x 4 B per matrix, n x 4 B per vector = {elements:,} x 4 B")


def step(params: Sequence[Param], kind: str) -> Term:
    big = largest(params)
    assert big is not None
    copies = 2 if dtype_bytes(big.dtype) == FP32 else 4
    return copies * big.numel * FP32, (f"Adafactor step: {copies} fp32 copies of the largest trainable tensor = "
                                       f"{copies} x {big.numel:,} x 4 B")


ADAFACTOR = Optimizer(
    name="adafactor", label="Adafactor", library="transformers",
    summary="transformers' Adafactor without a first moment: factored fp32 row and column statistics per matrix",
    states=states, step=step, trainer_optim="adafactor",
    names={"trainer": ("adafactor",), "torchtune": ("transformers.optimization.Adafactor",)},
    torch_class="transformers.optimization.Adafactor",
    torch_options={"scale_parameter": False, "relative_step": False}, state_words="a factored fp32 second moment")
