"""The exact mode applied in a training child (core/protocol/determinism.py says what and why): called first thing
in the worker, before any model or CUDA work."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from core.protocol.determinism import DETERMINISTIC_ENV


def apply_determinism(environ: Mapping[str, str] = os.environ) -> list[str]:
    """Turn on deterministic kernels when ``environ`` asks for them (:data:`DETERMINISTIC_ENV` = "1"); what was set,
    in words (also one line on stderr, the child's log), or [] when not asked."""
    if environ.get(DETERMINISTIC_ENV) != "1":
        return []
    import torch

    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    done = ["torch.use_deterministic_algorithms(True)", "cudnn.deterministic", "cudnn.benchmark off"]
    for name in ("enable_flash_sdp", "enable_mem_efficient_sdp", "enable_cudnn_sdp"):
        switch = getattr(torch.backends.cuda, name, None)  # enable_cudnn_sdp: torch 2.3 and later
        if switch is not None:
            switch(False)
            done.append(f"{name}(False)")
    torch.backends.cuda.enable_math_sdp(True)
    done.append(f"CUBLAS_WORKSPACE_CONFIG={environ.get('CUBLAS_WORKSPACE_CONFIG', 'unset')}")
    print("gpuaccept: exact mode: " + ", ".join(done), file=sys.stderr, flush=True)
    return done
