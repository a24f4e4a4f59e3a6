"""cuBLAS's and cuDNN's workspaces: memory PyTorch takes through its caching allocator for every (thread, stream) that
runs a matmul on a device, and for each cuDNN attention call, so it counts in peak allocated and reserved (issue 38).
Pure rules, no torch.

Source: pytorch/pytorch ``aten/src/ATen/cuda/CublasHandlePool.cpp`` (line numbers at 26a39059ec58, which behaves as
the 2.11.0 wheel; the 2.9.1-2.13.0 wheels read in their headers and binaries, docs/allocator.md):

- size (:147-150): ``32 MiB for Hopper`` (compute capability 9.0; from 2.12 also 10.x and 12.x, Blackwell), else
  ``:4096:2:16:8`` = 2 x 4 MiB + 8 x 16 KiB = 8.125 MiB; ``CUBLAS_WORKSPACE_CONFIG=:SIZE_KiB:COUNT...`` sums its pairs
  (:134-168).
- allocation (:241-242): ``CUDACachingAllocator::get()->allocate(getChosenWorkspaceSize())``, one per (cuBLAS handle,
  stream) (:251); handles are per (thread, device) (:353-356): the forward's thread and autograd's backward thread
  each get one in training.
- cuBLASLt (:177-206, :283): a separate 1 MiB block per key up to torch 2.11 (``CUBLASLT_WORKSPACE_SIZE``, KiB);
  from 2.12 it shares the cuBLAS block (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``, on by default).

cuDNN's attention (:func:`cudnn_attention_workspace`):

- which backend: ``F.scaled_dot_product_attention`` tries cuDNN attention first when
  ``check_prefer_cudnn_attention()`` holds (pytorch/pytorch ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``
  at 001f694aef6f): ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` not set, the runtime cuDNN newer than 9.15.0, compute
  capability 9.x or 10.x (Hopper, Blackwell); it takes fp16 and bf16 inputs only. The cuDNN version is the
  wheel's, unknown to a plan made elsewhere: the plan assumes the newer one (the larger estimate).
- its workspace: ``aten/src/ATen/native/cudnn/MHA.cpp`` allocates ``mha_graph->get_workspace_size()`` through
  ``CUDACachingAllocator::get()->allocate`` for each call, freed when the call returns. In the backward, cuDNN
  frontend's graph (NVIDIA/cudnn-frontend ``include/cudnn_frontend/node/scaled_dot_product_flash_attention.h``,
  ``SDPABackwardNode::expand_and_infer_properties_node``, at b607105d5ad7) holds a float32 dQ accumulator of
  b x h_q x s_q x d_qk (unless deterministic) and a float32 softmax sum of b x h_q x s_q; the engine's own part is not
  published, so this is a floor of the size. The forward's graph holds no such tensor.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from core.gpus import gpu_of_label

MiB = 2**20
#: the default for compute capability 9.0 (and from torch 2.12, 10.x and 12.x)
LARGE_WORKSPACE = 32 * MiB
#: the default elsewhere, ``:4096:2:16:8``
SMALL_WORKSPACE = 2 * 4096 * 1024 + 8 * 16 * 1024
#: cuBLASLt's own block before 2.12 (``CUBLASLT_WORKSPACE_SIZE`` default 1024 KiB)
LT_WORKSPACE = 1 * MiB
#: Hopper and Blackwell parts core.gpus.GPUS does not list one by one: their generation only (a name not here is not
#: guessed)
GENERATIONS = ((re.compile(r"\bH20\b"), 9), (re.compile(r"\b(B100|B300|GB300)\b"), 10))


def generation(label: str) -> int | None:
    """The compute capability major of a device named ``label`` (``"NVIDIA H200"`` -> 9; core/gpus.py, and
    :data:`GENERATIONS`), or None when the name does not say (a planned GPU given by its capacity)."""
    gpu = gpu_of_label(label)
    if gpu is not None:
        return gpu.major
    return next((major for pattern, major in GENERATIONS if pattern.search(label)), None)


def _version(torch_version: str) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", torch_version)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def cublas_workspaces(label: str, training: bool, torch_version: str,
                      environ: Mapping[str, str] | None = None) -> tuple[list[int], str]:
    """The workspace blocks a step takes on the device named ``label`` (bytes each), and how that was decided.

    Args:
        training: a backward runs (on autograd's own thread: a second cuBLAS handle, a second workspace).
        torch_version: the torch that runs the step (``"2.13.0+cu130"``).
        environ: ``CUBLAS_WORKSPACE_CONFIG``, ``CUBLASLT_WORKSPACE_SIZE``, ``TORCH_CUBLASLT_UNIFIED_WORKSPACE``.
    """
    environ = environ or {}
    major = generation(label)
    version = _version(torch_version)
    large = major == 9 or (version >= (2, 12) and major in (10, 12))
    config = environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    if pairs:
        size, how = sum(int(k) * 1024 * int(n) for k, n in pairs), f"CUBLAS_WORKSPACE_CONFIG={config}"
    elif large:
        size, how = LARGE_WORKSPACE, f"32 MiB: the default for compute capability {major}.x under torch {torch_version}"
    else:
        size = SMALL_WORKSPACE
        how = ("8.125 MiB: the default below Hopper" if major is not None else
               f"8.125 MiB: the default for a GPU whose generation its name ({label!r}) does not say (32 MiB on "
               "Hopper)")
    unified = version >= (2, 12) and environ.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1") not in ("0", "false")
    lt = 0 if unified else int(environ.get("CUBLASLT_WORKSPACE_SIZE", "1024")) * 1024
    threads = 2 if training else 1
    blocks = [size] * threads + ([lt] * threads if lt else [])
    how += (f"; one per thread that runs matmuls ({threads}: " + ("the forward's and autograd's backward thread)"
                                                                  if training else "the forward's)"))
    how += "; cuBLASLt shares it (torch >= 2.12)" if unified else f"; + cuBLASLt's own {lt // 1024} KiB each"
    return blocks, how


#: compute capability majors on which torch tries cuDNN attention first (sdp_utils.cpp check_prefer_cudnn_attention)
CUDNN_ATTENTION_MAJORS = (9, 10)


def cudnn_attention_workspace(label: str, training: bool, attention: str, dtype: str, batch: int, heads: int,
                              seq_len: int, head_dim: int, environ: Mapping[str, str] | None = None
                              ) -> tuple[int, str]:
    """cuDNN attention's backward workspace on the device named ``label`` (bytes), and why that much or none (the
    module's docstring): ``batch x heads x seq_len x (head_dim + 1) x 4`` B, the float32 dQ accumulator and softmax
    sum, when training runs SDPA in fp16/bf16 on compute capability 9.x/10.x; 0 otherwise, with the reason.

    Args:
        attention: the model's ``attn_implementation`` (``sdpa`` reaches cuDNN; ``eager`` and flash-attn do not).
        dtype: the compute dtype (``fp32``, ``bf16``, ``fp16``).
        batch, heads, seq_len, head_dim: the micro-batch, query heads, tokens and head size of one attention call.
        environ: ``TORCH_CUDNN_SDPA_DEPRIORITIZED``.
    """
    environ = environ or {}
    major = generation(label)
    if not training:
        return 0, "no cuDNN attention backward (no training step): its forward holds no workspace tensor"
    if attention != "sdpa":
        return 0, f"attention {attention}: not SDPA, so not cuDNN's"
    if dtype not in ("bf16", "fp16"):
        return 0, f"SDPA in {dtype}: cuDNN attention takes fp16 and bf16 only"
    if major not in CUDNN_ATTENTION_MAJORS:
        return 0, ("SDPA tries flash attention first on this GPU (cuDNN attention first only on compute capability "
                   "9.x/10.x)" if major is not None else
                   f"the GPU's name ({label!r}) does not say its generation: cuDNN attention not assumed (it is tried "
                   "first on Hopper and Blackwell)")
    if environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").strip().lower() in ("1", "true", "on", "yes", "y"):
        return 0, "TORCH_CUDNN_SDPA_DEPRIORITIZED: SDPA tries flash attention first"
    size = batch * heads * seq_len * (head_dim + 1) * 4
    return size, (f"cuDNN attention's backward workspace, at least {size / MiB:.3g} MiB a call: float32 dQ "
                  f"accumulator {batch} x {heads} heads x {seq_len} x {head_dim} x 4 B + softmax sum "
                  f"{batch} x {heads} x {seq_len} x 4 B (cuDNN attention is tried first on compute capability "
                  f"{major}.x when the runtime cuDNN is newer than 9.15.0, assumed; freed after each call, held "
                  "through the replay)")
