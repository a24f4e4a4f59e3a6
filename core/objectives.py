"""What a training step optimises: supervised fine-tuning, or a preference objective of the DPO family. One object per
objective (:class:`Objective`), holding what depends on it: how many sequences an example sends through the policy,
whether a reference model's log-probabilities are needed, the extra forward passes without gradient, and the names
each trainer gives it. Code outside this module asks the objective (``spec.objective_kind``).

What each tool does, read in its code (the tools' commits in docs/trainers.md):

- paired objectives (DPO and its loss variants IPO, APO; ORPO; SimPO / CPO): the chosen and the rejected completion
  of each example are concatenated along the batch, so the policy runs 2b sequences per micro-batch of b pairs (TRL
  ``DPOTrainer._compute_loss`` and ``concatenated_forward``; LLaMA-Factory's ``PairwiseDataCollatorWithPadding``;
  torchtune's ``padded_collate_dpo``);
- the reference (DPO, IPO, APO, KTO): under LoRA the same model with its adapters disabled (TRL ``use_adapter``,
  LLaMA-Factory ``disable_adapter``, torchtune ``disable_adapter``): no second copy; in full fine-tuning a second,
  frozen copy (TRL loads it from the model's path, in fp32 unless ``model_init_kwargs`` says otherwise;
  LLaMA-Factory in the checkpoint's dtype; torchtune in the recipe's dtype); with ``precompute_ref_log_probs`` the
  reference runs once before training and no reference is held or run during it. Every reference forward runs after
  the policy's, under ``torch.no_grad()``, while the policy's saved activations and logits are alive;
- ORPO and SimPO / CPO use no reference;
- KTO is unpaired: b sequences through the policy with gradients, and b "KL" sequences (completions shifted within
  the batch) through the policy and the reference without gradients (TRL ``KTOTrainer._compute_kl_logps``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

#: Where the reference log-probabilities come from: ``auto`` (the tools' rule: the base with adapters disabled under
#: LoRA and its variants, a frozen copy in full fine-tuning), ``copy``, ``adapters`` (disabled on the policy),
#: ``precomputed`` (before training: nothing held or run during it), ``none`` (the objective has no reference)
Reference = Literal["auto", "copy", "adapters", "precomputed", "none"]
REFERENCES: tuple[Reference, ...] = get_args(Reference)
#: Where the reference comes from, in words (a resolved source: not ``auto``)
REFERENCE_WORDS = {"copy": "a frozen copy of the model", "adapters": "the model with its adapters disabled",
                   "precomputed": "log-probabilities precomputed before training", "none": "none"}


@dataclass(frozen=True)
class Objective:
    """One training objective.

    Attributes:
        name: the spec's ``objective`` value (``sft``, ``dpo`` ...).
        label: as a screen says it ("DPO (preference)").
        summary: what it adds to a step's memory, in a sentence.
        policy_rows: sequences an example sends through the policy with gradients (2 for a pair).
        no_grad_rows: sequences an example sends through the policy without gradients (KTO's KL rows).
        reference: the objective uses a reference model's log-probabilities.
        preference: a preference objective (planned, not run by gpuaccept's own recipe, which trains SFT).
        names: the names each tool gives it: ``{"trl": (loss_type values / trainer), "axolotl": (rl values),
            "llamafactory": (stage / pref_loss values), "torchtune": (loss class paths)}``.
    """

    name: str
    label: str
    summary: str
    policy_rows: int = 1
    no_grad_rows: int = 0
    reference: bool = False
    preference: bool = True
    names: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def reference_of(self, reference: str, adapters: bool) -> str:
        """Where the reference comes from for a run with (``adapters``) or without LoRA adapters, ``reference`` being
        the spec's setting: ``copy``, ``adapters``, ``precomputed`` or ``none``."""
        if not self.reference:
            return "none"
        if reference == "auto":
            return "adapters" if adapters else "copy"
        return reference


SFT = Objective("sft", "SFT", "supervised fine-tuning: the next-token cross-entropy over each sequence",
                preference=False)
DPO = Objective(
    "dpo", "DPO (preference)",
    "direct preference optimisation (Rafailov et al. 2023, arXiv 2305.18290) and its loss variants (IPO, APO, hinge): "
    "each pair's chosen and rejected sequences through the policy (2b rows) and a reference forward without gradient",
    policy_rows=2, reference=True,
    names={"trl": ("dpo", "sigmoid", "ipo", "hinge", "apo_zero", "apo_down", "robust", "bco_pair", "sppo_hard", "nca_pair",
                   "exo_pair", "aot", "aot_pair", "discopop", "sft"),
           "axolotl": ("dpo", "ipo"), "llamafactory": ("sigmoid", "hinge", "ipo", "kto_pair"),
           "torchtune": ("torchtune.rlhf.loss.DPOLoss", "torchtune.rlhf.loss.RSOLoss", "torchtune.rlhf.loss.IPOLoss",
                         "torchtune.modules.rlhf.loss.DPOLoss", "torchtune.modules.rlhf.loss.RSOLoss")})
ORPO = Objective(
    "orpo", "ORPO (preference, no reference)",
    "odds-ratio preference optimisation (Hong et al. 2024, arXiv 2403.07691): chosen and rejected through the policy "
    "(2b rows) with the chosen half's cross-entropy; no reference model",
    policy_rows=2, names={"trl": ("orpo",), "axolotl": ("orpo",), "llamafactory": ("orpo",)})
SIMPO = Objective(
    "simpo", "SimPO / CPO (preference, no reference)",
    "SimPO (Meng et al. 2024, arXiv 2405.14734) and CPO: chosen and rejected through the policy (2b rows), "
    "length-normalised log-probabilities; no reference model",
    policy_rows=2, names={"trl": ("simpo", "cpo"), "axolotl": ("simpo",), "llamafactory": ("simpo",)})
KTO = Objective(
    "kto", "KTO (preference, unpaired)",
    "Kahneman-Tversky optimisation (Ethayarajh et al. 2024, arXiv 2402.01306): b sequences through the policy with "
    "gradients, b KL sequences through the policy and the reference without",
    no_grad_rows=1, reference=True, names={"trl": ("kto",), "axolotl": ("kto",), "llamafactory": ("kto",)})

#: every objective by its spec name
OBJECTIVES: dict[str, Objective] = {o.name: o for o in (SFT, DPO, ORPO, SIMPO, KTO)}


def objective_names() -> tuple[str, ...]:
    """The spec's ``objective`` values."""
    return tuple(OBJECTIVES)


def objective_of(name: str) -> Objective:
    """The objective named ``name``.

    Raises:
        KeyError: none has it.
    """
    return OBJECTIVES[name]


def named(tool: str, name: str) -> Objective | None:
    """The objective ``tool`` calls ``name`` (a TRL ``loss_type``, an axolotl ``rl``, a LLaMA-Factory ``stage`` or
    ``pref_loss``, a torchtune loss class), or None."""
    return next((o for o in OBJECTIVES.values() if name in o.names.get(tool, ())), None)


__all__ = ["OBJECTIVES", "REFERENCES", "REFERENCE_WORDS", "Objective", "Reference", "named", "objective_names", "objective_of"]
