"""What an optimizer is to gpuaccept: one object per optimizer, holding every rule that depends on which optimizer runs.

An :class:`Optimizer` says what states it keeps per trained tensor and in which dtype (:meth:`Optimizer.states`), what
its step allocates for a moment (:meth:`Optimizer.step_temporaries`), how gpuaccept's own recipe runs it (the
``TrainingArguments.optim`` name), how the traced plan builds it (torch's own optimizers only), whether it needs CUDA
or bitsandbytes, whether it is a variant (8-bit states, paging: labelled as one, never passed off as AdamW), and the
names each trainer's config uses for it (:attr:`Optimizer.names`). Code outside :mod:`core.optim` asks the optimizer
(``spec.optimizer_kind``, :func:`core.optim.optimizer_of`) instead of comparing optimizer names.

Nothing here imports torch: an optimizer the traced plan can step names its class by path (:attr:`Optimizer.torch_class`)
and :meth:`Optimizer.build` imports that class when called (the importers, which must not import torch, read this
package too).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from core.dtypes import dtype_bytes

FP32 = 4


class Param(Protocol):
    """A trained tensor as the optimizer sees it (``core.plan.meta.ParamInfo`` is one): its elements, dtype name
    (``fp32``, ``bf16`` ...), shape and kind (``linear``, ``embedding``, ``adapter``, ``norm`` ...)."""

    @property
    def numel(self) -> int: ...

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def kind(self) -> str: ...


#: ``(bytes, formula)`` of a state or step term
Term = tuple[int, str]
#: a rule of an optimizer: the trained tensors and the device kind (``cuda`` | ``cpu``) -> its bytes and formula
Rule = Callable[[Sequence[Param], str], Term]


def param_bytes(params: Sequence[Param]) -> int:
    """Bytes of ``params`` in their own dtypes."""
    return sum(p.numel * dtype_bytes(p.dtype) for p in params)


def by_dtype(params: Sequence[Param]) -> str:
    """``"1,234 x 2 B (bf16) + 56 x 4 B (fp32)"``: the elements of ``params`` by dtype, the largest group first."""
    groups: dict[str, int] = {}
    for p in params:
        groups[p.dtype] = groups.get(p.dtype, 0) + p.numel
    if not groups:
        return "0 parameters"
    return " + ".join(f"{n:,} x {dtype_bytes(d)} B ({d})" for d, n in sorted(groups.items(), key=lambda kv: -kv[1]))


def largest(params: Sequence[Param]) -> Param | None:
    """The trained tensor with the most bytes (None for none)."""
    return max(params, key=lambda p: p.numel * dtype_bytes(p.dtype), default=None)


@dataclass(frozen=True)
class Optimizer:
    """One optimizer.

    Attributes:
        name: the spec's ``optimizer`` value (``adamw``, ``adamw_fused``, ``paged_adamw_32bit`` ...).
        label: as a screen lists it; a variant says so ("AdamW 8-bit (bitsandbytes variant)").
        summary: what it keeps, in a sentence (the Setup form's and ``--help``'s words).
        states: the steady-state optimizer states of the trained tensors (:data:`Rule`).
        step: the step's transient buffers (:data:`Rule`).
        trainer_optim: the ``TrainingArguments.optim`` value gpuaccept's own recipe runs it with.
        optim_args: ``TrainingArguments.optim_args`` for it ("" for none).
        names: the names each trainer's config gives it: ``{"trainer": (TrainingArguments.optim values ...),
            "torchtune": (class paths ...), "litgpt": (names and class paths ...)}``; a name may appear under one
            optimizer per tool and implementation.
        implementation: ``default`` (the library's own choice), ``fused`` or ``foreach``: a torch class path names
            several implementations, told apart by its ``fused`` / ``foreach`` argument.
        library: who implements it (``torch``, ``transformers``, ``bitsandbytes``, ``torchao``).
        variant: a variant of a basic optimizer (8-bit or paged states), labelled as one.
        needs_cuda: runs on CUDA only (paged states live in CUDA unified memory); planned anywhere.
        needs_bitsandbytes: runs on bitsandbytes.
        torch_class: the class the traced plan steps and the CPU FSDP probe runs, by its import path
            (``torch.optim.AdamW``), with ``torch_options`` (``{"fused": True}``); "" when only its layout plans it
            (with ``untraced`` saying why).
        foreach: the class takes torch's ``foreach`` (the traced plan passes torch's default for the device).
        untraced: why the traced plan cannot step it ("" when :attr:`torch_class` is set).
        state_words: the states it keeps per trained parameter, in words ("2 AdamW moments": the quiz and the docs).
        choice: a few words beside its name in a form's list ("bitsandbytes variant").
        configure: ``configure(self, spec)`` gives the optimizer as the spec sets it (GaLore's rank and targets,
            bitsandbytes' fp32 states for embeddings), or None for one without settings.
        own_table: the spec table of settings that belong to it alone (GaLore's ``galore``), "" for none.
        pageable: the states the CUDA driver may page to the host (bitsandbytes' paged states beyond the one tensor's
            being stepped; :data:`Rule`, on a device of kind ``cuda`` only), or None for an optimizer without paging.
        state_count: state tensors per trained parameter in the parameter's own dtype (AdamW 2, SGD 1; 0 when its
            states are not so: factored, quantised, or fp32 whatever the parameter's dtype).
    """

    name: str
    label: str
    summary: str
    states: Rule
    step: Rule
    trainer_optim: str
    names: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    optim_args: str = ""
    implementation: str = "default"
    library: str = "torch"
    variant: bool = False
    needs_cuda: bool = False
    needs_bitsandbytes: bool = False
    torch_class: str = ""
    torch_options: Mapping[str, Any] = field(default_factory=dict)
    foreach: bool = False
    untraced: str = ""
    state_words: str = ""
    state_count: int = 0
    choice: str = ""
    configure: Callable[[Optimizer, Any], Optimizer] | None = None
    own_table: str = ""
    pageable: Rule | None = None

    def state_bytes(self, params: Sequence[Param], kind: str = "cuda") -> Term:
        """The states of ``params`` on a device of ``kind`` (bytes, formula)."""
        return self.states(params, kind)

    def pageable_bytes(self, params: Sequence[Param], kind: str = "cuda") -> Term:
        """The part of :meth:`state_bytes` the driver may page to the host (bytes, words); (0, "") without paging."""
        if self.pageable is None or kind != "cuda" or not params:
            return 0, ""
        return self.pageable(params, kind)

    def step_temporaries(self, params: Sequence[Param], kind: str = "cuda") -> Term:
        """The step's transient buffers over ``params`` on a device of ``kind`` (bytes, formula)."""
        if not params:
            return 0, f"{self.label} step: no trained tensor"
        return self.step(params, kind)

    @property
    def traceable(self) -> bool:
        """The traced plan can step it (an optimizer of torch's or transformers' with a class path)."""
        return bool(self.torch_class)

    def build(self, params: list[Any], lr: float, foreach: bool) -> Any:
        """The optimizer over ``params`` at learning rate ``lr`` (``foreach``: torch's default on the device, passed
        where the class takes it and :attr:`torch_options` does not set it), imported by its class path.

        Raises:
            ValueError: no class path (:attr:`traceable` is False; :attr:`untraced` says why).
        """
        import importlib

        if not self.torch_class:
            raise ValueError(self.untraced or f"{self.name} has no class to build")
        module, _, name = self.torch_class.rpartition(".")
        options: dict[str, Any] = {}
        if self.foreach and "fused" not in self.torch_options:
            options["foreach"] = foreach
        return getattr(importlib.import_module(module), name)(params, lr=lr, **options, **dict(self.torch_options))
