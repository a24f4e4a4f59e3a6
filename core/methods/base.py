"""What a training method is: one object per method, holding every rule that depends on which method runs.

A :class:`Method` says whether the run trains, whether it trains adapters over a frozen base, whose parameter layout
it shares, which settings apply to it (:data:`SETTING_GROUPS`), its defaults, what it refuses (its ``checks``), how
it is named and explained, and which spec tables belong to it alone. Code outside :mod:`core.methods` asks the method
(``spec.method``) instead of comparing method names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: The groups of settings a method may take (each form field and spec setting belongs to one):
#: ``all`` every method; ``training`` what a training run needs (steps, optimizer, the resume check, training criteria);
#: ``precision`` the pure/amp choice (a method with a master copy to keep); ``adapter`` LoRA's rank, alpha and targets;
#: ``quant`` the 4-bit storage of the base; ``distributed`` the strategy and torchrun's ranks.
SETTING_GROUPS = ("all", "training", "precision", "adapter", "quant", "distributed")


@dataclass(frozen=True)
class AdaptedLinear:
    """One linear layer with a LoRA adapter, for one micro-batch, as a variant's plan terms see it.

    Attributes:
        tokens: b·s, the micro-batch's tokens.
        fan_in, fan_out: the layer's input and output features (its weight is fan_out x fan_in).
        r: the adapter's rank.
        adapter_bytes: bytes per element the adapter computes in (its input cast to the adapters' dtype; fp32 without
            autocast).
        base_bytes: bytes per element of the frozen base weight.
    """

    tokens: int
    fan_in: int
    fan_out: int
    r: int
    adapter_bytes: int
    base_bytes: int


@dataclass(frozen=True)
class AdapterTerms:
    """What a LoRA variant adds to LoRA's plan for each adapted linear layer (core/plan/activations.py asks it; the
    weights, gradients and optimizer states of its own parameters come from the meta model peft builds with the
    variant's ``peft_options``).

    Attributes:
        saved: the tensors the variant saves for backward beyond LoRA's, ``{what: bytes}`` (each a storage of its own).
        working: bytes alive only inside the layer's forward (freed before the next layer runs).
        method: the plan's words for both, with their source.
    """

    saved: Callable[[AdaptedLinear], Mapping[str, int]]
    working: Callable[[AdaptedLinear], int]
    method: str


@dataclass(frozen=True)
class Method:
    """One training method.

    Attributes:
        name: the spec's ``mode`` value (``inference``, ``full``, ``lora``, ``qlora``).
        label: as the Mode screen lists it; a variant says so ("QLoRA (LoRA variant)").
        summary: what it does and what memory it adds, in a few sentences (the Mode screen's help).
        trains: backward passes and optimizer steps run.
        adapters: low-rank adapters are trained over a frozen base.
        trains_base: every parameter of the base model is trained (full fine-tuning).
        layout: the method whose parameters the model is laid out by (a variant's base method; else ``name``).
        groups: the :data:`SETTING_GROUPS` that apply.
        steps, learning_rate: defaults, chosen so the embedded run finishes on a 2-core CPU in minutes.
        checkpoint_every, kill_after_checkpoint: the resume check's defaults.
        own_tables: spec tables that belong to this method alone (``[qlora]``): refused for another method, left out
            of another method's spec hash.
        fp32_params: every parameter not stored quantised is kept in fp32, whatever the dtype (QLoRA: peft's
            ``prepare_model_for_kbit_training``).
        dtype_note: what the dtype means for this method, for the Setup screen's intro ("" when nothing to add).
        checks: what it refuses, each ``check(spec)`` raising :class:`core.errors.SpecError` (first failure reported).
        run_checks: what it plans but does not run in this version (gpuaccept's own recipe), each ``check(spec)``
            raising :class:`core.errors.SpecError`; asked before a run, never before a plan.
        peft_options: a LoRA variant's keywords to peft's ``LoraConfig`` (``{"use_dora": True}``), used wherever the
            adapters are made (the plan's meta model and the child's model alike).
        adapter_terms: a LoRA variant's plan terms per adapted layer (:class:`AdapterTerms`), or None.
        trained_block: block coordinate descent (BAdam): one decoder layer trained at a time, with an fp32 copy of
            it that the optimizer steps; every other parameter frozen.
        runs: gpuaccept's own recipe runs it (the wizard's Mode screen offers it); False: planned only (a trainer's
            config names it; ``run_checks`` refuses a run by name).
        quantised: how the frozen base's linear layers are stored: ``""`` (in the dtype), ``"4bit"`` (QLoRA:
            bitsandbytes' NF4 / FP4) or ``"int8"`` (LLM.int8).
    """

    name: str
    label: str
    summary: str
    trains: bool
    adapters: bool
    layout: str
    groups: frozenset[str]
    steps: int
    learning_rate: float
    checkpoint_every: int
    kill_after_checkpoint: int
    own_tables: tuple[str, ...] = ()
    trains_base: bool = False
    fp32_params: bool = False
    dtype_note: str = ""
    checks: tuple[Callable[[Any], None], ...] = ()
    run_checks: tuple[Callable[[Any], None], ...] = ()
    peft_options: Mapping[str, Any] = field(default_factory=dict)
    adapter_terms: AdapterTerms | None = None
    quantised: str = ""
    runs: bool = True
    trained_block: bool = False

    @property
    def variant(self) -> bool:
        """A variant of another method (its ``layout``), labelled as such, never passed off as it."""
        return self.layout != self.name

    def takes(self, group: str) -> bool:
        """Whether the settings of ``group`` (:data:`SETTING_GROUPS`) apply to this method.

        Raises:
            ValueError: ``group`` is not a setting group.
        """
        if group not in SETTING_GROUPS:
            raise ValueError(f"{group!r} is not a setting group ({', '.join(SETTING_GROUPS)})")
        return group in self.groups

    def check(self, spec: Any) -> None:
        """Refuse what this method cannot run (see ``checks``).

        Raises:
            SpecError: naming the field and what to change.
        """
        for check in self.checks:
            check(spec)

    def check_run(self, spec: Any) -> None:
        """Refuse what this method plans but gpuaccept's recipe does not run in this version (see ``run_checks``).

        Raises:
            SpecError: naming the field and what to change.
        """
        for check in self.run_checks:
            check(spec)
