"""torch's AdamW (Loshchilov & Hutter 2019, arXiv 1711.05101), in its two implementations that differ in memory.

States (``torch/optim/adamw.py``, ``_init_group``): ``exp_avg`` and ``exp_avg_sq`` are ``torch.zeros_like(param)``, so
two moments in each parameter's own dtype (bf16 moments for a bf16 model), plus ``step``, a float32 scalar per trained
tensor: on the CPU unless the step is fused or capturable, on the parameter's device when fused.

The step:

- ``adamw`` (torch's default implementation: ``foreach`` on CUDA, a loop over the tensors on the CPU): on CUDA
  ``torch._foreach_sqrt(exp_avg_sqs)`` makes one more state's worth at once, T x the parameters' bytes; per tensor
  (the CPU default) ``exp_avg_sq.sqrt() / bias_correction`` makes two copies of a tensor, 2 x the largest one.
- ``adamw_fused`` (``fused=True``, ``torch._fused_adamw_``): one kernel updates the parameters and both moments in
  place: no tensor of the parameters' size is made. transformers' Trainer runs it (``optim="adamw_torch_fused"``).
"""

from __future__ import annotations

from collections.abc import Sequence

from core.dtypes import dtype_bytes
from core.optim.base import FP32, Optimizer, Param, Term, by_dtype, largest, param_bytes

#: Trainer's ``optim`` names of torch's AdamW in its default implementation (``adamw_hf`` and ``adamw`` are old
#: spellings transformers maps to it)
TRAINER_DEFAULT = ("adamw_torch", "adamw_hf", "adamw", "adamw_torch_xla", "adamw_torch_npu_fused")
#: the class path and short names trainers' configs give torch's AdamW
CLASS_PATHS = ("torch.optim.AdamW",)


def _moments(params: Sequence[Param]) -> tuple[int, str]:
    return 2 * param_bytes(params), f"2 moments x T in each parameter's dtype (zeros_like(param)) = 2 x ({by_dtype(params)})"


def default_states(params: Sequence[Param], kind: str) -> Term:
    """AdamW's moments, and its float32 ``step`` scalars where they are: on the CPU device (a CPU run's plan), not on a
    CUDA device (foreach and the loop keep them on the CPU)."""
    moments, text = _moments(params)
    if kind == "cpu":
        return moments + FP32 * len(params), f"AdamW: {text} + a 4 B fp32 step counter per trained tensor ({len(params):,})"
    return moments, f"AdamW: {text}; its step counters are CPU tensors, not on the device"


def fused_states(params: Sequence[Param], kind: str) -> Term:
    """Fused AdamW's moments, and its float32 ``step`` scalars on the parameters' device (fused keeps them there)."""
    moments, text = _moments(params)
    return (moments + FP32 * len(params),
            f"fused AdamW: {text} + a 4 B fp32 step counter per trained tensor on the device ({len(params):,})")


def default_step(params: Sequence[Param], kind: str) -> Term:
    """foreach on CUDA: one more state's worth (``_foreach_sqrt``); per tensor on the CPU: two copies of the largest."""
    if kind == "cuda":
        return (param_bytes(params), f"foreach AdamW (torch's default on CUDA): _foreach_sqrt makes one more state, "
                                     f"T x bytes = {by_dtype(params)}")
    big = largest(params)
    assert big is not None  # Optimizer.step_temporaries asks only with trained tensors
    nbytes = dtype_bytes(big.dtype)
    return (2 * big.numel * nbytes, f"per-tensor AdamW (torch's default on the CPU): sqrt and the division of the "
                                    f"largest trained tensor, 2 x {big.numel:,} x {nbytes} B")


def fused_step(params: Sequence[Param], kind: str) -> Term:
    return 0, "fused AdamW step: one kernel updates parameters and moments in place (torch._fused_adamw_), no temporaries"


ADAMW = Optimizer(
    name="adamw", label="AdamW",
    summary="torch's AdamW as torch picks it (foreach on CUDA, per tensor on the CPU): 2 moments per parameter in its "
            "dtype; the foreach step makes one more state's worth for a moment",
    states=default_states, step=default_step, trainer_optim="adamw_torch",
    names={"trainer": TRAINER_DEFAULT, "torchtune": CLASS_PATHS, "litgpt": ("AdamW", *CLASS_PATHS)},
    torch_class="torch.optim.AdamW", foreach=True, torch_options={"weight_decay": 0.0}, choice="torch's default", state_words="2 AdamW moments", state_count=2)

ADAMW_FUSED = Optimizer(
    name="adamw_fused", label="AdamW (fused)",
    summary="torch's AdamW with fused=True (Trainer's adamw_torch_fused, its default on CUDA): 2 moments per parameter "
            "in its dtype, the step in place with no temporaries",
    states=fused_states, step=fused_step, trainer_optim="adamw_torch_fused", implementation="fused",
    names={"trainer": ("adamw_torch_fused", "adamw_apex_fused"), "torchtune": CLASS_PATHS, "litgpt": ("AdamW", *CLASS_PATHS)},
    torch_class="torch.optim.AdamW", foreach=True, torch_options={"weight_decay": 0.0, "fused": True},
    choice="Trainer's on CUDA", state_words="2 AdamW moments", state_count=2)
