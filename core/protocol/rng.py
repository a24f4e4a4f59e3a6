"""The random generators of a training process: their state as Trainer saves it, and a digest to compare them.

Both sides use it: the child (:mod:`core.child.worker`) reports the digest right after Trainer restored a checkpoint and at
the start of every step; the resume check (:mod:`core.stages.resume`) compares those digests with the checkpoint's
``rng_state.pth`` and with the uninterrupted run's (docs/architecture.md §4). Imports torch and numpy when called.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any


def live_rng_state() -> dict[str, Any]:
    """This process's random states in the layout of Trainer's ``rng_state.pth`` (python, numpy, torch CPU, CUDA)."""
    import random

    import numpy as np
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # as Trainer saves it: every device's state under torch.distributed, the current device's otherwise
        distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
        state["cuda"] = torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
    return state


def rng_digest(state: dict[str, Any]) -> dict[str, str]:
    """sha256 (first 16 hex digits) of each random generator's state, by Trainer's key (``python``, ``numpy``, ``cpu``,
    ``cuda``). Two digests are equal exactly when the generators would draw the same numbers next."""
    import numpy as np
    import torch

    def canon(value: Any) -> bytes:
        if torch.is_tensor(value):
            return b"T" + value.cpu().contiguous().numpy().tobytes()
        if isinstance(value, np.ndarray):
            return b"A" + str(value.dtype).encode() + value.tobytes()
        if isinstance(value, (tuple, list)):
            return b"(" + b",".join(canon(v) for v in value) + b")"
        return repr(value).encode()

    return {key: hashlib.sha256(canon(value)).hexdigest()[:16] for key, value in sorted(state.items())
            if key in ("python", "numpy", "cpu", "cuda")}
