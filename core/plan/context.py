"""The CUDA context: device memory a process holds outside PyTorch's caching allocator, by GPU and CUDA setting.

NVML's "used" on a device is torch's reserved memory plus what the process holds outside the allocator. This module
estimates the second part, per process per device, from three pieces (bytes):

1. **Local memory reserved for thread stacks**: ``SMs x max resident threads per SM x stack size``. The driver
   reserves local memory for every thread that can be resident at once, at the per-thread stack size
   (``cudaLimitStackSize`` / ``CU_LIMIT_STACK_SIZE``, 1 KiB by default; CUDA Runtime API, ``cudaDeviceSetLimit``).
   SM counts are NVIDIA's product specifications; the resident threads per SM are the CUDA C++ Programming Guide's
   "Technical Specifications per Compute Capability" (2048 for 7.0, 8.0, 9.0, 10.0; 1536 for 8.6, 8.9, 12.0; 1024 for
   7.5). ``PYTORCH_...`` does not change it; ``cudaDeviceSetLimit(cudaLimitStackSize, n)`` in the program does.
2. **The device heap and the printf FIFO**: ``cudaLimitMallocHeapSize`` 8 MiB and ``cudaLimitPrintfFifoSize`` 1 MiB
   by default (same API reference).
3. **Loaded modules and the driver's own state**, which no public rule gives: the kernels of torch, cuBLAS and the
   rest that the step loads (CUDA loads modules lazily: torch sets ``CUDA_MODULE_LOADING=LAZY`` since 1.13 and CUDA
   12.2 makes it the default), the libraries' handles. **Measured** on one NVIDIA H200 (torch 2.11.0+cu130, driver
   580.159.04; benchmarks/results/gpu/2026-12-04-first-run, NVML used minus torch's reserved, one process): 694.8 MiB
   in inference and 766.8 MiB in training, the same on each of its cells; pieces 1 and 2 (264 + 9 MiB on its 132 SMs)
   subtracted, the rest is :data:`MODULES_INFERENCE` and :data:`MODULES_TRAINING` (a backward loads more kernels).
   Other GPUs and CUDA versions are assumed alike: not measured. The CUDA version of the torch that plans is an input
   all the same: where it is not :data:`MEASURED_CUDA`, the estimate says its module part was measured under another
   CUDA (a CPU-only torch planning for a GPU does not know the box's CUDA, and says nothing).

A GPU whose name is not in :data:`core.gpus.GPUS` (a planned GPU given by its capacity) gets the H200's measured total, said so.
``CUDA_MODULE_LOADING=EAGER`` loads every kernel of every library at start: the estimate is then a floor, and says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from core.gpus import gpu_of_label

MiB = 2**20
#: ``cudaLimitStackSize``'s default: the local memory of one thread's stack
STACK_BYTES = 1024
#: ``cudaLimitMallocHeapSize`` (8 MiB) + ``cudaLimitPrintfFifoSize`` (1 MiB) defaults
HEAP_AND_FIFO = 9 * MiB
#: the H200's measured memory outside the allocator (NVML used - torch reserved), one process, per mode
MEASURED_H200_INFERENCE = 728_563_712
MEASURED_H200_TRAINING = 804_061_184
_H200_STACKS = 132 * 2048 * STACK_BYTES
#: piece 3 (module images and driver state) as the H200 measured it, for inference and for training
MODULES_INFERENCE = MEASURED_H200_INFERENCE - _H200_STACKS - HEAP_AND_FIFO
MODULES_TRAINING = MEASURED_H200_TRAINING - _H200_STACKS - HEAP_AND_FIFO
#: the CUDA of the torch that measured piece 3 (torch 2.11.0+cu130)
MEASURED_CUDA = "13.0"



@dataclass(frozen=True)
class ContextEstimate:
    """Memory outside the caching allocator for one process on one device (bytes), and how it was made."""

    bytes: int
    text: str
    measured_on: str = "NVIDIA H200"


def gpu_shape(label: str) -> tuple[int, int, str] | None:
    """(SMs, max resident threads per SM, compute capability) of the GPU named ``label``, or None when the name does
    not say (a planned GPU, a product not in :data:`core.gpus.GPUS`)."""
    gpu = gpu_of_label(label)
    return (gpu.sms, gpu.threads_per_sm, gpu.capability) if gpu is not None and gpu.sms else None


def cuda_context(label: str, training: bool, environ: Mapping[str, str] | None = None,
                 cuda_version: str | None = None) -> ContextEstimate:
    """The estimate for a process running a step on the GPU named ``label`` (see the module docstring).

    Args:
        label: the product name (``"NVIDIA H100 80GB HBM3"``); a name :data:`core.gpus.GPUS` does not hold gets the H200's
            measured total.
        training: a backward runs (more kernels loaded).
        environ: ``CUDA_MODULE_LOADING`` (EAGER: the estimate is a floor).
        cuda_version: the CUDA the step's torch was built with (``torch.version.cuda``, ``"12.8"``); None when not
            known (a CPU-only torch planning for a GPU elsewhere).
    """
    environ = environ or {}
    modules = MODULES_TRAINING if training else MODULES_INFERENCE
    shape = gpu_shape(label)
    mode = "training" if training else "inference"
    if shape is None:
        total = MEASURED_H200_TRAINING if training else MEASURED_H200_INFERENCE
        text = (f"CUDA context and libraries outside torch's allocator: {total / MiB:.0f} MiB as measured on an H200 "
                f"under CUDA {MEASURED_CUDA} in {mode} (the GPU's name {label!r} does not say its SMs; estimate)")
    else:
        sms, threads, cc = shape
        stacks = sms * threads * STACK_BYTES
        total = stacks + HEAP_AND_FIFO + modules
        text = (f"CUDA context outside torch's allocator (estimate): thread stacks {sms} SMs x {threads} threads x "
                f"1 KiB = {stacks / MiB:.0f} MiB (compute capability {cc}) + heap and printf FIFO 9 MiB + modules and "
                f"driver {modules / MiB:.0f} MiB ({mode}, measured on an H200 under CUDA {MEASURED_CUDA}) = "
                f"{total / MiB:.0f} MiB")
    if cuda_version is not None and cuda_version != MEASURED_CUDA:
        text += (f"; this torch runs CUDA {cuda_version}, the module part was measured under CUDA {MEASURED_CUDA}: "
                 "it may differ (not measured)")
    if environ.get("CUDA_MODULE_LOADING", "").upper() == "EAGER":
        text += "; CUDA_MODULE_LOADING=EAGER loads every kernel at start: more than this (a floor)"
    return ContextEstimate(total, text)


# ------------------------------------------------------------------------------------------------------ NCCL's buffers
#: NCCL's default buffer per connection and protocol (NVIDIA/nccl v2.28.7 ``src/init.cc`` DEFAULT_BUFFSIZE,
#: DEFAULT_LL_BUFFSIZE, DEFAULT_LL128_BUFFSIZE with ``src/include/device.h``'s constants): SIMPLE 1 << 22; LL
#: 8 lines x 512 threads x 8 steps x 16 B; LL128 120 elements x 640 threads x 8 steps x 8 B. Each is overridden by
#: ``NCCL_BUFFSIZE``, ``NCCL_LL_BUFFSIZE``, ``NCCL_LL128_BUFFSIZE``.
NCCL_PROTOCOL_BUFFERS = {"NCCL_BUFFSIZE": 1 << 22, "NCCL_LL_BUFFSIZE": 8 * 512 * 8 * 16,
                         "NCCL_LL128_BUFFSIZE": 120 * 640 * 8 * 8}
#: channels per communicator assumed (NCCL picks them from the topology: more over NVLink than over PCIe; capped by
#: ``NCCL_MAX_NCHANNELS``); not measured here
NCCL_CHANNELS = 16
#: connections whose buffers a rank holds per channel: the ring's and the tree's (one receive side each)
NCCL_CONNECTIONS = 2


def nccl_buffers(environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """NCCL's communicator buffers on one rank's device (bytes; outside torch's allocator) and how: channels x
    connections (ring and tree) x the three protocols' buffers, from NCCL's defaults or the environment. One
    communicator (DDP's and FSDP's default process group)."""
    environ = environ or {}
    sizes = {k: _int(environ.get(k), v) for k, v in NCCL_PROTOCOL_BUFFERS.items()}
    channels = min(NCCL_CHANNELS, _int(environ.get("NCCL_MAX_NCHANNELS"), NCCL_CHANNELS))
    channels = max(channels, _int(environ.get("NCCL_MIN_NCHANNELS"), 0))
    per_connection = sum(sizes.values())
    total = channels * NCCL_CONNECTIONS * per_connection
    changed = [f"{k}={environ[k]}" for k in (*NCCL_PROTOCOL_BUFFERS, "NCCL_MAX_NCHANNELS", "NCCL_MIN_NCHANNELS")
               if k in environ]
    text = (f"NCCL communicator buffers (estimate): {channels} channels (assumed) x {NCCL_CONNECTIONS} connections "
            f"(ring, tree) x (SIMPLE {sizes['NCCL_BUFFSIZE'] / MiB:g} + LL {sizes['NCCL_LL_BUFFSIZE'] / MiB:g} + LL128 "
            f"{sizes['NCCL_LL128_BUFFSIZE'] / MiB:.4g} MiB) = {total / MiB:.0f} MiB"
            + (f" ({', '.join(changed)})" if changed else " (NCCL's defaults)"))
    return total, text


def _int(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default
