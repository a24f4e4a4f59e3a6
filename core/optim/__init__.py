"""The optimizers, one module each: torch's AdamW in its default and fused implementations (core/optim/adamw.py),
SGD with momentum (sgd.py), transformers' Adafactor (adafactor.py), bitsandbytes' 8-bit and paged AdamW (bnb.py), torchao's low-bit AdamW (torchao.py).
Each is a :class:`core.optim.base.Optimizer`: its states and their dtypes, its step's temporaries, paging, what it
needs to run, and the names each trainer's config gives it.

The spec holds the optimizer's name (``optimizer``); :func:`optimizer_of` gives the object. A trainer's name for it
(``adamw_torch_fused``, ``torch.optim.AdamW`` with ``fused: True``, ``bitsandbytes.optim.PagedAdamW8bit``) is read by
:func:`named`. Nothing else compares optimizer names (tests/unit/test_optim.py). A new optimizer is one module and
one entry of :data:`OPTIMIZERS`.
"""

from __future__ import annotations

from core.optim.adafactor import ADAFACTOR
from core.optim.adamw import ADAMW, ADAMW_FUSED
from core.optim.base import Optimizer, Param
from core.optim.bnb import ADAMW_8BIT, PAGED_ADAMW_8BIT, PAGED_ADAMW_32BIT
from core.optim.galore import GALORE_ADAMW
from core.optim.sgd import SGD
from core.optim.torchao import ADAMW_AO_4BIT, ADAMW_AO_8BIT, ADAMW_AO_FP8

#: every optimizer by its spec name, in the order the Setup form lists them
OPTIMIZERS: dict[str, Optimizer] = {o.name: o for o in (ADAMW, ADAMW_FUSED, SGD, ADAFACTOR, ADAMW_8BIT,
                                                         PAGED_ADAMW_8BIT, PAGED_ADAMW_32BIT, ADAMW_AO_8BIT,
                                                         ADAMW_AO_4BIT, ADAMW_AO_FP8, GALORE_ADAMW)}
#: the tools whose names :func:`named` reads (a key of :attr:`Optimizer.names`)
TOOLS = ("trainer", "torchtune", "litgpt")


def optimizer_names() -> tuple[str, ...]:
    """The spec's ``optimizer`` values, in :data:`OPTIMIZERS` order."""
    return tuple(OPTIMIZERS)


def optimizer_of(name: str) -> Optimizer:
    """The optimizer named ``name`` (a spec's ``optimizer``).

    Raises:
        KeyError: no optimizer has that name (the spec names the choices when it is read).
    """
    return OPTIMIZERS[name]


def named(tool: str, name: str, implementation: str = "default") -> Optimizer | None:
    """The optimizer a trainer's config names ``name`` (``tool``: one of :data:`TOOLS`), in ``implementation``
    (``fused`` for a torch class path with ``fused: True``); None when gpuaccept does not model it.

    Raises:
        ValueError: ``tool`` is not one of :data:`TOOLS`.
    """
    if tool not in TOOLS:
        raise ValueError(f"{tool!r} is not one of {', '.join(TOOLS)}")
    found = [o for o in OPTIMIZERS.values() if name in o.names.get(tool, ())]
    if len(found) > 1:
        found = [o for o in found if o.implementation == implementation] or \
            [o for o in found if o.implementation == "default"]
    return found[0] if found else None


def known_names(tool: str) -> tuple[str, ...]:
    """Every name ``tool``'s configs may give an optimizer gpuaccept models (for an error that lists them)."""
    out: list[str] = []
    for o in OPTIMIZERS.values():
        out += [n for n in o.names.get(tool, ()) if n not in out]
    return tuple(out)


__all__ = ["OPTIMIZERS", "TOOLS", "Optimizer", "Param", "known_names", "named", "optimizer_names", "optimizer_of"]
