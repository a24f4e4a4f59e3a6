"""gpuaccept's callback in a user's own Trainer-based script: what the script actually ran, step by step.

:func:`install` waits for ``transformers.trainer`` to be imported by the script (an import hook: a process that never
imports transformers pays nothing) and wraps ``Trainer.__init__`` so that every Trainer gets :class:`Reporter` as a
callback. The reporter appends JSON lines to the events file (``GPUACCEPT_EVENTS``), one object per line:

- ``{"kind": "trainer", ...}`` when training begins: the TrainingArguments that decide memory and the schedule
  (micro-batch, accumulation, precision, checkpointing, optimizer, steps, checkpoint interval, output folder), the
  world size and this process's rank, the model's class and its parameters (all and trainable);
- ``{"kind": "step", "step", "loss", "learning_rate", ...}`` for each logged step (the script's ``logging_steps``),
  with this rank's peak allocated and reserved bytes on CUDA (``torch.cuda.max_memory_allocated``), or its peak RSS
  on the CPU.

Every rank writes its own lines (``rank`` names it); lines are written with one ``write`` each and flushed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import resource
import sys
from typing import Any

#: TrainingArguments fields the record needs: what moves memory and what the resume check compares
ARGUMENTS = ("per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16", "gradient_checkpointing",
             "optim", "learning_rate", "lr_scheduler_type", "max_steps", "num_train_epochs", "save_steps",
             "save_strategy", "logging_steps", "output_dir", "seed")


def _write(path: str, event: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(event, default=str) + "\n")


def _memory() -> dict[str, int]:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {"peak_allocated_bytes": int(torch.cuda.max_memory_allocated()),
                "peak_reserved_bytes": int(torch.cuda.max_memory_reserved())}
    return {"peak_rss_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024}


def reporter_class(path: str) -> type:
    """The callback class writing to ``path`` (made once transformers is imported)."""
    from transformers import TrainerCallback

    class Reporter(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            params = list(model.parameters()) if model is not None else []
            _write(path, {"kind": "trainer", "rank": args.process_index, "world_size": args.world_size,
                          "arguments": {name: getattr(args, name, None) for name in ARGUMENTS},
                          "model": type(model).__name__ if model is not None else None,
                          "parameters": sum(p.numel() for p in params),
                          "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
                          "global_step": state.global_step})

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                _write(path, {"kind": "step", "rank": args.process_index, "step": state.global_step,
                              "loss": logs["loss"], "learning_rate": logs.get("learning_rate"), **_memory()})

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
