"""GaLore (Zhao et al. 2024, arXiv 2403.03507): AdamW over a low-rank projection of each targeted matrix's gradient,
as ``galore_torch.GaLoreAdamW`` runs it (transformers' ``optim: galore_adamw``, LLaMA-Factory's ``use_galore``).

States, read in galore_torch (jiaweizzhao/GaLore ``galore_torch/adamw.py``, ``galore_projector.py``) and measured on
this CPU (docs/trainers.md): for a targeted weight of ``m x n`` (``out x in``) and rank ``r``, with ``proj_type``
``std``, the gradient is projected on its larger side, so both moments are ``max(m, n) x r`` in the parameter's dtype;
the projection matrix is ``r x min(m, n)`` in the parameter's dtype for a 16-bit parameter, and for an fp32 one a
view that keeps the whole SVD factor alive, ``min(m, n)^2 x 4`` B (measured). Every other trained parameter has
AdamW's two moments in its dtype. Full gradients exist (unless layer-wise: one optimizer per parameter stepped in its
gradient hook, as the optimizer in backward). The step: ``2 m n`` + ``3 max(m, n) r`` elements of the dtype for the
largest targeted matrix (measured), and every ``update_proj_gap`` steps an SVD of its gradient (not planned: it runs
one step in 200 by default).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from core.dtypes import dtype_bytes
from core.optim.adamw import default_states
from core.optim.base import FP32, Optimizer, Param, Term, largest

ALL_LINEAR = "all-linear"


def targeted(p: Param, targets: Sequence[str]) -> bool:
    """A parameter GaLore projects: a decoder layer's linear weight (2-D) whose module matches ``targets`` (a name
    or a part of one: LLaMA-Factory's ``galore_target`` matches by substring, ``all`` / ``all-linear`` every one)."""
    if p.kind != "linear" or len(p.shape) != 2 or getattr(p, "unit", "layer") != "layer":
        return False
    module = str(getattr(p, "module", ""))
    groups = {"mlp": ("gate_proj", "up_proj", "down_proj", "fc1", "fc2", "w1", "w2", "w3"),
              "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj", "dense", "qkv_proj")}
    return any(t in (ALL_LINEAR, "all") or t == module or module in groups.get(t, ()) or (t and t in module)
               for t in targets)


def _galore(rank: int, targets: Sequence[str]) -> tuple[Any, Any]:
    def states(params: Sequence[Param], kind: str) -> Term:
        projected = [p for p in params if targeted(p, targets)]
        rest = [p for p in params if not targeted(p, targets)]
        moments = projection = 0
        for p in projected:
            m, n = p.shape
            e = dtype_bytes(p.dtype)
            moments += 2 * max(m, n) * min(rank, min(m, n)) * e
            projection += min(m, n) ** 2 * FP32 if e == FP32 else min(rank, min(m, n)) * min(m, n) * e
        plain, _ = default_states(rest, kind)
        return (moments + projection + plain,
                f"GaLore (rank {rank}) on {len(projected):,} matrices: 2 moments of max(m, n) x r {moments:,} B + the "
                f"projection matrices {projection:,} B (r x min(m, n) in a 16-bit dtype; the whole SVD factor, "
                f"min(m, n)^2 x 4 B, for fp32); AdamW's 2 moments for the {len(rest):,} other trained tensors "
                f"{plain:,} B")

    def step(params: Sequence[Param], kind: str) -> Term:
        projected = [p for p in params if targeted(p, targets)]
        big = largest(projected) or largest(params)
        assert big is not None
        e = dtype_bytes(big.dtype)
        if big in projected:
            m, n = big.shape
            nbytes = 2 * m * n * e + 3 * max(m, n) * rank * e
            return nbytes, (f"GaLore's step on the largest projected matrix: its full-size update and copy + 3 "
                            f"max(m, n) x r tensors = {nbytes:,} B (an SVD of its gradient every update_proj_gap "
                            "steps, not planned)")
        return 2 * big.numel * e, f"per-tensor AdamW step: 2 x {big.numel:,} x {e} B"
    return states, step


def configure(optimizer: Optimizer, spec: Any) -> Optimizer:
    """GaLore with the spec's ``[galore]`` settings (its rank and targets)."""
    states, step = _galore(int(spec.galore.rank), tuple(spec.galore.targets))
    return replace(optimizer, states=states, step=step)


_PLACEHOLDER = _galore(128, (ALL_LINEAR,))

GALORE_ADAMW = Optimizer(
    name="galore_adamw", label="GaLore AdamW (low-rank projected states, variant)", library="galore_torch", variant=True,
    summary="GaLore's AdamW: the moments of each targeted matrix's gradient projected to rank r ([galore] settings)",
    states=_PLACEHOLDER[0], step=_PLACEHOLDER[1], trainer_optim="galore_adamw",
    names={"trainer": ("galore_adamw", "galore_adamw_layerwise")},
    untraced="the traced plan steps torch's own optimizers; GaLore is planned from its layout",
    choice="GaLore variant", configure=configure, own_table="galore")
