"""torchao's low-bit AdamW (``torchao.optim.AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``): variants of AdamW with
quantised states, as transformers' Trainer (``optim="adamw_torch_8bit"`` / ``"adamw_torch_4bit"``, block size 256)
and axolotl (``ao_adamw_8bit``, ``ao_adamw_4bit``, ``ao_adamw_fp8``) run them.

States (torchao ``optim/adam.py`` ``_new_buffer``; ``subclass_8bit.py``, ``subclass_4bit.py``, ``subclass_fp8.py``;
measured on this CPU with torchao 0.18: 2.0332 B an element for 8-bit, 1.0314 for 4-bit at block 256, 2.0312 for
FP8, on a 1024 x 1024 bf16 tensor): a parameter of ``n`` elements with ``n >= 4096`` and ``n`` a multiple of the block
is quantised; any other keeps its two moments as ``zeros_like(param)``, in its own dtype. Per quantised state:

- 8-bit: ``n`` uint8 codes, an fp32 scale per 256 elements, and its own 256-entry fp32 map (1,024 B);
- 4-bit: ``n / 2`` bytes of codes, an fp32 scale per block, and its own 16-entry fp32 map (64 B);
- FP8: ``n`` float8 codes and an fp32 scale per 256 elements.

The step: one compiled update per parameter in fp32 (``single_param_adam``), its temporaries the parameter being
stepped in fp32 copies (measured on this CPU: 8 B an element for 8-bit, 26 for 4-bit, about 0 for FP8; CUDA's inductor
kernels not measured): the largest parameter's.
"""

from __future__ import annotations

from collections.abc import Sequence

from core.dtypes import dtype_bytes
from core.optim.base import FP32, Optimizer, Param, Rule, Term, largest

#: the smallest parameter torchao quantises (``_new_buffer``: ``numel >= 4096``)
MIN_SIZE = 4096
#: the block size transformers' Trainer passes (``block_size=256``); axolotl keeps torchao's defaults (8-bit and FP8
#: 256, 4-bit 128)
BLOCK = 256


def _state_bytes(n: int, param_bytes: int, bits: str, block: int) -> int:
    """Both moments of one parameter of ``n`` elements (bytes)."""
    if n < MIN_SIZE or n % block:
        return 2 * n * param_bytes
    scales = FP32 * (n // block)
    one = {"8bit": n + scales + 256 * FP32, "4bit": n // 2 + scales + 16 * FP32, "fp8": n + scales}[bits]
    return 2 * one


def _states(bits: str, block: int) -> Rule:
    def states(params: Sequence[Param], kind: str) -> Term:
        total = sum(_state_bytes(p.numel, dtype_bytes(p.dtype), bits, block) for p in params)
        plain = [p for p in params if p.numel < MIN_SIZE or p.numel % block]
        return total, (f"torchao AdamW {bits} (a variant): quantised moments in blocks of {block} with an fp32 scale "
                       f"each" + (" and a map per state" if bits != "fp8" else "") + f" for {len(params) - len(plain):,} "
                       f"tensors; {len(plain):,} tensors under {MIN_SIZE:,} elements or not a multiple of the block keep "
                       "both moments in their own dtype")
    return states


def _step(per_element: int) -> Rule:
    def step(params: Sequence[Param], kind: str) -> Term:
        big = largest(params)
        assert big is not None
        return (per_element * big.numel, f"torchao's compiled per-parameter update in fp32: {per_element} B an element "
                                         f"of the largest parameter ({big.numel:,}; measured on this CPU)")
    return step


_UNTRACED = "the traced plan steps torch's own optimizers; {} (torchao) is planned from its layout"

ADAMW_AO_8BIT = Optimizer(
    name="adamw_ao_8bit", label="AdamW 8-bit (torchao variant)", library="torchao", variant=True,
    summary="torchao's AdamW8bit: uint8 moments with an fp32 scale per 256 and a map per state",
    states=_states("8bit", BLOCK), step=_step(8), trainer_optim="adamw_torch_8bit",
    names={"trainer": ("adamw_torch_8bit", "ao_adamw_8bit"), "torchtune": ("torchao.optim.AdamW8bit",
                                                                          "torchao.prototype.low_bit_optim.AdamW8bit")},
    untraced=_UNTRACED.format("adamw_ao_8bit"), choice="torchao variant")
ADAMW_AO_4BIT = Optimizer(
    name="adamw_ao_4bit", label="AdamW 4-bit (torchao variant)", library="torchao", variant=True,
    summary="torchao's AdamW4bit: 4-bit moments with an fp32 scale per block and a map per state",
    states=_states("4bit", BLOCK), step=_step(26), trainer_optim="adamw_torch_4bit",
    names={"trainer": ("adamw_torch_4bit", "ao_adamw_4bit"), "torchtune": ("torchao.optim.AdamW4bit",
                                                                          "torchao.prototype.low_bit_optim.AdamW4bit")},
    untraced=_UNTRACED.format("adamw_ao_4bit"), choice="torchao variant")
ADAMW_AO_FP8 = Optimizer(
    name="adamw_ao_fp8", label="AdamW FP8 (torchao variant)", library="torchao", variant=True,
    summary="torchao's AdamWFp8: float8 moments with an fp32 scale per 256",
    states=_states("fp8", BLOCK), step=_step(0), trainer_optim="",
    names={"trainer": ("ao_adamw_fp8",), "torchtune": ("torchao.optim.AdamWFp8",
                                                       "torchao.prototype.low_bit_optim.AdamWFp8")},
    untraced=_UNTRACED.format("adamw_ao_fp8"), choice="torchao variant")
