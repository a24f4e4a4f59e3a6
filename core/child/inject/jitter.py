"""A test-only stand-in for a GPU's run-to-run noise: every optimizer step's gradients multiplied by ``1 + a * N(0, 1)``.

On the CPU, gpuaccept's training runs are bit-identical run to run (docs/architecture.md §6); on a GPU they are not
(reductions reordered by atomics, split-K GEMMs, the attention backward): two runs of the same job drift apart by a few
units in the last bits from their first steps. The resume check must pass a correct resume under that noise and still
fail a broken one, and the CPU tests need the noise to show it. With ``GPUACCEPT_TEST_JITTER=a`` (a relative amplitude,
e.g. ``1e-3``) set, every training process gpuaccept starts, the user's own command included (``sitecustomize.py``
beside this file loads it by path), perturbs each gradient right before each optimizer step through torch's global
optimizer step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``: every ``torch.optim.Optimizer``,
bitsandbytes' too, whatever wraps it). The noise is drawn from a generator of its own, seeded from ``os.urandom`` per
process, so no random stream the run itself draws from (and the resume check compares) is touched, and no two
processes draw the same noise. Records made with it say so (``environment.test_jitter``).

Standard library only at import (it is loaded into the user's Python too); torch is imported when the hook installs.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any

#: the environment variable holding the relative amplitude (unset or empty: no jitter)
JITTER_ENV = "GPUACCEPT_TEST_JITTER"


def amplitude(environ: Any = None) -> float:
    """The relative amplitude asked for in ``environ`` (default ``os.environ``); 0.0 when unset.

    Raises:
        ValueError: the value is not a number in [0, 0.1]."""
    raw = (os.environ if environ is None else environ).get(JITTER_ENV, "").strip()
    if not raw:
        return 0.0
    value = float(raw)
    if not 0.0 <= value <= 0.1:
        raise ValueError(f"{JITTER_ENV}={raw}: give a relative amplitude in [0, 0.1], e.g. 1e-3")
    return value


def install(relative: float) -> None:
    """Register the gradient jitter of ``relative`` amplitude on every optimizer of this process (imports torch)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    install_into(register_optimizer_step_pre_hook, relative)


class _Finder(importlib.abc.MetaPathFinder):
    """Installs the jitter as soon as ``torch.optim.optimizer`` has run (imported by ``import torch``)."""

    def __init__(self, relative: float) -> None:
        self.relative = relative

    def find_spec(self, name: str, import_path: Any, target: Any = None) -> Any:
        if name != "torch.optim.optimizer":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, import_path)
        if spec is None or spec.loader is None:
            return spec
        loader, relative = spec.loader, self.relative

        class Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                hook = module.register_optimizer_step_pre_hook
                install_into(hook, relative)

        spec.loader = Loader()
        return spec


def install_into(register: Any, relative: float) -> None:
    """Like :func:`install`, given ``register_optimizer_step_pre_hook`` (torch may still be importing)."""
    seed = int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)
    generators: dict[Any, Any] = {}

    def jitter(optimizer: Any, args: Any, kwargs: Any) -> None:
        import torch

        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None or grad.is_sparse:
                        continue
                    gen = generators.get(grad.device)
                    if gen is None:
                        gen = generators[grad.device] = torch.Generator(device=grad.device).manual_seed(seed)
                    noise = torch.randn(grad.shape, generator=gen, device=grad.device, dtype=torch.float32)
                    grad.copy_(grad.float() * (1.0 + relative * noise))

    register(jitter)


def install_when_imported(relative: float) -> None:
    """Install now if torch's optimizers are imported, else as soon as they are."""
    module = sys.modules.get("torch.optim.optimizer")
    if module is not None:
        install_into(module.register_optimizer_step_pre_hook, relative)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(relative))
