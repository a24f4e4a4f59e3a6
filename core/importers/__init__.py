"""Importers: the YAML configs teams already run, read as a gpuaccept spec (issue 37).

Five formats, one module each, each written from its tool's documented schema:

- TRL's ``trl sft --config`` (:mod:`core.importers.trl`): ``ScriptArguments``, ``SFTConfig`` (transformers'
  ``TrainingArguments``) and ``ModelConfig`` keys in one file;
- axolotl (:mod:`core.importers.axolotl`);
- LLaMA-Factory (:mod:`core.importers.llamafactory`);
- torchtune recipes' configs (:mod:`core.importers.torchtune`);
- LitGPT's ``finetune_full`` / ``finetune_lora`` configs (:mod:`core.importers.litgpt`).

Each maps what moves memory (the model, the micro-batch, the sequence length, packing, precision, LoRA / QLoRA / DoRA
and its targets, gradient checkpointing, the optimizer, the attention implementation, the sharding strategy and the
number of processes) to the spec's keys, says which keys it used (and as what) and which it ignored and why, and
refuses what it cannot plan by name (:class:`core.errors.SpecError` naming the key). :func:`import_config` picks the
format by the file's keys; ``gpuaccept plan their.yml`` and ``run their.yml`` read a spec through it
(``core.spec.RunSpec.build``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core.bounds import InputFileError, YamlBoundsError, check_path, read_input_text, yaml_bounded
from core.errors import SpecError
from core.importers import axolotl, litgpt, llamafactory, torchtune, trl
from core.importers.base import Format, Imported, NeedsValue
from core.spec import YAML_SUFFIXES, RunSpec

#: each format: its name, whether a config is of it (by its keys), and its importer; in the order they are tried
FORMATS = (torchtune.FORMAT, axolotl.FORMAT, llamafactory.FORMAT, trl.FORMAT, litgpt.FORMAT)


def read_yaml(path: Path) -> dict[str, Any]:
    """The YAML mapping in ``path`` (PyYAML's safe loader: no Python objects).

    Raises:
        SpecError: the file is missing, not UTF-8, not YAML, or not a mapping at the top.
    """
    import yaml

    check_path("spec", str(path))
    try:
        text = read_input_text(path, "a trainer's YAML config")
    except FileNotFoundError:
        raise SpecError("spec", f"file {path} not found; give the path of a trainer's YAML config") from None
    except InputFileError as exc:
        raise SpecError("spec", str(exc)) from None
    except OSError as exc:
        raise SpecError("spec", f"{path} cannot be read ({exc.strerror or exc})") from None
    try:
        data = yaml_bounded(text)
    except YamlBoundsError as exc:
        raise SpecError("spec", f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise SpecError("spec", f"{path} is not valid YAML ({str(exc).splitlines()[0]}); fix the file") from None
    if not isinstance(data, dict):
        raise SpecError("spec", f"{path} holds {type(data).__name__}, not a mapping of settings")
    return data


def import_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Imported:
    """The spec a trainer's YAML config at ``path`` describes, with an account of every key
    (:class:`core.importers.base.Imported`).

    Args:
        overrides: the spec settings given on the command line (flat ``dest`` keywords, ``{"seq_len": 2048}``): they
            apply over the file before anything is refused, and give what the file leaves to the data.

    Raises:
        SpecError: the file cannot be read, is of no known format (naming them), or holds a setting the planner
            cannot plan that no flag replaces (naming the key and what to change).
        NeedsValue: the file leaves a value the plan needs to the data (``tokenizer.max_seq_len: null``) and no flag
            gives it (naming the key and the flag).
    """
    path = Path(path)
    return import_data(read_yaml(path), path, overrides)


def build_spec(path: str | Path | None = None, **overrides: Any) -> RunSpec:
    """The spec a file describes, flags over it: a trainer's YAML config (:data:`YAML_SUFFIXES`: read by
    :func:`import_config`, the flags given to it too) or a TOML spec (:meth:`RunSpec.build`); no file, the defaults.

    Args:
        path: the file, or None.
        overrides: flat ``dest`` keywords (the flags), as :meth:`RunSpec.build`'s; ``None`` values are ignored.

    Raises:
        SpecError: as :func:`import_config` and :meth:`RunSpec.build`.
        NeedsValue: as :func:`import_config`.
    """
    if path is not None and Path(path).suffix.lower() in YAML_SUFFIXES:
        given = {k: v for k, v in overrides.items() if v is not None}
        return RunSpec.from_file_values(import_config(path, given).raw(), path, **overrides)
    return RunSpec.build(path, **overrides)


def format_of(data: dict[str, Any]) -> Format | None:
    """The format whose keys ``data`` holds (the first of :data:`FORMATS` that detects it), or None."""
    return next((fmt for fmt in FORMATS if fmt.detect(data)), None)


def import_data(data: dict[str, Any], path: Path, overrides: Mapping[str, Any] | None = None) -> Imported:
    """:func:`import_config` on the mapping ``data`` read from ``path`` (command mode sets the command's flags over
    the file's keys first).

    Raises:
        SpecError: as :func:`import_config`.
    """
    fmt = format_of(data)
    if fmt is not None:
        return fmt.read(data, path, overrides or {})
    raise SpecError("spec", f"{path}: not a config of {', '.join(f.name for f in FORMATS)} (none of their keys: "
                            "e.g. model_name_or_path, base_model, a torchtune model _component_ or a LitGPT train table); give "
                            "one of those, or a gpuaccept TOML spec")


__all__ = ["FORMATS", "YAML_SUFFIXES", "Format", "Imported", "NeedsValue", "build_spec", "format_of", "import_config",
           "import_data", "read_yaml"]
