"""The training methods, one module each: inference (core/methods/inference.py), full fine-tuning (full.py), LoRA and
its variant QLoRA (lora.py), the variant DoRA (dora.py). Each is a :class:`core.methods.base.Method`: whether it trains, what it trains, which
settings apply to it, its defaults, what it refuses, its name and help on screen, and which spec tables are its own.

The spec holds the method's name (``mode``); ``spec.method`` is the object. Nothing else branches on a method's name
(issue 36: the rest of the tree is moved here step by step; tests/unit/test_methods.py lists what is left).
"""

from __future__ import annotations

from core.methods.base import SETTING_GROUPS, AdaptedLinear, AdapterTerms, Method
from core.methods.dora import DORA
from core.methods.full import BADAM, FULL
from core.methods.inference import INFERENCE
from core.methods.lora import LORA, LORA_INT8, QLORA

#: every method by its name, in the order the Mode screen lists them
METHODS: dict[str, Method] = {m.name: m for m in (INFERENCE, FULL, LORA, QLORA, DORA, LORA_INT8, BADAM)}


def method_of(name: str) -> Method:
    """The method named ``name`` (a spec's ``mode``).

    Raises:
        KeyError: no method has that name (the spec names the choices: ``core.spec.RunSpec.from_dict``).
    """
    return METHODS[name]


def lora_variants() -> tuple[str, ...]:
    """The names of LoRA and its variants (the methods laid out as LoRA is), in :data:`METHODS` order: the values of
    the spec's ``[lora] variant``."""
    return tuple(name for name, m in METHODS.items() if m.layout == LORA.name)


def trains(name: object) -> bool:
    """Whether the method named ``name`` trains, for a record's spec table read as data: a name that is no method
    counts as training (what ``verify`` then recomputes is the training verdicts; the schema check names the mode)."""
    method = METHODS.get(name) if isinstance(name, str) else None
    return True if method is None else method.trains


__all__ = ["METHODS", "SETTING_GROUPS", "AdaptedLinear", "AdapterTerms", "Method", "lora_variants", "method_of",
           "trains"]
