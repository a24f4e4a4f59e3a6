"""The health preflight: each GPU the probe will use, read from NVML before the probe starts.

A GPU whose memory suffices can still be a bad place to accept a setup on: uncorrected ECC errors, memory rows waiting
for a reset to be remapped (or that could not be), a clock held down by a thermal or hardware slowdown, a PCIe link
trained below its width. :func:`preflight` reads, per device (all through nvidia-ml-py, the ``pynvml`` module):

============================  =====================================================================================
reading                       NVML call (NVML API reference, "Device Queries")
============================  =====================================================================================
ECC mode, pending mode        ``nvmlDeviceGetEccMode``
ECC error counts              ``nvmlDeviceGetTotalEccErrors`` (uncorrected / corrected x volatile / aggregate)
retired pages (before A100)   ``nvmlDeviceGetRetiredPages`` per cause, ``nvmlDeviceGetRetiredPagesPendingStatus``
row remapping (A100 on)       ``nvmlDeviceGetRemappedRows``: corrected, uncorrected, pending, failure
clock event reasons           ``nvmlDeviceGetCurrentClocksEventReasons`` (``...ThrottleReasons`` before driver 535)
clocks                        ``nvmlDeviceGetClockInfo`` / ``nvmlDeviceGetMaxClockInfo`` (SM and memory, MHz)
PCIe link                     ``nvmlDeviceGetCurrPcieLinkGeneration`` / ``Width`` against the ``Max`` ones
persistence, compute mode     ``nvmlDeviceGetPersistenceMode``, ``nvmlDeviceGetComputeMode``
temperature                   ``nvmlDeviceGetTemperature`` (GPU sensor, degrees C)
driver, CUDA driver API       ``nvmlSystemGetDriverVersion``, ``nvmlSystemGetCudaDriverVersion_v2``
============================  =====================================================================================

What is judged, and why (the rules are in core/criteria.py :func:`~core.criteria.judge_health`):

- **Uncorrected ECC errors since the driver loaded** (the volatile counter): an uncorrectable error is a fault now,
  not a history; the aggregate (lifetime) count is recorded beside it.
- **Pending memory repairs**: a retired page (Volta/Turing) or a remapped row (A100, H100, H200) takes effect only
  after a GPU reset; until then the bad memory is in use. A failed row remap means the GPU has no spare row left for
  that bank and needs service (NVIDIA, "GPU Memory Error Management", docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt).
- **Clock event reasons that mean a fault**: HW slowdown, HW thermal slowdown, SW thermal slowdown, HW power brake.
  Idle, the applications-clocks setting, the SW power cap, sync boost and the display clock are the GPU doing as
  configured (NVML's ``nvmlClocksEventReason*`` documentation) and are recorded, not judged.
- **PCIe link width** against the largest the device and this system allow (NVML's "max" is the lower of the GPU's
  and the slot's, so a x16 GPU in a x8 slot reads 8 of 8). The link *generation* drops at idle to save power (NVML:
  "may be reduced when the GPU is not in use"), so it is recorded with that note and not judged.

A reading NVML refuses (NotSupported on a consumer GPU, no permission) is recorded as unread with the reason, and a
criterion over it is "not judged", never passed. Without NVML (no driver, no nvidia-ml-py) or on the CPU the whole
preflight is ``not_run`` with the reason.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from core.criteria import HEALTH_CRITERIA, HealthFacts

#: clock event reasons (NVML's ``nvmlClocksEventReason*`` bits) that mean a fault: the clock is held down by the
#: hardware or by heat, not by the GPU's configuration
FAULT_CLOCK_EVENTS = {0x8: "hw_slowdown", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
                      0x80: "hw_power_brake_slowdown"}
#: the other bits: the GPU doing as configured (recorded, not judged)
OTHER_CLOCK_EVENTS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x10: "sync_boost",
                      0x100: "display_clock_setting", 0x200: "board_limit", 0x400: "reliability"}
COMPUTE_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}
#: why the link generation is not judged (the record and the screen say it beside the value)
PCIE_GEN_NOTE = "the link generation drops at idle to save power: recorded, not judged"


@dataclass(frozen=True)
class DeviceHealth:
    """One device's preflight readings. None: not read (``unread`` says why, by field name).

    Attributes:
        device: the CUDA device as the probe names it (``cuda:0``).
        uuid, name: NVML's.
        ecc_mode, ecc_pending_mode: ``enabled`` / ``disabled`` (pending: after the next reboot).
        ecc_uncorrected_volatile, ecc_corrected_volatile: errors since the driver loaded.
        ecc_uncorrected_aggregate, ecc_corrected_aggregate: errors over the GPU's life.
        retired_pages_single_bit, retired_pages_double_bit: pages retired for each cause (before A100).
        retired_pages_pending: a retirement waits for a reset.
        remapped_rows_corrected, remapped_rows_uncorrected: rows remapped for each error kind (A100 on).
        row_remap_pending, row_remap_failed: a remap waits for a reset; a remap failed.
        clock_events: the active clock event reasons, by name (:data:`FAULT_CLOCK_EVENTS`, :data:`OTHER_CLOCK_EVENTS`).
        sm_clock_mhz, sm_clock_max_mhz, memory_clock_mhz, memory_clock_max_mhz: now and the most, MHz.
        pcie_generation, pcie_generation_max, pcie_width, pcie_width_max: the link now and the most it can train to.
        persistence_mode: ``enabled`` / ``disabled``.
        compute_mode: one of :data:`COMPUTE_MODES`' names.
        temperature_c: the GPU sensor, degrees Celsius.
        unread: field name -> why NVML did not give it.
    """

    device: str
    uuid: str | None = None
    name: str | None = None
    ecc_mode: str | None = None
    ecc_pending_mode: str | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_corrected_volatile: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    ecc_corrected_aggregate: int | None = None
    retired_pages_single_bit: int | None = None
    retired_pages_double_bit: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_corrected: int | None = None
    remapped_rows_uncorrected: int | None = None
    row_remap_pending: bool | None = None
    row_remap_failed: bool | None = None
    clock_events: tuple[str, ...] | None = None
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    memory_clock_mhz: int | None = None
    memory_clock_max_mhz: int | None = None
    pcie_generation: int | None = None
    pcie_generation_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    persistence_mode: str | None = None
    compute_mode: str | None = None
    temperature_c: int | None = None
    unread: Mapping[str, str] = field(default_factory=dict)

    def facts(self) -> HealthFacts:
        """What the health criteria judge (core/criteria.py :func:`~core.criteria.judge_health`)."""
        if self.ecc_mode == "disabled":
            ecc, ecc_why = None, "ECC is disabled on this GPU: errors are not counted"
        else:
            ecc = self.ecc_uncorrected_volatile
            ecc_why = self.unread.get("ecc_uncorrected_volatile", "not read")
        pending = [p for p in (self.retired_pages_pending, self.row_remap_pending) if p is not None]
        repairs = sum(int(p) for p in pending) if pending else None
        repairs_why = "; ".join(self.unread.get(k, "not read") for k in ("retired_pages_pending", "row_remap_pending"))
        fault = (tuple(e for e in self.clock_events if e in FAULT_CLOCK_EVENTS.values())
                 if self.clock_events is not None else None)
        return HealthFacts(
            on=self.device, ecc_uncorrected=ecc, ecc_why=ecc_why, ecc_aggregate=self.ecc_uncorrected_aggregate,
            pending_repairs=repairs, repairs_why=repairs_why, remap_failed=bool(self.row_remap_failed),
            fault_clock_events=fault, clock_events=self.clock_events or (),
            clock_why=self.unread.get("clock_events", "not read"),
            pcie_width=self.pcie_width, pcie_width_max=self.pcie_width_max,
            pcie_why=self.unread.get("pcie_width", self.unread.get("pcie_width_max", "not read")))

    def to_table(self) -> dict[str, Any]:
        """The record's row (None left out: TOML has no null; ``unread`` says why a reading is missing)."""
        row: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or (f.name == "unread" and not value):
                continue
            row[f.name] = list(value) if isinstance(value, tuple) else dict(value) if f.name == "unread" else value
        return row

    @classmethod
    def from_table(cls, row: Mapping[str, Any]) -> DeviceHealth:
        """A device read back from a record's row (keys it does not know are ignored: a newer record's extra
        readings do not change what is judged).

        Raises:
            KeyError: the row has no ``device``.
        """
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in row.items() if k in known}
        if isinstance(values.get("clock_events"), list):
            values["clock_events"] = tuple(values["clock_events"])
        return cls(**{"device": row["device"], **values})


@dataclass(frozen=True)
class HealthReport:
    """The preflight of one node: ``status`` ``measured`` or ``not_run`` (``reason`` says why), the driver and the
    CUDA version the driver supports, and one :class:`DeviceHealth` per device the probe uses."""

    status: str
    reason: str = ""
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    devices: tuple[DeviceHealth, ...] = ()

    @property
    def ran(self) -> bool:
        return self.status == "measured"

    def facts(self) -> list[HealthFacts]:
        """Each device's facts for the criteria (none when the preflight did not run)."""
        return [d.facts() for d in self.devices] if self.ran else []

    def to_table(self) -> dict[str, Any]:
        """The record's ``probe.health`` table."""
        table: dict[str, Any] = {"status": self.status}
        if self.reason:
            table["reason"] = self.reason
        for key in ("driver_version", "cuda_driver_version"):
            if getattr(self, key) is not None:
                table[key] = getattr(self, key)
        if self.ran:
            table["pcie_generation_note"] = PCIE_GEN_NOTE
            table["devices"] = [d.to_table() for d in self.devices]
        return table

    @classmethod
    def from_table(cls, table: Mapping[str, Any] | None) -> HealthReport | None:
        """A report read back from a record's ``probe.health`` (None: the record has none, as before it existed)."""
        if not table:
            return None
        return cls(str(table.get("status", "not_run")), str(table.get("reason", "")), table.get("driver_version"),
                   table.get("cuda_driver_version"),
                   tuple(DeviceHealth.from_table(r) for r in table.get("devices", []) if isinstance(r, Mapping)))

    def summary(self) -> str:
        """One line for the log and the headless run: ``health preflight: cuda:0 NVIDIA H200: ECC on, 0 uncorrected,
        ...`` or ``health preflight not run: <reason>``."""
        if not self.ran:
            return f"health preflight not run: {self.reason}"
        return "health preflight: " + "; ".join(device_line(d) for d in self.devices)


def device_line(d: DeviceHealth) -> str:
    """A device's readings in one line (the screen's table says the same in columns)."""
    parts = [f"{d.device} {d.name or ''}".strip()]
    if d.ecc_mode == "disabled":
        parts.append("ECC off")
    elif d.ecc_uncorrected_volatile is not None:
        parts.append(f"ECC uncorrected {d.ecc_uncorrected_volatile} (life {_n(d.ecc_uncorrected_aggregate)})")
    if d.row_remap_pending is not None:
        parts.append("row remap " + ("FAILED" if d.row_remap_failed else "pending" if d.row_remap_pending else "none pending"))
    elif d.retired_pages_pending is not None:
        parts.append("page retirement " + ("pending" if d.retired_pages_pending else "none pending"))
    if d.clock_events is not None:
        parts.append("clocks: " + (", ".join(d.clock_events) or "no event"))
    if d.pcie_width is not None:
        parts.append(f"PCIe gen {_n(d.pcie_generation)}/{_n(d.pcie_generation_max)} x{d.pcie_width}/x{_n(d.pcie_width_max)}")
    return ", ".join(parts)


#: the columns of :func:`health_table`
HEALTH_COLUMNS = ("device", "ECC uncorr. now/life", "repairs pending", "clock events", "PCIe gen, width", "criteria")


def health_table(report: Any, judgements: Sequence[Any] = ()) -> list[list[str]]:
    """A row per device for the Probe screen (:data:`HEALTH_COLUMNS`): the readings the criteria judge and, last,
    the health criteria it missed or "met" (``judgements``: the probe's rows, :class:`~core.criteria.Judgement`)."""
    rows = []
    for d in report.devices if report is not None and report.ran else ():
        mine = [j for j in judgements if j.on.split(" ", 1)[0] == d.device and j.criterion in HEALTH_CRITERIA]
        bad = [j.criterion for j in mine if j.met is False]
        unjudged = [j.criterion for j in mine if j.met is None]
        verdict = ("MISSED " + ", ".join(bad) if bad else "met") + (f" ({len(unjudged)} not judged)" if unjudged else "")
        ecc = "ECC off" if d.ecc_mode == "disabled" else f"{_n(d.ecc_uncorrected_volatile)}/{_n(d.ecc_uncorrected_aggregate)}"
        if d.row_remap_failed:
            repairs = "remap FAILED"
        elif d.row_remap_pending is not None:
            repairs = "row remap" if d.row_remap_pending else "none"
        else:
            repairs = "page retirement" if d.retired_pages_pending else "none" if d.retired_pages_pending is not None else "?"
        events = "?" if d.clock_events is None else ", ".join(d.clock_events) or "none"
        link = f"gen {_n(d.pcie_generation)}/{_n(d.pcie_generation_max)}, x{_n(d.pcie_width)}/x{_n(d.pcie_width_max)}"
        rows.append([f"{d.device} {d.name or ''}".strip(), ecc, repairs, events, link, verdict])
    return rows



def _n(value: Any) -> str:
    return "?" if value is None else str(value)


# --------------------------------------------------------------------------------------------------- reading NVML
def preflight(devices: Sequence[str] | None, nvml: Any = None, env: Mapping[str, str] | None = None) -> HealthReport:
    """Read each CUDA device in ``devices`` (``["cuda:0", "cuda:1"]``, the probe's) from NVML.

    Args:
        devices: the probe's device names; none starting with ``cuda``: not run (the probe runs on the CPU); None:
            every device CUDA can use here (command mode: the command may use any of them).
        nvml: the ``pynvml`` module (default) or an object with its API (tests/fake_nvml.py).
        env: for ``CUDA_VISIBLE_DEVICES`` / ``CUDA_DEVICE_ORDER`` (default ``os.environ``): which NVML device each
            ``cuda:N`` is (core/monitor/nvml.py :func:`~core.monitor.nvml.cuda_devices`).

    Returns:
        the report; never raises for NVML's sake (no driver, no module: ``not_run`` with the reason).
    """
    from core.monitor.nvml import cuda_devices, discover

    cuda = None if devices is None else [d for d in devices if d.startswith("cuda")]
    if cuda == []:
        return HealthReport("not_run", "the probe runs on the CPU: there is no GPU to check")
    try:
        if nvml is None:
            import pynvml

            nvml = pynvml
        nvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - ImportError or any NVMLError: the preflight is not run, named
        return HealthReport("not_run", f"NVML unavailable ({type(exc).__name__}: {_why(exc)})")
    env = os.environ if env is None else env
    mapped, _how = cuda_devices(discover(nvml), env.get("CUDA_VISIBLE_DEVICES"), env.get("CUDA_DEVICE_ORDER"))
    by_name = {f"cuda:{c.index}": c.device for c in mapped}
    if cuda is None and not by_name:
        _try(nvml.nvmlShutdown)
        return HealthReport("not_run", "NVML lists no GPU that CUDA can use here")
    out = []
    for name in dict.fromkeys("cuda:0" if d == "cuda" else d for d in (list(by_name) if cuda is None else cuda)):
        device = by_name.get(name)
        if device is None:
            out.append(DeviceHealth(name, unread={"device": "NVML lists no device that CUDA numbers so here"}))
        else:
            out.append(read_device(nvml, name, device.handle, device.uuid, device.name))
    driver = _try(lambda: _text(nvml.nvmlSystemGetDriverVersion()))
    cuda_version = _try(lambda: _cuda_version(int(nvml.nvmlSystemGetCudaDriverVersion_v2())))
    _try(nvml.nvmlShutdown)
    return HealthReport("measured", "", driver, cuda_version, tuple(out))


def read_device(nvml: Any, name: str, handle: Any, uuid: str | None, product: str | None) -> DeviceHealth:
    """Every reading of one device (see the module docstring); a reading NVML refuses is in ``unread``."""
    values: dict[str, Any] = {}
    unread: dict[str, str] = {}
    enabled = getattr(nvml, "NVML_FEATURE_ENABLED", 1)

    def state(v: Any) -> str:
        return "enabled" if v == enabled else "disabled"

    def read(keys: tuple[str, ...], convert: Callable[[Any], Any], function: str, *args: Any) -> None:
        try:
            got = convert(getattr(nvml, function)(handle, *args))
        except Exception as exc:  # noqa: BLE001 - an NVMLError (NotSupported, NoPermission, GpuIsLost): unread
            unread.update(dict.fromkeys(keys, _why(exc)))
            return
        values.update(zip(keys, got if len(keys) > 1 else (got,), strict=True))

    read(("ecc_mode", "ecc_pending_mode"), lambda got: tuple(state(v) for v in got), "nvmlDeviceGetEccMode")
    for kind, error_type in (("uncorrected", 1), ("corrected", 0)):  # NVML_MEMORY_ERROR_TYPE_*
        for counter, counter_type in (("volatile", 0), ("aggregate", 1)):  # NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC
            read((f"ecc_{kind}_{counter}",), int, "nvmlDeviceGetTotalEccErrors", error_type, counter_type)
    for cause, key in ((0, "retired_pages_single_bit"), (1, "retired_pages_double_bit")):  # NVML_PAGE_RETIREMENT_CAUSE_*
        read((key,), len, "nvmlDeviceGetRetiredPages", cause)
    read(("retired_pages_pending",), bool, "nvmlDeviceGetRetiredPagesPendingStatus")
    read(("remapped_rows_corrected", "remapped_rows_uncorrected", "row_remap_pending", "row_remap_failed"),
         _remapped, "nvmlDeviceGetRemappedRows")
    try:
        values["clock_events"] = _clock_events(_event_reasons(nvml, handle))
    except Exception as exc:  # noqa: BLE001 - as read() above
        unread["clock_events"] = _why(exc)
    for key, function, clock in (("sm_clock_mhz", "nvmlDeviceGetClockInfo", 1),  # NVML_CLOCK_SM
                                 ("sm_clock_max_mhz", "nvmlDeviceGetMaxClockInfo", 1),
                                 ("memory_clock_mhz", "nvmlDeviceGetClockInfo", 2),  # NVML_CLOCK_MEM
                                 ("memory_clock_max_mhz", "nvmlDeviceGetMaxClockInfo", 2)):
        read((key,), int, function, clock)
    for key, function in (("pcie_generation", "nvmlDeviceGetCurrPcieLinkGeneration"),
                          ("pcie_generation_max", "nvmlDeviceGetMaxPcieLinkGeneration"),
                          ("pcie_width", "nvmlDeviceGetCurrPcieLinkWidth"),
                          ("pcie_width_max", "nvmlDeviceGetMaxPcieLinkWidth")):
        read((key,), int, function)
    read(("persistence_mode",), state, "nvmlDeviceGetPersistenceMode")
    read(("compute_mode",), lambda got: COMPUTE_MODES.get(int(got), "unknown"), "nvmlDeviceGetComputeMode")
    read(("temperature_c",), int, "nvmlDeviceGetTemperature", 0)  # NVML_TEMPERATURE_GPU
    return DeviceHealth(device=name, uuid=uuid, name=product, **values, unread=unread)


def _remapped(got: Sequence[int]) -> tuple[int, int, bool, bool]:
    corrected, uncorrected, pending, failure = got
    return int(corrected), int(uncorrected), bool(pending), bool(failure)


def _event_reasons(nvml: Any, handle: Any) -> int:
    """The clock event bits (``nvmlDeviceGetCurrentClocksEventReasons``; drivers before R535 have only the older
    name ``nvmlDeviceGetCurrentClocksThrottleReasons``, with the same bits)."""
    call = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    try:
        if call is not None:
            return int(call(handle))
    except getattr(nvml, "NVMLError_FunctionNotFound", ()):
        pass
    return int(nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))


def _clock_events(bits: int) -> tuple[str, ...]:
    names = {**FAULT_CLOCK_EVENTS, **OTHER_CLOCK_EVENTS}
    known = tuple(name for bit, name in sorted(names.items()) if bits & bit)
    unknown = bits & ~sum(names)
    return known + ((f"unknown_0x{unknown:x}",) if unknown else ())


def _cuda_version(v: int) -> str:
    """NVML's CUDA driver version (``12040``) as ``12.4``."""
    return f"{v // 1000}.{v % 1000 // 10}"


def _try(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception:  # noqa: BLE001 - an optional system reading
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _why(exc: BaseException) -> str:
    return _text(str(exc)) or type(exc).__name__


def report_json(report: HealthReport) -> dict[str, Any]:
    """The report as JSON (the GPU check writes it beside its measurements)."""
    return {**asdict(report), "devices": [d.to_table() for d in report.devices]}
