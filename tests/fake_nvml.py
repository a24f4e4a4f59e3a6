"""A constructed NVML layer for the monitor cases: the pynvml API over described GPUs, raising pynvml's own exceptions."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml


@dataclass
class FakeGpu:
    """One device as NVML describes it; ``errors`` maps an NVML function name to the pynvml exception class it raises.

    ``used`` is v2 "used" (without driver-reserved memory); v1 reports ``used + reserved``.
    """

    uuid: str
    name: str = "NVIDIA Test GPU"
    bus: str = "00000000:01:00.0"
    total: int = 80 * 2**30
    used: int = 0
    reserved: int = 0
    util: int = 0
    procs: list[tuple[int, int | None]] = field(default_factory=list)
    mps: list[tuple[int, int | None]] = field(default_factory=list)
    mig: list[FakeGpu] = field(default_factory=list)
    gi: int | None = None
    ci: int | None = None
    errors: dict[str, type] = field(default_factory=dict)
    # the health preflight's readings (core/monitor/health.py); a healthy H100 SXM at idle by default
    ecc: bool = True
    ecc_errors: dict[tuple[int, int], int] = field(default_factory=dict)  # (error type, counter type) -> count
    retired_pages: dict[int, int] | None = None  # cause -> pages (None: NotSupported, a GPU with row remapping)
    retired_pending: bool = False
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)  # corrected, uncorrected, pending, failure
    clock_events: int = 0x1  # GPU idle
    clocks: dict[int, tuple[int, int]] = field(default_factory=lambda: {1: (345, 1980), 2: (2619, 2619)})
    pcie: tuple[int, int, int, int] = (1, 5, 16, 16)  # generation, its max, width, its max (idle: gen 1)
    persistence: bool = True
    compute_mode: int = 0
    temperature: int = 31


class FakeNvml:
    """The functions of ``pynvml`` that core.monitor.nvml calls; exception classes and constants are pynvml's own."""

    nvmlMemory_v2 = pynvml.nvmlMemory_v2
    NVML_DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE

    def __init__(self, gpus: list[FakeGpu], init_error: type | None = None, v2: bool = True) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.v2 = v2

    def __getattr__(self, name: str):
        if name.startswith("NVMLError"):
            return getattr(pynvml, name)
        raise AttributeError(name)

    @staticmethod
    def _check(h: FakeGpu, fn: str) -> None:
        if fn in h.errors:
            raise h.errors[fn]()

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error()

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeGpu:
        self._check(self.gpus[i], "nvmlDeviceGetHandleByIndex")
        return self.gpus[i]

    def nvmlDeviceGetUUID(self, h: FakeGpu) -> str:
        self._check(h, "nvmlDeviceGetUUID")
        return h.uuid

    def nvmlDeviceGetName(self, h: FakeGpu) -> str:
        return h.name

    def nvmlDeviceGetPciInfo(self, h: FakeGpu):
        return SimpleNamespace(busId=h.bus)

    def nvmlDeviceGetMemoryInfo(self, h: FakeGpu, version=None):
        self._check(h, "nvmlDeviceGetMemoryInfo")
        if version is not None:
            if not self.v2:
                raise pynvml.NVMLError_FunctionNotFound()
            return SimpleNamespace(total=h.total, used=h.used, reserved=h.reserved, free=h.total - h.used - h.reserved)
        return SimpleNamespace(total=h.total, used=h.used + h.reserved, free=h.total - h.used - h.reserved)

    def nvmlDeviceGetUtilizationRates(self, h: FakeGpu):
        self._check(h, "nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=h.util, memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, h: FakeGpu):
        self._check(h, "nvmlDeviceGetComputeRunningProcesses")
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in h.procs]

    def nvmlDeviceGetMPSComputeRunningProcesses(self, h: FakeGpu):
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in h.mps]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: FakeGpu):
        raise pynvml.NVMLError_NotSupported()

    def nvmlDeviceGetGpuInstanceId(self, h: FakeGpu) -> int:
        if h.gi is None:
            raise pynvml.NVMLError_NotSupported()
        return h.gi

    def nvmlDeviceGetComputeInstanceId(self, h: FakeGpu) -> int:
        if h.ci is None:
            raise pynvml.NVMLError_NotSupported()
        return h.ci

    def nvmlDeviceGetMigMode(self, h: FakeGpu):
        if not h.mig:
            raise pynvml.NVMLError_NotSupported()
        return (pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_ENABLE)

    def nvmlDeviceGetMaxMigDeviceCount(self, h: FakeGpu) -> int:
        return len(h.mig)

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: FakeGpu, n: int) -> FakeGpu:
        return h.mig[n]

    # ---------------------------------------------------------------- the health preflight's queries
    def nvmlDeviceGetEccMode(self, h: FakeGpu):
        state = pynvml.NVML_FEATURE_ENABLED if h.ecc else pynvml.NVML_FEATURE_DISABLED
        return [state, state]

    def nvmlDeviceGetTotalEccErrors(self, h: FakeGpu, error_type: int, counter_type: int) -> int:
        return h.ecc_errors.get((error_type, counter_type), 0)

    def nvmlDeviceGetRetiredPages(self, h: FakeGpu, cause: int) -> list[int]:
        if h.retired_pages is None:
            raise pynvml.NVMLError_NotSupported()
        return [0x1000 * i for i in range(h.retired_pages.get(cause, 0))]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: FakeGpu) -> int:
        if h.retired_pages is None:
            raise pynvml.NVMLError_NotSupported()
        return int(h.retired_pending)

    def nvmlDeviceGetRemappedRows(self, h: FakeGpu):
        if h.remapped_rows is None:
            raise pynvml.NVMLError_NotSupported()
        return h.remapped_rows

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: FakeGpu) -> int:
        self._check(h, "nvmlDeviceGetCurrentClocksEventReasons")
        return h.clock_events

    def nvmlDeviceGetClockInfo(self, h: FakeGpu, clock: int) -> int:
        return h.clocks[clock][0]

    def nvmlDeviceGetMaxClockInfo(self, h: FakeGpu, clock: int) -> int:
        return h.clocks[clock][1]

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: FakeGpu) -> int:
        return h.pcie[0]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: FakeGpu) -> int:
        return h.pcie[1]

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: FakeGpu) -> int:
        self._check(h, "nvmlDeviceGetCurrPcieLinkWidth")
        return h.pcie[2]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: FakeGpu) -> int:
        return h.pcie[3]

    def nvmlDeviceGetPersistenceMode(self, h: FakeGpu) -> int:
        return pynvml.NVML_FEATURE_ENABLED if h.persistence else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetComputeMode(self, h: FakeGpu) -> int:
        return h.compute_mode

    def nvmlDeviceGetTemperature(self, h: FakeGpu, sensor: int) -> int:
        return h.temperature

    def nvmlSystemGetDriverVersion(self) -> str:
        return "580.95.05"

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return 13000

    def nvmlShutdown(self) -> None:
        pass
