"""LoRA (Hu et al. 2021, arXiv 2106.09685): low-rank adapters W + (alpha / r) * B @ A trained over a frozen base, and
its variant QLoRA (Dettmers et al. 2023, arXiv 2305.14314): the same adapters over a base whose linear layers are
stored in 4 bits by bitsandbytes. A variant is labelled as one (``Method.variant``), never passed off as basic LoRA.

Also the one place peft's ``LoraConfig`` is made (:func:`lora_config`): the plan's meta model and the child's model
are wrapped alike.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from typing import Any, Literal, get_args

from core.errors import SpecError
from core.methods.base import Method
from core.methods.training import TRAINING_GROUPS, check_training

#: peft's keyword for "every linear layer but the output layer" (``LoraConfig(target_modules="all-linear")``).
ALL_LINEAR = "all-linear"
#: The 4-bit data types of bitsandbytes (``bnb_4bit_quant_type``): NormalFloat4 (Dettmers et al. 2023, arXiv
#: 2305.14314) or a 4-bit float
QuantType = Literal["nf4", "fp4"]
QUANT_TYPES: tuple[QuantType, ...] = get_args(QuantType)


#: module names ``[lora] targets`` may list (a model has a few hundred kinds of linear layer at most)
MAX_TARGETS = 1_000


def check_adapters(spec: Any) -> None:
    """LoRA's rank, alpha, dropout and targets.

    Raises:
        SpecError: naming the ``lora.*`` field.
    """
    lora = spec.lora
    if lora.r < 1:
        raise SpecError("lora.r", f"the LoRA rank must be at least 1 (got {lora.r})")
    if lora.alpha <= 0:
        raise SpecError("lora.alpha", f"must be positive (got {lora.alpha})")
    if not 0.0 <= lora.dropout < 1.0:
        raise SpecError("lora.dropout", f"must be in [0, 1) (got {lora.dropout})")
    if not lora.targets:
        raise SpecError("lora.targets", "name at least one module, e.g. q_proj,v_proj")
    if len(lora.targets) > MAX_TARGETS:
        raise SpecError("lora.targets", f"{len(lora.targets):,} modules named; a model has at most a few hundred "
                                        f"kinds of linear layer (give at most {MAX_TARGETS:,}, or all-linear)")
    repeated = sorted(t for t, n in Counter(lora.targets).items() if n > 1)  # linear in the list's length
    if repeated:
        shown = ", ".join(repeated[:10]) + (f" and {len(repeated) - 10:,} more" if len(repeated) > 10 else "")
        raise SpecError("lora.targets", f"{shown} named twice; name each module once")
    if ALL_LINEAR in lora.targets and set(lora.targets) - {ALL_LINEAR, "lm_head"}:
        raise SpecError("lora.targets", f"{ALL_LINEAR} already names every linear layer but the LM head; give it "
                                        "alone (or with lm_head), or list module names without it")


def check_qlora(spec: Any) -> None:
    """QLoRA's settings and precision: pure (the 4-bit base has no fp32 master copy).

    Raises:
        SpecError: naming the field.
    """
    if spec.qlora.quant_type not in QUANT_TYPES:
        raise SpecError("qlora.quant_type", f"{spec.qlora.quant_type!r}: choose nf4 (NormalFloat4, QLoRA's) or fp4")
    bitsandbytes_version(spec.qlora.bitsandbytes)  # SpecError("qlora.bitsandbytes") when it is not a version
    if spec.precision != "pure":
        raise SpecError("precision", "qlora stores the base in 4 bits, with no fp32 master copy to keep: set "
                                     "precision = \"pure\" (dtype is the compute dtype the 4-bit layers dequantise to)")


#: bitsandbytes releases before this one kept every 4-bit layer's input for backward: ``MatMul4Bit.forward`` set
#: ``ctx.tensors = (A, B)`` whenever the input needed a gradient (bitsandbytes/autograd/_functions.py at 0.42.0,
#: lines 522-525), though a frozen 4-bit weight never uses it; 0.43.2 keeps none ("fix QLoRA mem bug: delete useless
#: buffered activation", bitsandbytes PR #1270, commit 9e753741).
KEEPS_INPUT_BEFORE = (0, 43, 2)


def bitsandbytes_version(setting: str) -> tuple[int, int, int]:
    """The version ``[qlora] bitsandbytes`` names: ``installed`` reads the installed distribution's metadata (nothing is
    imported); when none is installed, the version this project pins (constraints.txt: 0.50.2).

    Raises:
        SpecError: a value that is neither ``installed`` nor ``MAJOR.MINOR[.PATCH]`` (a suffix such as ``.post1`` or
            ``rc1`` after the numbers is ignored).
    """
    text = setting.strip()
    if text == "installed":
        from importlib.metadata import PackageNotFoundError, version

        try:
            text = version("bitsandbytes")
        except PackageNotFoundError:
            text = PINNED_BITSANDBYTES
    match = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None or len(text) > 40:
        raise SpecError("qlora.bitsandbytes", f"{setting!r} is not a version: give installed or the version the "
                                              "training runs with, such as 0.42.0")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


#: bitsandbytes as constraints.txt pins it (``installed`` when the package is absent)
PINNED_BITSANDBYTES = "0.50.2"


def keeps_4bit_input(spec: Any) -> bool:
    """A 4-bit base whose layers keep their input for backward: bitsandbytes before 0.43.2
    (:data:`KEEPS_INPUT_BEFORE`). Each such layer's input, in the compute dtype, stays alive from its forward to its
    backward whenever it needs a gradient (every layer after the first adapter); inputs shared by several layers
    (q, k and v) are one tensor."""
    return spec.method.quantised == "4bit" and bitsandbytes_version(spec.qlora.bitsandbytes) < KEEPS_INPUT_BEFORE


def check_pure(spec: Any) -> None:
    """A quantised base keeps no fp32 master copy: the precision is pure.

    Raises:
        SpecError: on ``precision``.
    """
    if spec.precision != "pure":
        raise SpecError("precision", f"{spec.mode} stores the base quantised, with no fp32 master copy to keep: set "
                                     "precision = \"pure\" (dtype is the compute dtype the layers dequantise to)")


def planned_only(spec: Any) -> None:
    """A method this version plans but does not run.

    Raises:
        SpecError: on ``mode``, always.
    """
    raise SpecError("mode", f"{spec.mode} is planned (gpuaccept plan), not run by gpuaccept's own recipe in this "
                            "version; run your own trainer on it in command mode (gpuaccept run --command ...)")


def check_qlora_run(spec: Any) -> None:
    """What this version runs QLoRA with: one process (strategy single); it plans the others (FSDP-QLoRA).

    Raises:
        SpecError: on ``strategy``.
    """
    if spec.strategy != "single":
        lora_runs = (f"; mode lora runs {spec.strategy}" if spec.strategy in ("ddp", "zero3")
                     else f"; mode lora plans {spec.strategy}")
        raise SpecError("strategy", f"qlora runs in one process in this version (strategy single), not "
                                    f"{spec.strategy} (it plans it): run the 4-bit base on one device{lora_runs}")


def lora_config(lora: Any, options: Mapping[str, Any] | None = None) -> Any:
    """peft's ``LoraConfig`` for LoRA settings (``core.spec.LoraSettings``), as the probe and the plan both build it
    (``all-linear`` passed as peft's keyword string, module names as a list), with a variant's ``options``
    (``Method.peft_options``: ``{"use_dora": True}``). Imports peft."""
    from peft import LoraConfig

    targets: Any = ALL_LINEAR if tuple(lora.targets) == (ALL_LINEAR,) else list(lora.targets)
    if ALL_LINEAR in lora.targets and len(lora.targets) > 1:  # all-linear and the head: peft's regex over both
        targets = r"^(?!.*lm_head).*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|dense|fc1|fc2|c_attn|" \
                  r"c_proj|c_fc|query_key_value|dense_h_to_4h|dense_4h_to_h|w1|w2|w3|out_proj|qkv_proj|gate_up_proj)$|" \
                  r"^(.*\.)?lm_head$"
    saved = list(getattr(lora, "modules_to_save", ()) or ()) or None  # trained in full: a copy of each
    return LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                      modules_to_save=saved, task_type="CAUSAL_LM", **dict(options or {}))


LORA = Method(
    name="lora", label="LoRA",
    summary="The base is frozen; small low-rank matrices are trained. Gradients and optimizer states only for the "
            "adapters - but activations shrink little (SmolLM2, LoRA on q/v: ~0.75x of full fine-tuning's): backward "
            "still flows through the frozen base.",
    trains=True, adapters=True, layout="lora", groups=TRAINING_GROUPS | {"precision", "adapter", "distributed"},
    steps=30, learning_rate=1e-3, checkpoint_every=10, kill_after_checkpoint=2,
    dtype_note=" (precision: what is kept in it)",
    checks=(check_training, check_adapters))

QLORA = Method(
    name="qlora", label="QLoRA (LoRA variant)",
    summary="LoRA over a base whose linear layers are stored in 4 bits (NF4 or FP4, bitsandbytes): ~0.5 B a parameter, "
            "dequantised layer by layer as they run; embeddings and LM head stay fp32. The same adapters are trained; "
            "activations, adapter gradients and optimizer states are as for LoRA. Slower steps; quality may differ "
            "from LoRA's.",
    trains=True, adapters=True, layout="lora", groups=TRAINING_GROUPS | {"adapter", "quant"},
    steps=30, learning_rate=1e-3, checkpoint_every=10, kill_after_checkpoint=2, own_tables=("qlora",),
    fp32_params=True, dtype_note=" (here the compute dtype of the 4-bit layers)", quantised="4bit",
    checks=(check_training, check_qlora, check_adapters), run_checks=(check_qlora_run,))

LORA_INT8 = Method(
    name="lora_int8", label="LoRA over an 8-bit base (LLM.int8, variant)",
    summary="LoRA over a base whose linear layers are stored in 8 bits by bitsandbytes (LLM.int8: ~1 B a parameter "
            "and an fp32 scale per row), each dequantised in backward; embeddings, norms and the LM head in the "
            "model's dtype. The same adapters as LoRA. Planned only in this version.",
    trains=True, adapters=True, layout="lora", groups=TRAINING_GROUPS | {"adapter"},
    steps=30, learning_rate=1e-3, checkpoint_every=10, kill_after_checkpoint=2, quantised="int8", runs=False,
    dtype_note=" (here the compute dtype the 8-bit layers dequantise to)",
    checks=(check_training, check_pure, check_adapters), run_checks=(planned_only,))
