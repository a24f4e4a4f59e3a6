"""gpuaccept's callback in a user's own Trainer-based script: what the script actually ran, step by step.

This file runs inside the user's process, in the user's Python (which need not be gpuaccept's): it imports nothing of
gpuaccept and only the standard library at import time; torch and transformers are the script's own, imported once the
script has imported them. ``sitecustomize.py`` beside it loads it by file path under a private name.

:func:`install` waits for ``transformers.trainer`` to be imported by the script (an import hook: a process that never
imports transformers pays nothing) and wraps ``Trainer.__init__`` so that every Trainer gets :class:`Reporter` as a
callback (a subclass of Trainer gets it too: the wrapped ``__init__`` is the base class's). The reporter appends JSON
lines to the events file (``GPUACCEPT_EVENTS``; rank r > 0 writes its own file beside it, :func:`rank_path`), one
object per line, each with ``kind``, ``t`` (seconds since the epoch) and ``rank`` (``args.process_index``):

- ``trainer`` when training begins: the TrainingArguments that decide memory and the schedule, the world size, this
  process's local rank and device (with torch's UUID on CUDA), the model's class, its config (``config.to_dict()``),
  its parameters (all, trainable, by dtype, the trainable names' sha256), where they are (bytes per device), peft's
  LoRA settings when the model is a ``PeftModel``, the quantisation config, the optimizer's class and the global step
  it starts from (a resume starts from the checkpoint's);
- ``batches`` at the end of each optimizer step: the sha256 of every micro-batch's ``input_ids`` the model's forward
  received in training mode (a forward pre-hook on the model), their widths (tokens per sequence) and whether an
  attention mask held padding: what the step trained on, comparable between two runs without knowing the data set;
- ``step`` for each logged step (the script's ``logging_steps``): loss and learning rate as Trainer logged them, the
  epoch, and this rank's peak memory so far: on CUDA ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``
  of its device, else the process's peak RSS (``getrusage``, kernel-tracked, not sampled);
- ``save`` after Trainer wrote a checkpoint (``on_save``): its step and folder;
- ``held`` when the step named by ``GPUACCEPT_HOLD_AT_STEP`` has ended (``on_step_end``): the process then sleeps
  until gpuaccept kills it, so the kill of the resume check lands between two checkpoints on any machine's speed;
- ``train_end``: the last global step and the peaks.

A failure inside the reporter is written as ``{"kind": "hook_error"}`` and never stops the user's job.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import json
import os
import resource
import sys
import time
from typing import Any

#: TrainingArguments fields recorded: what moves memory, the schedule and what the resume check compares
ARGUMENTS = ("per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16", "gradient_checkpointing",
             "optim", "learning_rate", "lr_scheduler_type", "warmup_steps", "warmup_ratio", "weight_decay",
             "max_grad_norm", "max_steps", "num_train_epochs", "save_steps", "save_strategy", "save_total_limit",
             "save_only_model", "logging_steps", "output_dir", "seed", "data_seed", "fsdp", "deepspeed",
             "torch_compile", "dataloader_num_workers", "use_cpu", "ddp_backend")

#: the environment variables gpuaccept sets (core/command/process.py reads the same names)
EVENTS_ENV, HOLD_ENV = "GPUACCEPT_EVENTS", "GPUACCEPT_HOLD_AT_STEP"


def rank_path(path: str, rank: int) -> str:
    """The events file of ``rank``: rank 0 writes ``path``, rank r ``<stem>.rank<r><suffix>`` beside it, so the ranks
    of a torchrun job never share a file (a long line, such as a model's config, is written in several system calls
    by a buffered file, and two ranks' lines would interleave)."""
    if not rank:
        return path
    stem, dot, suffix = path.rpartition(".")
    return f"{stem}.rank{rank}.{suffix}" if dot else f"{path}.rank{rank}"


def _write(path: str, event: dict[str, Any]) -> None:
    event.setdefault("t", time.time())
    data = (json.dumps(event, default=str) + "\n").encode("utf-8")
    fd = os.open(rank_path(path, int(event.get("rank", 0) or 0)), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)  # one system call for the whole line
    finally:
        os.close(fd)


def _memory(device: Any = None) -> dict[str, int]:
    """This process's peaks so far: CUDA's allocator on ``device`` when CUDA is in use here, and always its RSS."""
    out = {"peak_rss_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        out["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
        out["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
    return out


def _jsonable(value: Any) -> Any:
    """A TrainingArguments value as JSON can hold it (enums by value, sets as sorted lists, the rest as text)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_jsonable(v) for v in value]
        return sorted(items, key=str) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    inner = getattr(value, "value", None)  # an Enum (IntervalStrategy, OptimizerNames, SchedulerType)
    return inner if isinstance(inner, (str, int, float)) else str(value)


def model_facts(model: Any) -> dict[str, Any]:
    """The model as it trains: class, config, parameters (all, trainable, by dtype and by device, in elements and
    bytes), the sha256 of the sorted trainable names, peft's LoRA settings and the quantisation config."""
    params = list(model.named_parameters())
    by_dtype: dict[str, dict[str, int]] = {}
    by_device: dict[str, int] = {}
    trainable = sorted(n for n, p in params if p.requires_grad)
    for _, p in params:
        side = "trainable" if p.requires_grad else "frozen"
        key = str(p.dtype).replace("torch.", "")
        by_dtype.setdefault(key, {"trainable": 0, "frozen": 0})[side] += int(p.numel())
        by_device[str(p.device)] = by_device.get(str(p.device), 0) + int(p.numel()) * int(p.element_size())
    config = getattr(model, "config", None)
    facts: dict[str, Any] = {
        "model": type(model).__name__,
        "parameters": sum(int(p.numel()) for _, p in params),
        "trainable_parameters": sum(int(p.numel()) for _, p in params if p.requires_grad),
        "parameter_dtypes": by_dtype,
        "placement_bytes": by_device,
        "trainable_tensors": len(trainable),
        "trainable_names_sha256": hashlib.sha256("\n".join(trainable).encode("utf-8")).hexdigest(),
        "config": _jsonable(config.to_dict()) if config is not None and hasattr(config, "to_dict") else None,
        "name_or_path": str(getattr(config, "_name_or_path", "") or ""),
        "libraries": _library_versions(),
        "attn_implementation": str(getattr(config, "_attn_implementation", "") or ""),
        "gradient_checkpointing": _checkpointing(model),
        "quantization": _jsonable(getattr(config, "quantization_config", None)),
    }
    peft = getattr(model, "peft_config", None)
    if isinstance(peft, dict) and peft:
        name = getattr(model, "active_adapter", None)
        cfg = peft.get(name) if isinstance(name, str) and name in peft else next(iter(peft.values()))
        facts["peft"] = {"peft_type": _jsonable(getattr(cfg, "peft_type", None)),
                         "r": getattr(cfg, "r", None), "lora_alpha": getattr(cfg, "lora_alpha", None),
                         "lora_dropout": getattr(cfg, "lora_dropout", None),
                         "target_modules": _jsonable(getattr(cfg, "target_modules", None)),
                         "base_model_name_or_path": str(getattr(cfg, "base_model_name_or_path", "") or ""),
                         # the variant switches (use_dora, use_rslora ...): a LoRA variant is told by them
                         "options": {k: v for k, v in vars(cfg).items() if k.startswith("use_") and isinstance(v, bool)}}
    return facts


#: the training libraries whose installed version the report names (the trainer a command runs, and what it runs on)
LIBRARIES = ("trl", "axolotl", "llamafactory", "torchtune", "litgpt", "transformers", "peft", "accelerate",
             "bitsandbytes", "deepspeed", "torch")


def _library_versions() -> dict[str, str]:
    """The versions of :data:`LIBRARIES` installed in the command's interpreter (those present)."""
    from importlib import metadata

    out: dict[str, str] = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def _checkpointing(model: Any) -> bool:
    """Whether the model recomputes activations: transformers 5's ``is_activation_checkpointing`` (its older name,
    ``is_gradient_checkpointing``, now warns that it is deprecated), the older name on older versions."""
    on = getattr(model, "is_activation_checkpointing", None)
    if on is None:
        on = getattr(model, "is_gradient_checkpointing", False)
    return bool(on)


def reporter_class(path: str) -> type:
    """The callback class writing to ``path`` (made once transformers is imported)."""
    from transformers import TrainerCallback

    hold = int(os.environ.get(HOLD_ENV, "0") or 0)

    class Reporter(TrainerCallback):
        def __init__(self) -> None:
            self.batches: list[str] = []
            self.widths: set[int] = set()
            self.padded = False
            self.rank = 0
            self.device: Any = None
            self.hooked: Any = None

        # ------------------------------------------------------------- what the forward receives in training
        def _pre_forward(self, module: Any, args: Any, kwargs: Any) -> None:
            try:
                if not module.training:
                    return
                ids = kwargs.get("input_ids") if isinstance(kwargs, dict) else None
                if ids is None and args:
                    ids = args[0]
                if ids is None or not hasattr(ids, "shape"):
                    return
                data = ids.detach().to("cpu").contiguous()
                digest = hashlib.sha256(str(tuple(data.shape)).encode() + data.numpy().tobytes()).hexdigest()
                self.batches.append(digest[:16])
                self.widths.add(int(data.shape[-1]))
                mask = kwargs.get("attention_mask") if isinstance(kwargs, dict) else None
                if mask is not None and hasattr(mask, "eq") and bool(mask.eq(0).any()):
                    self.padded = True
            except Exception as exc:  # noqa: BLE001 - the user's job goes on
                self._error("forward pre-hook", exc)

        def _error(self, where: str, exc: BaseException) -> None:
            try:
                _write(path, {"kind": "hook_error", "rank": self.rank, "where": where,
                              "error": f"{type(exc).__name__}: {exc}"[:300]})
            except Exception:  # noqa: BLE001
                pass

        # ------------------------------------------------------------- Trainer's callback events
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                           **kw: Any) -> None:
            try:
                self.rank = int(args.process_index)
                self.device = getattr(args, "device", None)
                event: dict[str, Any] = {
                    "kind": "trainer", "rank": self.rank, "world_size": int(args.world_size),
                    "local_rank": int(getattr(args, "local_process_index", 0)), "pid": os.getpid(),
                    "device": str(self.device), "global_step": int(state.global_step),
                    "arguments": {name: _jsonable(getattr(args, name, None)) for name in ARGUMENTS},
                    # accelerate wraps Trainer's optimizer (AcceleratedOptimizer): the class that steps is inside
                    "optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__
                    if optimizer is not None else None,
                    "transformers": sys.modules["transformers"].__version__,
                    "torch": sys.modules["torch"].__version__ if "torch" in sys.modules else None,
                }
                torch = sys.modules.get("torch")
                if torch is not None and str(self.device).startswith("cuda"):
                    event["device_uuid"] = str(torch.cuda.get_device_properties(self.device).uuid)
                if model is not None:
                    event.update(model_facts(model))
                    if self.hooked is None:
                        self.hooked = model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
                _write(path, event)
            except Exception as exc:  # noqa: BLE001
                self._error("on_train_begin", exc)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            try:
                _write(path, {"kind": "batches", "rank": self.rank, "step": int(state.global_step),
                              "digests": self.batches, "widths": sorted(self.widths), "padded": self.padded})
                self.batches, self.widths, self.padded = [], set(), False
            except Exception as exc:  # noqa: BLE001
                self._error("on_step_end", exc)
            if hold and int(state.global_step) == hold:
                _write(path, {"kind": "held", "rank": self.rank, "step": hold, "pid": os.getpid(),
                              "pgid": os.getpgid(0)})
                while True:  # until gpuaccept's SIGKILL (or its lifeline, if gpuaccept is gone)
                    time.sleep(1.0)

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
                   **kw: Any) -> None:
            try:
                if logs and "loss" in logs:
                    _write(path, {"kind": "step", "rank": self.rank, "step": int(state.global_step),
                                  "loss": logs["loss"], "learning_rate": logs.get("learning_rate"),
                                  "epoch": state.epoch, **_memory(self.device)})
            except Exception as exc:  # noqa: BLE001
                self._error("on_log", exc)

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            try:
                folder = os.path.join(str(args.output_dir), f"checkpoint-{state.global_step}")
                _write(path, {"kind": "save", "rank": self.rank, "step": int(state.global_step), "folder": folder})
            except Exception as exc:  # noqa: BLE001
                self._error("on_save", exc)

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            try:
                _write(path, {"kind": "train_end", "rank": self.rank, "global_step": int(state.global_step),
                              **_memory(self.device)})
            except Exception as exc:  # noqa: BLE001
                self._error("on_train_end", exc)

    return Reporter


def _wrap(module: Any, path: str) -> None:
    trainer = module.Trainer
    if getattr(trainer.__init__, "_gpuaccept", False):
        return
    original = trainer.__init__
    reporter = reporter_class(path)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.add_callback(reporter())

    __init__._gpuaccept = True  # type: ignore[attr-defined]
    trainer.__init__ = __init__


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``transformers.trainer`` is found, wraps its loader so the module is patched as soon
    as it has run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def find_spec(self, name: str, import_path: Any, target: Any = None) -> Any:
        if name != "transformers.trainer":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, import_path)
        if spec is None or spec.loader is None:
            return spec
        loader, events = spec.loader, self.path

        class Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                _wrap(module, events)

        spec.loader = Loader()
        return spec


def install(path: str) -> None:
    """Report every Trainer of this process to ``path`` (a JSON-lines file), now or when transformers' trainer is
    imported."""
    module = sys.modules.get("transformers.trainer")
    if module is not None:
        _wrap(module, path)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(path))
