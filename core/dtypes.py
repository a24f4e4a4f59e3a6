"""The dtypes gpuaccept plans and runs: their names, bytes per element and torch names, in one place.

A spec's ``dtype`` is one of :data:`DTYPES` (``fp32``, ``bf16``, ``fp16``); the plan counts parameters, gradients,
optimizer states and activations in these names. Anything else (a ``float64`` parameter of a model, a hand-edited
record) raises :class:`core.errors.UnknownDtypeError` naming it: an unknown dtype is never counted as 4 bytes.

Imports nothing heavy (no torch): the names are strings, torch's attribute names (``torch.float32``) are looked up by
the caller.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar, get_args

from core.errors import UnknownDtypeError

T = TypeVar("T")

#: A dtype name of a spec (TOML ``dtype = "bf16"``, flag ``--dtype``).
Dtype = Literal["fp32", "bf16", "fp16"]
DTYPES: tuple[Dtype, ...] = get_args(Dtype)
#: Bytes per element of each dtype.
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
#: torch's attribute name of each dtype (``getattr(torch, TORCH_DTYPE_NAMES["bf16"])`` is ``torch.bfloat16``).
TORCH_DTYPE_NAMES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_FROM_TORCH = {torch_name: name for name, torch_name in TORCH_DTYPE_NAMES.items()}


def _of(table: dict[str, T], name: str) -> T:
    """``table[name]``, or the named error for a dtype gpuaccept does not know (also for a non-string)."""
    try:
        return table[name]
    except (KeyError, TypeError):
        raise UnknownDtypeError(name, DTYPES) from None


def dtype_bytes(name: str) -> int:
    """Bytes per element of the dtype ``name`` (4 for fp32, 2 for bf16 and fp16).

    Raises:
        UnknownDtypeError: ``name`` is not one of :data:`DTYPES`.
    """
    return _of(DTYPE_BYTES, name)


def torch_dtype_name(name: str) -> str:
    """torch's attribute name of the dtype ``name`` (``"bf16"`` -> ``"bfloat16"``).

    Raises:
        UnknownDtypeError: ``name`` is not one of :data:`DTYPES`.
    """
    return _of(TORCH_DTYPE_NAMES, name)


def dtype_name(torch_dtype: Any) -> str:
    """The gpuaccept name of a torch dtype (``torch.bfloat16`` or ``"bfloat16"`` -> ``"bf16"``); a dtype without one
    keeps torch's name (``"float64"``), so that :func:`dtype_bytes` names it when it is counted."""
    text = str(torch_dtype).removeprefix("torch.")
    return _FROM_TORCH.get(text, text)
