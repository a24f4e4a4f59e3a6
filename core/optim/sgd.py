"""torch's SGD with momentum 0.9 (gpuaccept's recipe sets it: ``optim_args="momentum=0.9"``): one buffer per trained
tensor, ``momentum_buffer = torch.clone(grad)`` (``torch/optim/sgd.py``), in the parameter's dtype; the step updates in
place."""

from __future__ import annotations

from collections.abc import Sequence

from core.optim.base import Optimizer, Param, Term, by_dtype, param_bytes


def states(params: Sequence[Param], kind: str) -> Term:
    return (param_bytes(params), f"SGD with momentum: 1 buffer x T in each parameter's dtype (clone of the gradient) = "
                                 f"{by_dtype(params)} (0 without momentum)")


def step(params: Sequence[Param], kind: str) -> Term:
    return 0, "SGD step: in-place updates, no temporaries"


SGD = Optimizer(
    name="sgd", label="SGD (momentum 0.9)", summary="torch's SGD with momentum 0.9: one buffer per parameter",
    states=states, step=step, trainer_optim="sgd", optim_args="momentum=0.9",
    names={"trainer": ("sgd",), "torchtune": ("torch.optim.SGD",), "litgpt": ("SGD", "torch.optim.SGD")},
    torch_class="torch.optim.SGD", foreach=True, torch_options={"momentum": 0.9}, state_words="1 momentum buffer", state_count=1)
