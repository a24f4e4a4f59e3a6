"""How gpuaccept starts a Python process of its own (a stage's child, the traced plan, the fork server, the reaper).

Every such process is ``python -P -m core....``: ``-P`` keeps the current directory off ``sys.path`` (a user's own
``core/`` folder must not shadow gpuaccept's), so the child finds gpuaccept only where it is installed. From a tree that
is not installed (a GPU box the tree was copied to, ``python -c "from tui.cli import main"`` in a checkout) the child
would fail with ``No module named 'core'``: :func:`python_env` puts the folder this process imported gpuaccept from
first on the child's ``PYTHONPATH``, so a child always imports the same gpuaccept as its parent. Only gpuaccept's own
processes get it: a user's command (command mode) never does (its ``core`` package is its own).
"""

from __future__ import annotations

import os
import site
import sys
from collections.abc import Mapping
from pathlib import Path


def gpuaccept_root() -> Path:
    """The folder that holds the ``core`` package this process imported (a checkout's root, or site-packages)."""
    return Path(__file__).resolve().parent.parent


def _site_dirs() -> set[Path]:
    dirs = list(getattr(site, "getsitepackages", lambda: [])())
    user = getattr(site, "getusersitepackages", lambda: None)()
    if isinstance(user, str):
        dirs.append(user)
    return {Path(d).resolve() for d in dirs}


def python_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with gpuaccept's root first on ``PYTHONPATH`` (see the module docstring), unless the root is a
    site-packages folder (an installed gpuaccept: Python finds it there, and a site-packages folder put before the
    standard library could shadow it)."""
    out = dict(env)
    root = gpuaccept_root()
    if root in _site_dirs():
        return out
    rest = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != root]
    out["PYTHONPATH"] = os.pathsep.join([str(root), *rest])
    return out


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of gpuaccept's own children (a stage's worker, the traced plan, the fork server): offline,
    unbuffered, gpuaccept importable from where this process imported it (:func:`python_env`), ending themselves when
    this process is gone (``GPUACCEPT_PARENT_PID``, :mod:`core.protocol.lifeline`), and every ``torch.load`` in them
    (Trainer's, peft's, ours) forced to ``weights_only=True`` whatever its call site passes or ``base`` says
    (docs/architecture.md §4: no pickle of arbitrary objects is ever loaded from a checkpoint)."""
    env = python_env(os.environ if base is None else base)
    # the worker ends itself when this process is gone, even under torchrun (whose ranks' parent is torchrun)
    env["GPUACCEPT_PARENT_PID"] = str(os.getpid())
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    env["HF_HUB_OFFLINE"] = "1"  # never download: the model must already be here
    env["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    env.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    env["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    return env


def python_argv(module: str, *args: str) -> list[str]:
    """``[python, -P, -m, module, *args]`` with this process's interpreter."""
    return [sys.executable, "-P", "-m", module, *args]
