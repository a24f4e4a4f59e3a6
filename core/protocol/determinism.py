"""The resume check's exact mode on CUDA: what the parent asks of a training child whose resume is judged bit for bit
on CUDA (``resume.noise = "off"`` or ``accept.resume_tier = "exact"``: core.stages.noise.deterministic_kernels), where
kernels are not bit-exact by default. The child applies it (core/child/determinism.py):

- ``torch.use_deterministic_algorithms(True)``: an op without a deterministic implementation raises, naming itself,
  rather than running nondeterministically (torch docs, "Reproducibility");
- ``CUBLAS_WORKSPACE_CONFIG=:4096:8``: cuBLAS's deterministic GEMMs need a fixed workspace per stream (CUDA docs,
  cuBLAS "Results reproducibility"; torch asks for it on CUDA 10.2 and later). It must be set before cuBLAS starts,
  so the parent puts it in the child's environment;
- ``torch.backends.cudnn.deterministic = True`` and ``benchmark = False``: cuDNN's algorithm fixed, not autotuned;
- one attention backend, the math one (flash, memory-efficient and cuDNN SDPA disabled): their backward kernels use
  atomics whose order varies between runs.

Standard library only: both sides import it."""

from __future__ import annotations

#: set to "1" in a training child's environment: it runs CUDA's deterministic kernels (core/child/determinism.py)
DETERMINISTIC_ENV = "GPUACCEPT_DETERMINISTIC"
#: cuBLAS's workspace configuration for deterministic results (4096 KiB x 8 buffers per stream)
CUBLAS_WORKSPACE_CONFIG = ":4096:8"
#: what the exact mode asks, in words (the tier's reason in the record says it)
EXACT_MODE_WORDS = ("deterministic kernels asked of every training run (torch.use_deterministic_algorithms, "
                    f"CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE_CONFIG}, cuDNN deterministic, the math attention "
                    "backend)")


def determinism_env() -> dict[str, str]:
    """The environment variables a training child of the exact mode is started with."""
    return {DETERMINISTIC_ENV: "1", "CUBLAS_WORKSPACE_CONFIG": CUBLAS_WORKSPACE_CONFIG}
