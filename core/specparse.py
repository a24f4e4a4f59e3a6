"""A spec file's values read into :class:`core.spec.RunSpec`'s fields: each table found (:func:`table_in`) and its
values checked against the field's declared type (:func:`check_types`, :func:`field_type`), LoRA targets parsed, a LoRA
variant given as ``[lora] variant`` made the mode, and the bounds of a value no field may pass (:data:`MAX_STEPS`,
:data:`MAX_SEED`). Every refusal is a :class:`~core.errors.SpecError` naming the key."""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from core.bounds import check_path, special_file_kind
from core.errors import SpecError
from core.methods import lora_variants, method_of
from core.settings import (
    value_fits,
)


def sub_table(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in known:
            raise SpecError(f"{prefix}.{key}", f"unknown setting; known [{prefix}] settings are: {', '.join(sorted(known))}")
    check_types(cls, raw, prefix + ".")
    return cls(**raw)


def field_type(f: dataclasses.Field, owner: type) -> str:
    """The plain type a field of the spec class ``owner`` is written in (TOML, flags, the record's spec table): ``int``,
    ``float``, ``str`` or ``bool``; a field typed by a ``Literal`` alias of ``owner``'s module (core.spec's ``Mode``,
    ``Strategy`` ...) is the type of its values, ``str``. Any other annotation is returned as written (a sub-table's
    class name)."""
    name = str(f.type)
    alias = vars(sys.modules[owner.__module__]).get(name)
    if get_origin(alias) is Literal:
        return type(get_args(alias)[0]).__name__
    return name


#: The largest integer a spec may hold (int64, what torch and numpy take); steps and seeds have tighter limits below.
MAX_INT = 2**63 - 1


#: The most optimizer steps a spec may ask for: an acceptance run, not a pretraining job.
MAX_STEPS = 1_000_000


#: Seeds reach numpy's generator through transformers' set_seed, which takes 0 <= seed < 2**32.
MAX_SEED = 2**32 - 1


def variant_mode(mode: str, lora_raw: dict[str, Any]) -> str:
    """The mode a spec runs, from ``mode`` and ``[lora] variant`` (a LoRA variant is a setting of the LoRA method, and
    the spec stores it as the mode, so specs written before hash as they did); ``lora_raw["variant"]`` is set to it
    for an adapter mode.

    Raises:
        SpecError: ``lora.variant`` names no variant (core.methods.lora_variants), names one for a mode without
            adapters, or disagrees with a mode that is itself a variant (``mode = "qlora"`` with ``variant = "dora"``).
    """
    variants = lora_variants()
    variant = lora_raw.get("variant")
    if variant is None:
        if mode in variants:
            lora_raw["variant"] = mode
        return mode
    if not isinstance(variant, str) or variant not in variants:
        raise SpecError("lora.variant", f"{variant!r} is not a LoRA variant; choose one of {', '.join(variants)}")
    if mode not in variants:
        if not method_of(variant).variant:  # [lora] variant = "lora" beside a mode without adapters: nothing to do
            return mode
        raise SpecError("lora.variant", f"{variant} is a variant of LoRA and mode {mode} trains no adapters; set "
                                        f"mode = \"lora\" (or \"{variant}\"), or remove the variant")
    if method_of(mode).variant and mode != variant:
        raise SpecError("lora.variant", f"mode {mode} and lora.variant {variant} name two variants; give one of them")
    return variant


def dotted_keys(raw: Mapping[str, Any]) -> set[str]:
    """The keys of a spec's mapping, a table's as ``table.key`` (``{"lora": {"r": 4}}`` -> ``{"lora", "lora.r"}``)."""
    keys = set(raw)
    for name, value in raw.items():
        if isinstance(value, dict):
            keys.update(f"{name}.{key}" for key in value)
    return keys


def table_in(raw: dict[str, Any], name: str) -> dict[str, Any]:
    """The sub-table ``[name]`` of a spec, popped from ``raw``; an empty one when absent.

    Raises:
        SpecError: ``name`` is not a table (``lora = "abc"``, ``resume = 5``, an array of tables ``[[lora]]``).
    """
    value = raw.pop(name, None)
    if value is None:
        return {}
    if not isinstance(value, dict):
        kind = "an array of tables ([[" + name + "]])" if isinstance(value, list) else repr(value)[:40]
        raise SpecError(name, f"must be a table [{name}] with its keys, got {kind}")
    return dict(value)


def parse_targets(value: Any, key: str = "lora.targets") -> tuple[str, ...]:
    """LoRA targets (or ``key``'s module names) as given: a list of module names or one comma-separated string.

    Raises:
        SpecError: anything else (``targets = [1, 2]``).
    """
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, (list, tuple)) and all(isinstance(t, str) for t in value):
        items = list(value)
    else:
        raise SpecError(key, f"give module names as a list of strings, e.g. [\"q_proj\", \"v_proj\"] (got "
                             f"{value!r:.60})")
    return tuple(t.strip() for t in items if t.strip())


def check_types(cls: type, raw: dict[str, Any], prefix: str = "") -> None:
    """Each key of ``raw`` has its field's type; numbers are finite and within :data:`MAX_INT`.

    Raises:
        SpecError: naming the key, what was given and what is expected.
    """
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        value = raw[f.name]
        kind = field_type(f, cls)
        if kind not in ("int", "float", "str", "bool"):  # a sub-table: checked by its own settings
            continue
        if not value_fits(kind, value):  # the one type rule of a setting's kind (core/settings.py)
            raise SpecError(f"{prefix}{f.name}", f"expected {kind}, got {value!r:.60}")
        if kind == "float":
            if not math.isfinite(value):
                raise SpecError(f"{prefix}{f.name}", f"must be a finite number (got {value!r})")
            raw[f.name] = float(value)
        if kind == "int" and abs(value) > MAX_INT:
            raise SpecError(f"{prefix}{f.name}", f"{value} is out of range; at most {MAX_INT:,}")


def check_data_file(data: str) -> None:
    """The ``data`` setting when it is not ``embedded``: an existing ``.txt`` or ``.jsonl`` file (not a FIFO, device or
    socket: core/bounds.py).

    Raises:
        SpecError: naming ``data`` and what to give.
    """
    check_path("data", data)
    path = Path(data)
    kind = special_file_kind(path)
    if kind is not None:
        raise SpecError("data", f"{data} is {kind}, not a file; give 'embedded' or a .txt / .jsonl file")
    if path.suffix not in (".txt", ".jsonl"):
        raise SpecError("data", f"{data!r}: give 'embedded' or a .txt / .jsonl file")
    if not path.is_file():
        raise SpecError("data", f"file {data} not found; give 'embedded' or an existing .txt / .jsonl file")
