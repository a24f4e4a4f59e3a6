"""bitsandbytes' AdamW with 8-bit or paged states (Dettmers et al. 2022, arXiv 2110.02861): variants of AdamW,
labelled as such. Each formula is read from bitsandbytes 0.50.2 (the version pinned in constraints.txt;
``bitsandbytes/optim/optimizer.py``, ``Optimizer2State.init_state`` and ``Optimizer8bit.get_state_buffer``) and the
8-bit layout is checked to the byte against the live tensors on this CPU (tests/unit/test_quant.py).

Per parameter of ``n`` elements:

- 8-bit states (``optim_bits=8``): ``n < min_8bit_size`` (4,096) keeps both moments fp32, ``8 * n``; otherwise both
  moments ``uint8`` (``2 * n``) and one fp32 ``absmax`` per block of 256 per moment (``8 * ceil(n / 256)``); once per
  optimizer, when any state is 8-bit, the signed and unsigned 256-entry fp32 dynamic maps (2,048 B). transformers'
  Trainer gives every ``nn.Embedding`` weight fp32 states (``optim_bits=32``; ``Trainer.create_optimizer``), whatever
  its size.
- 32-bit states (``optim_bits=32``): both moments fp32, ``8 * n``, whatever the parameter's dtype.
- paged (``is_paged=True``): a state of a parameter of at least 100,000 elements is allocated by ``F.get_paged``
  (``cudaMallocManaged``, CUDA unified memory the driver may page to the host under pressure), outside torch's caching
  allocator: it counts in NVML's used memory while resident, not in torch's allocated or reserved. Smaller ones are
  ordinary device tensors. On the CPU bitsandbytes falls back to unpaged states.

The step on CUDA is one fused kernel per tensor updating the states in place (``backends/cuda/ops.py`` allocates no
tensor); on the CPU the backend steps tensor by tensor in fp32 copies (:data:`CPU_8BIT_STEP_COPIES`).

Nothing here imports torch or bitsandbytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from core.optim.base import FP32, Optimizer, Param, Rule, Term

#: entries of bitsandbytes' 8-bit dynamic map (``create_dynamic_map``), fp32
DYNAMIC_MAP_ENTRIES = 256
#: the 8-bit optimizers' block size (``Optimizer2State.init_state``: ``blocksize = 256``)
OPTIM_8BIT_BLOCKSIZE = 256
#: a parameter with fewer elements keeps fp32 states under an 8-bit optimizer (``min_8bit_size=4096``)
OPTIM_8BIT_MIN_SIZE = 4096
#: a paged optimizer pages the states of parameters of at least this many elements (``get_state_buffer``: 1e5)
PAGED_MIN_SIZE = 100_000
#: fp32 copies of a tensor that bitsandbytes' CPU 8-bit AdamW step holds at its peak (``backends/cpu/ops.py``,
#: ``_optimizer_update_8bit_blockwise_cpu``: both moments dequantised, the gradient as fp32 times ``gnorm_scale``,
#: ``sqrt(v)`` and its division; measured 5 x 4 B x n here), and one more for a 16-bit parameter (its fp32 copy)
CPU_8BIT_STEP_COPIES = 5
#: the same for a tensor with fp32 states (``_optimizer_update_32bit_cpu``: the fp32 gradient, ``sqrt(v)`` and its
#: division; measured 3 x 4 B x n), one more for a 16-bit parameter
CPU_32BIT_STEP_COPIES = 3


def _blocks(n: int, size: int) -> int:
    return -(n // -size)


def adamw_8bit_state_bytes(numel: int, fp32_states: bool = False, min_8bit_size: int = OPTIM_8BIT_MIN_SIZE) -> int:
    """Bytes of bitsandbytes' 8-bit AdamW states (both moments) for one parameter of ``numel`` elements, without the
    per-optimizer dynamic maps (:func:`adamw_8bit_maps_bytes`).

    Args:
        numel: elements of the parameter, >= 0.
        fp32_states: the parameter was given 32-bit states (Trainer does this for every ``nn.Embedding`` weight).
        min_8bit_size: bitsandbytes' threshold below which states stay fp32.
    """
    if fp32_states or numel < min_8bit_size:
        return 2 * FP32 * numel
    return 2 * numel + 2 * FP32 * _blocks(numel, OPTIM_8BIT_BLOCKSIZE)


def adamw_8bit_maps_bytes(any_8bit: bool) -> int:
    """The signed and unsigned dynamic maps an 8-bit optimizer keeps once (shared by every 8-bit state), in bytes."""
    return 2 * DYNAMIC_MAP_ENTRIES * FP32 if any_8bit else 0


def adamw_8bit_is_8bit(numel: int, fp32_states: bool = False, min_8bit_size: int = OPTIM_8BIT_MIN_SIZE) -> bool:
    """Whether a parameter of ``numel`` elements gets 8-bit states."""
    return not fp32_states and numel >= min_8bit_size


def _step_on(params: Sequence[Param], kind: str, bits: int) -> Term:
    """The transient bytes of one bitsandbytes AdamW step: none on CUDA; on the CPU the largest tensor's fp32 copies."""
    name = "8-bit" if bits == 8 else "32-bit"
    if kind != "cpu":
        return 0, (f"bitsandbytes' {name} AdamW step on CUDA: one fused kernel per tensor updating the states in place "
                   "(backends/cuda/ops.py allocates no tensor)")
    best, text = 0, ""
    for p in params:
        eight = bits == 8 and adamw_8bit_is_8bit(p.numel, p.kind == "embedding")
        copies = (CPU_8BIT_STEP_COPIES if eight else CPU_32BIT_STEP_COPIES) + (1 if p.dtype != "fp32" else 0)
        if copies * FP32 * p.numel > best:
            best = copies * FP32 * p.numel
            text = (f"bitsandbytes' {name} AdamW step on the CPU, tensor by tensor in fp32: {copies} fp32 copies of "
                    f"the largest, {p.numel:,} elements with {'8-bit' if eight else 'fp32'} states = {copies} x "
                    f"{p.numel:,} x 4 B")
    return best, text


def _paged_text(params: Sequence[Param], kind: str) -> str:
    if kind == "cpu":
        return "; paged: on the CPU bitsandbytes falls back to unpaged states"
    paged = sum(1 for p in params if p.numel >= PAGED_MIN_SIZE)
    return (f"; paged: the moments of the {paged:,} tensors of {PAGED_MIN_SIZE:,} elements or more are in CUDA unified "
            "memory (cudaMallocManaged, outside torch's caching allocator: in NVML's used memory while resident, never "
            "in torch's allocated or reserved); the step prefetches one tensor's to the device before updating it "
            "(Optimizer8bit.step -> prefetch_state): the largest tensor's are planned on the device, the rest off it "
            "(the driver pages them to the host under pressure)")


def paged_moment_bytes(p: Param, bits: int, fp32_states: bool = False) -> int:
    """Bytes of ``p``'s two moments that bitsandbytes allocates paged (``get_state_buffer``: a parameter of at least
    :data:`PAGED_MIN_SIZE` elements): fp32 moments for 32-bit states (or a parameter given 32-bit states), uint8
    moments for 8-bit ones; the 8-bit states' fp32 absmax and the dynamic maps are ordinary device tensors."""
    if p.numel < PAGED_MIN_SIZE:
        return 0
    eight = bits == 8 and adamw_8bit_is_8bit(p.numel, fp32_states)
    return 2 * p.numel * (1 if eight else FP32)


def _pageable(bits: int, embeddings_fp32: bool = True) -> Rule:
    def pageable(params: Sequence[Param], kind: str) -> Term:
        each = [paged_moment_bytes(p, bits, embeddings_fp32 and p.kind == "embedding") for p in params]
        total, resident = sum(each), max(each, default=0)
        return (total - resident,
                f"paged optimizer states: {total:,} B of moments in CUDA unified memory, the largest tensor's "
                f"{resident:,} B planned on the device (prefetched before its update); the other {total - resident:,} B "
                "stay on the device while there is room (NVML's used counts them, torch's allocated and reserved never "
                "do) and are paged to the host under pressure")
    return pageable


def _states_8bit(paged: bool, embeddings_fp32: bool = True) -> Rule:
    def fp32(p: Param) -> bool:
        return embeddings_fp32 and p.kind == "embedding"

    def states(params: Sequence[Param], kind: str) -> Term:
        eight = [p for p in params if adamw_8bit_is_8bit(p.numel, fp32(p))]
        full = [p for p in params if not adamw_8bit_is_8bit(p.numel, fp32(p))]
        total = sum(adamw_8bit_state_bytes(p.numel, fp32(p)) for p in params)
        maps = adamw_8bit_maps_bytes(bool(eight))
        n8, n32 = sum(p.numel for p in eight), sum(p.numel for p in full)
        return (total + maps,
                f"bitsandbytes AdamW8bit (a variant): uint8 moments + an fp32 absmax per 256 elements for {len(eight):,} "
                f"tensors of {n8:,} elements (2 B + 8 B per 256); fp32 moments (8 B) for {len(full):,} tensors of "
                f"{n32:,} elements (under 4,096 elements" + (", or an embedding: Trainer keeps those 32-bit" if embeddings_fp32
                                                       else "") + "); 2 dynamic maps "
                f"{maps:,} B" + (_paged_text(params, kind) if paged else ""))
    return states


def _states_32bit(paged: bool) -> Rule:
    def states(params: Sequence[Param], kind: str) -> Term:
        n = sum(p.numel for p in params)
        return (2 * FP32 * n, f"bitsandbytes AdamW32bit (a variant): 2 fp32 moments whatever the parameter's dtype, "
                              f"2 x {n:,} x 4 B" + (_paged_text(params, kind) if paged else ""))
    return states


def _embeddings(paged: bool) -> Any:
    def configure(optimizer: Optimizer, spec: Any) -> Optimizer:
        """The states with or without transformers' Trainer's fp32 states for embeddings (``embedding_fp32_states``)."""
        fp32 = bool(spec.embedding_fp32_states)
        return replace(optimizer, states=_states_8bit(paged, fp32), pageable=_pageable(8, fp32) if paged else None)
    return configure


def _step(bits: int) -> Rule:
    def step(params: Sequence[Param], kind: str) -> Term:
        return _step_on(params, kind, bits)
    return step


_UNTRACED = "the traced plan steps torch's own optimizers; {} (bitsandbytes) is planned from its layout and measured by the probe"

ADAMW_8BIT = Optimizer(
    name="adamw_8bit", label="AdamW 8-bit (bitsandbytes variant)", library="bitsandbytes", variant=True,
    summary="bitsandbytes' AdamW with 8-bit states: 2 B per parameter + an fp32 absmax per 256",
    states=_states_8bit(False), step=_step(8), trainer_optim="adamw_8bit", needs_bitsandbytes=True,
    configure=_embeddings(False),
    names={"trainer": ("adamw_8bit", "adamw_bnb_8bit"), "torchtune": ("bitsandbytes.optim.AdamW8bit",),
           "litgpt": ("bitsandbytes.optim.AdamW8bit",)},
    untraced=_UNTRACED.format("adamw_8bit"), choice="bitsandbytes variant", state_words="2 uint8 moments with fp32 absmax per 256")

PAGED_ADAMW_8BIT = Optimizer(
    name="paged_adamw_8bit", label="paged AdamW 8-bit (bitsandbytes variant, CUDA)", library="bitsandbytes",
    variant=True, needs_cuda=True, needs_bitsandbytes=True,
    summary="bitsandbytes' AdamW with 8-bit states in CUDA unified memory the driver may page to the host (CUDA only)",
    states=_states_8bit(True), step=_step(8), trainer_optim="paged_adamw_8bit", configure=_embeddings(True),
    pageable=_pageable(8),
    names={"trainer": ("paged_adamw_8bit",), "torchtune": ("bitsandbytes.optim.PagedAdamW8bit",),
           "litgpt": ("bitsandbytes.optim.PagedAdamW8bit",)},
    untraced=_UNTRACED.format("paged_adamw_8bit"), choice="CUDA, variant", state_words="2 uint8 moments with fp32 absmax per 256, paged")

PAGED_ADAMW_32BIT = Optimizer(
    name="paged_adamw_32bit", label="paged AdamW 32-bit (bitsandbytes variant, CUDA)", library="bitsandbytes",
    variant=True, needs_cuda=True, needs_bitsandbytes=True,
    summary="bitsandbytes' AdamW with fp32 states in CUDA unified memory the driver may page to the host (CUDA only)",
    states=_states_32bit(True), step=_step(32), trainer_optim="paged_adamw_32bit", pageable=_pageable(32),
    names={"trainer": ("paged_adamw_32bit", "paged_adamw"), "torchtune": ("bitsandbytes.optim.PagedAdamW32bit",
                                                                           "bitsandbytes.optim.PagedAdamW"),
           "litgpt": ("bitsandbytes.optim.PagedAdamW32bit", "bitsandbytes.optim.PagedAdamW")},
    untraced=_UNTRACED.format("paged_adamw_32bit"), choice="CUDA, variant", state_words="2 fp32 moments, paged")
