"""A spec checked against what only the model knows (:func:`config_problems`: the sequence length against its
positions, the LoRA targets against its linear modules), and a spec drafted from a form's values with every field's
error at once (:func:`draft_spec`: the Setup screen)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from core.errors import SpecError
from core.methods.lora import ALL_LINEAR
from core.spec import RunSpec, by_dest, by_key


def validate_against_config(spec: RunSpec, max_positions: int | None, module_names: set[str] | None = None) -> None:
    """Check the spec against the model (the first of :func:`config_problems`).

    Raises:
        SpecError: sequence length above ``max_position_embeddings``; LoRA target absent from the model.
    """
    problems = config_problems(spec, max_positions, module_names)
    if problems:
        raise problems[0]


def config_problems(spec: RunSpec, max_positions: int | None,
                    module_names: set[str] | None = None) -> list[SpecError]:
    """Everything the model's config refuses about the spec, each as a :class:`SpecError` naming its field.

    Args:
        max_positions: the model's declared ``max_position_embeddings`` (``n_positions``), or None when its config does
            not declare one (a library default is not a property of the model).
        module_names: short names of the model's Linear modules (e.g. ``{"q_proj", ...}``) to check LoRA targets against.

    Returns:
        the errors, at most one per field, in the form's order (sequence length, then LoRA targets); empty when none.
    """
    problems: list[SpecError] = []
    if max_positions is not None and spec.seq_len > int(max_positions) and spec.seq_len_limit == "model":
        problems.append(SpecError(
            "seq_len",
            f"{spec.seq_len} is above the model's max_position_embeddings ({max_positions}); "
            f"use a sequence length of at most {max_positions}",
        ))
    if spec.adapters and module_names is not None and not spec.all_linear:
        missing = [t for t in spec.lora.targets if t not in module_names and t != ALL_LINEAR]
        if missing:
            problems.append(SpecError(
                "lora.targets",
                f"{', '.join(missing)} not found in the model; its linear modules are: {', '.join(sorted(module_names))}",
            ))
    return problems


@dataclass(frozen=True)
class SpecDraft:
    """A spec built from a form's values, with every field's error rather than only the first.

    Attributes:
        spec: the spec, or None when any value is refused.
        stand_in: the spec with each refused value left at its default (None when even that is refused): what the
            rest of the inputs (the model, the data file) can be checked with meanwhile.
        errors: ``SpecError.field`` (``"seq_len"``, ``"lora.r"``) -> its message, in the order found.
    """

    spec: RunSpec | None
    stand_in: RunSpec | None
    errors: dict[str, str]


def draft_spec(values: Mapping[str, Any], refused: Mapping[str, str] | None = None) -> SpecDraft:
    """Build a spec from flat overrides (as :meth:`RunSpec.build` takes them) and collect one error per field.

    :meth:`RunSpec.validate` stops at the first error; here each refused value is dropped (its default takes its place)
    and the spec is built again, so a form can show every field at fault at once. The rules stay in ``validate``.

    Args:
        values: overrides, e.g. ``{"mode": "lora", "seq_len": 1, "lora_r": 0}``.
        refused: errors already found by the caller (e.g. text that is not a number), keyed like ``values``; those
            fields are left at their defaults and reported as given.

    Returns:
        a :class:`SpecDraft`; ``spec`` is None when any error was found. An error whose field is not among ``values``
        (a rule between fields, or a default) ends the search: it is reported and ``stand_in`` is None.
    """
    errors: dict[str, str] = {}
    remaining = dict(values)
    dests, keys = by_dest(), by_key()
    for key, message in (refused or {}).items():
        remaining.pop(key, None)
        errors[dests[key].key if key in dests else key] = message
    for _ in range(len(values) + 1):
        try:
            built = RunSpec.build(**remaining)
        except SpecError as exc:
            key = keys[exc.field].dest if exc.field in keys else exc.field.replace(".", "_", 1)
            errors.setdefault(exc.field, exc.message)
            if key not in remaining or key == "mode":
                return SpecDraft(spec=None, stand_in=None, errors=errors)
            del remaining[key]
            continue
        return SpecDraft(spec=None if errors else built, stand_in=built, errors=errors)
    return SpecDraft(spec=None, stand_in=None, errors=errors)
