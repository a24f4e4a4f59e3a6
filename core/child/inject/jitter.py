"""Perturbations of a training process through torch's optimizer step pre-hook: the test jitter and the twin's nudge.

**The nudge** (``GPUACCEPT_NUDGE_ULP=1``; the resume check's nudged twin, :mod:`core.stages.noise`): before the
process's first optimizer step, every trainable parameter moves by one unit in the last place of its dtype, up or down
at random per element (``torch.nextafter``). It is the smallest difference two runs can have: its growth over the
steps compared is the noise floor a twin that happened to be bit-identical with the reference would not show.

**The jitter**, a test-only stand-in for a GPU's run-to-run noise: every optimizer step's gradients multiplied by
``1 + a * N(0, 1)``.

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
#: the environment variable asking for the twin's nudge (``1``; unset or anything else: none)
NUDGE_ENV = "GPUACCEPT_NUDGE_ULP"


def nudge_asked(environ: Any = None) -> bool:
    """``environ`` (default ``os.environ``) asks for the one-ulp nudge."""
    return (os.environ if environ is None else environ).get(NUDGE_ENV, "").strip() == "1"


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


def install_nudge() -> None:
    """Register the one-ulp nudge (module docstring) on this process's first optimizer step (imports torch)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    nudge_into(register_optimizer_step_pre_hook)


class _Finder(importlib.abc.MetaPathFinder):
    """Installs a hook (``installer(register_optimizer_step_pre_hook)``) as soon as ``torch.optim.optimizer`` has run
    (imported by ``import torch``)."""

    def __init__(self, installer: Any) -> None:
        self.installer = installer

    def find_spec(self, name: str, import_path: Any, target: Any = None) -> Any:
        if name != "torch.optim.optimizer":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, import_path)
        if spec is None or spec.loader is None:
            return spec
        loader, installer = spec.loader, self.installer

        class Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                installer(module.register_optimizer_step_pre_hook)

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


def nudge_into(register: Any) -> None:
    """Like :func:`install_nudge`, given ``register_optimizer_step_pre_hook`` (torch may still be importing): the
    first step of any optimizer moves every floating parameter of its groups by one ulp, each element up or down with
    probability 1/2 (a generator of its own, seeded from ``os.urandom``); later steps are untouched."""
    done: list[bool] = []

    def nudge(optimizer: Any, args: Any, kwargs: Any) -> None:
        if done:
            return
        done.append(True)
        try:
            _nudge_params(optimizer)
        except Exception as exc:  # noqa: BLE001 - the run goes on un-nudged, a noise sample still; said on stderr
            print(f"gpuaccept: the twin's nudge was not applied ({type(exc).__name__}: {exc})", file=sys.stderr)

    register(nudge)


def _nudge_params(optimizer: Any) -> None:
    """Every floating parameter of ``optimizer``'s groups one ulp up or down (a sharded parameter, a DTensor of FSDP2
    or tensor parallelism: its local shard, in place)."""
    import torch

    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1))
    with torch.no_grad():
        for group in optimizer.param_groups:
            for param in group["params"]:
                local = param.to_local() if hasattr(param, "to_local") else param
                if not local.is_floating_point() or local.numel() == 0:
                    continue
                up = torch.rand(local.shape, generator=gen) < 0.5
                toward = torch.where(up, torch.inf, -torch.inf).to(device=local.device, dtype=local.dtype)
                local.copy_(torch.nextafter(local, toward))


def install_when_imported(relative: float = 0.0, nudge: bool = False) -> None:
    """Install the jitter of ``relative`` amplitude (0: none) and the nudge (``nudge``) now if torch's optimizers are
    imported, else as soon as they are."""

    def installer(register: Any) -> None:
        if nudge:
            nudge_into(register)
        if relative:
            install_into(register, relative)

    module = sys.modules.get("torch.optim.optimizer")
    if module is not None:
        installer(module.register_optimizer_step_pre_hook)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(installer))
