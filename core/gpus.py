"""The GPUs gpuaccept knows by name: one table of each product's memory, SMs and compute capability.

Two things read it:

- a box planned by name (``--devices 1xH200``, ``8xA100-80GB``, ``4xRTX4090``; :func:`gpu_named`): the device is given
  the product's name, so the plan assumes what that GPU runs (cuBLAS's 32 MiB workspaces and cuDNN attention on
  Hopper and Blackwell, the CUDA context of its SMs: core/plan/workspace.py, core/plan/context.py), and its capacity
  is the total memory CUDA reports for it (``torch.cuda.get_device_properties(i).total_memory``: what a plan must
  fit in, a little less than the memory on the box, NVIDIA's specification, which the table keeps beside it);
- a GPU seen by torch, by the product name torch reports (``"NVIDIA H100 80GB HBM3"``; :func:`gpu_of_label`).

Sources: SMs and compute capability from NVIDIA's product specifications and the CUDA C++ Programming Guide's
"Technical Specifications per Compute Capability" (resident threads per SM: 2048 for 7.0, 8.0, 9.0, 10.0; 1536 for
8.6, 8.9, 12.0; 1024 for 7.5). The reported totals: the H200's measured by this project's GPU check (2026-12-04,
benchmarks/results/gpu/); the others as public ``_CudaDeviceProperties`` read-outs print them (``total_memory`` in
MiB; the same product reads a few MiB to ~1 % apart between drivers and ECC settings, so a plan near the edge of
a named GPU's memory is judged on that GPU: ``--devices 0`` there). A product with no reported total here has none
and is planned by the SMs only (its capacity given: ``1x24GiB``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MiB = 2**20


@dataclass(frozen=True)
class Gpu:
    """One GPU product.

    Attributes:
        key: its short name on a command line (``H200``, ``A100-80GB``), matched without case, spaces or dashes.
        name: the product name torch reports (``NVIDIA H200``): what a planned device is labelled.
        pattern: a regular expression matching the names torch reports for it.
        sms: streaming multiprocessors (0: the entry stands for several products, which differ).
        threads_per_sm: maximum resident threads per SM (by compute capability).
        capability: compute capability (``"9.0"``).
        memory: NVIDIA's specification of its memory, as NVIDIA writes it (``"141 GB HBM3e"``).
        reported_bytes: the total memory CUDA reports for it (bytes), or None when not known here.
        reported_source: where that total was read.
        aliases: other short names (``H100`` for the SXM part).
    """

    key: str
    name: str
    pattern: str
    sms: int
    threads_per_sm: int
    capability: str
    memory: str
    reported_bytes: int | None = None
    reported_source: str = ""
    aliases: tuple[str, ...] = ()

    @property
    def major(self) -> int:
        """The compute capability's major number (9 for Hopper)."""
        return int(self.capability.split(".")[0])


def _readout(mib: int, what: str) -> tuple[int, str]:
    return mib * MiB, f"torch's total_memory={mib}MB in a public read-out of an {what}"


#: The products, most specific pattern first (an H100 PCIe before the H100)
GPUS: tuple[Gpu, ...] = (
    Gpu("H200", "NVIDIA H200", r"\bH200\b", 132, 2048, "9.0", "141 GB HBM3e", 150_109_880_320,
        "torch's total_memory measured by this project's GPU check on an NVIDIA H200 (2026-12-04)"),
    Gpu("H100-PCIe", "NVIDIA H100 PCIe", r"\bH100\b.*\bPCIe\b", 114, 2048, "9.0", "80 GB HBM2e",
        *_readout(81_008, "NVIDIA H100 PCIe")),
    Gpu("H100", "NVIDIA H100 80GB HBM3", r"\b(GH200|H100|H800)\b", 132, 2048, "9.0", "80 GB HBM3",
        *_readout(81_090, "NVIDIA H100 80GB HBM3 (81,082-81,090 MB seen)"), aliases=("H100-SXM", "H100-80GB")),
    Gpu("B200", "NVIDIA B200", r"\b(B200|GB200)\b", 148, 2048, "10.0", "180 GB HBM3e",
        *_readout(182_631, "NVIDIA B200 (182,631-182,642 MB seen)")),
    Gpu("A100-80GB", "NVIDIA A100-SXM4-80GB", r"\bA100\b.*\b80GB\b|\bA800\b", 108, 2048, "8.0", "80 GB HBM2e",
        *_readout(81_920, "NVIDIA A100-SXM4-80GB")),
    Gpu("A100-40GB", "NVIDIA A100-SXM4-40GB", r"\bA100\b", 108, 2048, "8.0", "40 GB HBM2",
        *_readout(40_536, "A100-SXM4-40GB")),
    Gpu("V100", "Tesla V100", r"\bV100\b", 80, 2048, "7.0", "16 or 32 GB HBM2"),
    Gpu("T4", "Tesla T4", r"\bT4\b", 40, 1024, "7.5", "16 GB GDDR6",
        *_readout(15_109, "NVIDIA Tesla T4 (14,930-15,109 MB seen)")),
    Gpu("A10G", "NVIDIA A10G", r"\bA10G\b", 80, 1536, "8.6", "24 GB GDDR6", *_readout(22_587, "NVIDIA A10G")),
    Gpu("A10", "NVIDIA A10", r"\bA10\b", 72, 1536, "8.6", "24 GB GDDR6"),
    Gpu("A40", "NVIDIA A40", r"\bA40\b", 84, 1536, "8.6", "48 GB GDDR6"),
    Gpu("RTX-A6000", "NVIDIA RTX A6000", r"\bRTX A6000\b", 84, 1536, "8.6", "48 GB GDDR6",
        *_readout(48_676, "NVIDIA RTX A6000"), aliases=("A6000",)),
    Gpu("L40S", "NVIDIA L40S", r"\bL40S\b", 142, 1536, "8.9", "48 GB GDDR6", *_readout(45_589, "NVIDIA L40S")),
    Gpu("L40", "NVIDIA L40", r"\bL40\b", 142, 1536, "8.9", "48 GB GDDR6"),
    Gpu("L4", "NVIDIA L4", r"\bL4\b", 58, 1536, "8.9", "24 GB GDDR6"),
    Gpu("RTX3090", "NVIDIA GeForce RTX 3090", r"\bRTX 3090\b", 82, 1536, "8.6", "24 GB GDDR6X",
        *_readout(24_268, "NVIDIA GeForce RTX 3090 (24,259-24,268 MB seen)")),
    Gpu("RTX4090", "NVIDIA GeForce RTX 4090", r"\bRTX 4090\b", 128, 1536, "8.9", "24 GB GDDR6X",
        *_readout(24_563, "NVIDIA GeForce RTX 4090")),
    Gpu("RTX5090", "NVIDIA GeForce RTX 5090", r"\bRTX 5090\b", 170, 1536, "12.0", "32 GB GDDR7"),
    # the other consumer and workstation Blackwell parts: the generation only (their SMs differ)
    Gpu("RTX-50", "NVIDIA GeForce RTX 5080", r"\bRTX (PRO )?50\d0\b|\bRTX PRO 6000 Blackwell\b", 0, 1536, "12.0",
        "by model"),
)


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def gpu_of_label(label: str) -> Gpu | None:
    """The product a device named ``label`` is (``"NVIDIA H100 80GB HBM3"`` -> H100), or None when the name does not
    say (a planned GPU given by its capacity, a product not in :data:`GPUS`)."""
    return next((g for g in GPUS if re.search(g.pattern, label)), None)


def gpu_named(name: str) -> Gpu | None:
    """The product a command line names (``H200``, ``a100-80gb``, ``RTX 4090``: case, spaces and dashes aside), or
    None when no product has that short name."""
    wanted = _norm(name)
    return next((g for g in GPUS if wanted in (_norm(g.key), *(_norm(a) for a in g.aliases))), None)


def nameable() -> tuple[str, ...]:
    """The short names a box may be planned with: the products whose reported total is known here."""
    return tuple(g.key for g in GPUS if g.reported_bytes is not None)
