"""The NVML backend of the device monitor: GPU memory per device from nvidia-ml-py, mapped to CUDA devices by UUID.

What it does about each public monitor failure (../shared/cases/monitor.md, tests/unit/test_nvml.py):

- M1, index mapping: NVML numbers GPUs in its own (PCI) order; CUDA numbers them FASTEST_FIRST by default, or in PCI
  order with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, and ``CUDA_VISIBLE_DEVICES`` renumbers them (indices, ``GPU-`` UUIDs or
  ``MIG-`` UUIDs, a prefix is enough, the list ends at the first entry that matches nothing). :func:`cuda_devices`
  applies those rules; when FASTEST_FIRST cannot be told from NVML (GPUs of different models), the mapping is marked
  unverified until the probe reports torch's UUID for its device (:meth:`NvmlBackend.bind_uuid`), which wins.
- M2, "used": v2 memory info (``nvmlMemory_v2``): used excludes the driver's reserved memory, which is its own
  reading. v1 (old drivers) is used only when v2 is refused, and its "used" then carries that caveat.
- M3, containers: NVML lists host PIDs. When the device lists processes whose PIDs do not exist in our PID namespace,
  our processes' memory is the device's change in used memory since the baseline (taken when the sampler starts to
  follow the probe), with that reason shown.
- M4, a bad GPU: a device whose calls fail (GPU is lost, Unknown Error) is sampled as N/A with the reason; the others
  keep updating.
- M5, unsupported fields: utilisation or the process list raising NotSupported make that reading N/A, nothing else.
- M6, MIG: a GPU in MIG mode is shown as a MIG parent (no per-process memory); its MIG devices are the devices a CUDA
  process can use, each with its own memory.
- M7, no driver: :func:`default_backend` falls back to the host backend, labelled CPU mode with NVML's reason.

``nvml`` everywhere is the ``pynvml`` module of nvidia-ml-py, or an object with the same functions and exception
classes (the tests construct one that raises pynvml's own exceptions).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, cast

import psutil

from core.monitor.sampler import DeviceSample, HostBackend, Reading, others_reading


@dataclass(frozen=True)
class NvmlDevice:
    """One device NVML can see: a physical GPU or a MIG device.

    Attributes:
        key: ``"nvml:<index>"`` for a GPU, ``"nvml:<index>/mig:<n>"`` for a MIG device (stable within a process).
        uuid: ``GPU-...`` or ``MIG-...``; None when NVML could not read it (the error is in ``error``).
        name: the product name.
        pci_bus_id: for CUDA_DEVICE_ORDER=PCI_BUS_ID (a MIG device has its parent's; None when unreadable).
        mig_parent: the parent GPU's uuid, for a MIG device.
        mig_enabled: a GPU in MIG mode (its memory is used through its MIG devices).
        error: why this device could not be enumerated (a lost GPU), else None.
        gpu_instance, compute_instance: a MIG device's GI and CI ids (the legacy ``MIG-GPU-<uuid>/<gi>/<ci>`` name).
    """

    key: str
    uuid: str | None
    name: str
    pci_bus_id: str | None
    handle: Any
    mig_parent: str | None = None
    mig_enabled: bool = False
    error: str | None = None
    gpu_instance: int | None = None
    compute_instance: int | None = None

    @property
    def cuda_usable(self) -> bool:
        """A CUDA process can run on it: a GPU not in MIG mode, or a MIG device."""
        return self.error is None and not self.mig_enabled


@dataclass(frozen=True)
class CudaDevice:
    """CUDA device ``cuda:<index>`` of this process and the NVML device it is, with how that was decided."""

    index: int
    device: NvmlDevice
    method: str
    verified: bool


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _reason(exc: BaseException) -> str:
    return f"{_text(exc) or type(exc).__name__}"


def discover(nvml: Any) -> list[NvmlDevice]:
    """Every GPU NVML lists (in NVML order) followed by its MIG devices when it is in MIG mode. A GPU whose handle or
    UUID cannot be read is kept with its error (it is shown as N/A, never dropped silently)."""
    devices: list[NvmlDevice] = []
    for i in range(nvml.nvmlDeviceGetCount()):
        key = f"nvml:{i}"
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        except nvml.NVMLError as exc:
            devices.append(NvmlDevice(key, None, "unknown GPU", None, None, error=_reason(exc)))
            continue
        name = _optional(lambda: _text(nvml.nvmlDeviceGetName(handle))) or "GPU"  # noqa: B023 - called at once
        bus = _optional(lambda: _text(nvml.nvmlDeviceGetPciInfo(handle).busId))  # noqa: B023 - called at once
        mig = False
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
            mig = current == getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1)
        except nvml.NVMLError:
            mig = False  # NotSupported: not a MIG-capable GPU
        devices.append(NvmlDevice(key, uuid, name, bus, handle, mig_enabled=mig))
        if mig:
            for n in range(_optional(lambda: nvml.nvmlDeviceGetMaxMigDeviceCount(handle)) or 0):  # noqa: B023 - called at once
                try:
                    child = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, n)
                    child_uuid = _text(nvml.nvmlDeviceGetUUID(child))
                except nvml.NVMLError:
                    continue  # an empty MIG slot
                child_name = _optional(lambda: _text(nvml.nvmlDeviceGetName(child))) or f"{name} MIG"  # noqa: B023 - called at once
                # a MIG device sorts with its parent GPU (its own PCI id is the parent's)
                devices.append(NvmlDevice(f"{key}/mig:{n}", child_uuid, child_name, bus, child, mig_parent=uuid,
                                          gpu_instance=_optional(lambda: nvml.nvmlDeviceGetGpuInstanceId(child)),  # noqa: B023 - called at once
                                          compute_instance=_optional(
                                              lambda: nvml.nvmlDeviceGetComputeInstanceId(child))))  # noqa: B023 - called at once
    return devices


def _optional(read: Any) -> Any:
    try:
        return read()
    except Exception:  # noqa: BLE001 - an optional field (name, bus id): absent is fine
        return None


def _hex(uuid: str | None) -> str:
    """A UUID without its ``GPU-``/``MIG-`` prefix, lower case (torch's ``props.uuid`` is bare hex)."""
    if uuid is None:
        return ""
    text = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            return text[len(prefix):]
    return text


def _uuid_matches(token: str, uuid: str | None) -> bool:
    """``token`` (a full UUID or a prefix, with its ``GPU-``/``MIG-`` prefix) names ``uuid``."""
    if uuid is None:
        return False
    return uuid.lower().startswith(token.strip().lower())


_ORDINAL = re.compile(r"[0-9]+")


def _ordinal(token: str) -> int | None:
    """CUDA parses an index entry like strtoul: leading ASCII digits ("1gpu2" is 1); no digits: not an index."""
    match = _ORDINAL.match(token.strip())
    return int(match.group()) if match else None


def cuda_devices(devices: list[NvmlDevice], visible: str | None, order: str | None) -> tuple[list[CudaDevice], str]:
    """The CUDA devices of a process with this ``CUDA_VISIBLE_DEVICES`` / ``CUDA_DEVICE_ORDER``, in CUDA order.

    Rules (CUDA C Programming Guide, "CUDA Environment Variables"; the MIG user guide; torch's
    ``_parse_visible_devices``, written to mirror CUDA):

    - physical GPUs are ordered by PCI bus id with ``PCI_BUS_ID``; ``FASTEST_FIRST`` (the default) puts the fastest
      first, which NVML cannot rank when the models differ: PCI order is then assumed and marked unverified;
    - a GPU in MIG mode stands for its MIG devices, and a CUDA process enumerates one MIG device at most (the first);
    - ``CUDA_VISIBLE_DEVICES``: the first entry's kind decides the list: indices (parsed like strtoul, an ordinal of
      the physical GPUs above) or UUIDs (``GPU-``/``MIG-``, unique prefixes allowed, and the legacy
      ``MIG-GPU-<uuid>/<gi>/<ci>``); the list ends at the first entry that matches nothing or is of the other kind;
      a repeated device hides every device (``""`` and ``-1`` hide them too).

    Returns:
        (devices in CUDA order, one line saying how the mapping was made).
    """
    gpus = [d for d in devices if d.mig_parent is None and d.error is None]
    gpus.sort(key=lambda d: (d.pci_bus_id is None, d.pci_bus_id or "", d.key))
    migs = {g.uuid: [d for d in devices if d.mig_parent == g.uuid] for g in gpus if g.mig_enabled}
    order = (order or "FASTEST_FIRST").upper()
    models = {d.name for d in gpus}
    if order == "PCI_BUS_ID":
        basis, verified = "CUDA_DEVICE_ORDER=PCI_BUS_ID: PCI bus order", True
    elif len(models) <= 1:
        basis, verified = "FASTEST_FIRST with identical GPUs = PCI bus order", True
    else:
        basis, verified = ("FASTEST_FIRST with different GPU models: PCI order assumed, unverified until the probe "
                           "reports torch's UUID"), False

    def usable(gpu: NvmlDevice) -> NvmlDevice | None:
        if not gpu.mig_enabled:
            return gpu
        found = migs.get(gpu.uuid) or []
        return found[0] if found else None

    if visible is None:
        chosen = [d for d in (usable(g) for g in gpus) if d is not None]
        how = basis
    else:
        chosen = []
        tokens = [t.strip() for t in visible.split(",")]
        by_uuid = tokens[0].upper().startswith(("GPU-", "MIG-")) if tokens else False
        for token in tokens:
            if by_uuid:
                match = _by_uuid(token, gpus, migs, usable) if token.upper().startswith(("GPU-", "MIG-")) else None
            else:
                n = _ordinal(token)
                match = usable(gpus[n]) if n is not None and n < len(gpus) else None
            if match is None:
                break  # CUDA stops at the first entry that matches nothing
            if match in chosen:
                chosen = []  # a repeated device: CUDA exposes no device at all
                break
            chosen.append(match)
        how = f"CUDA_VISIBLE_DEVICES={visible!r} over {basis}"
        if by_uuid:
            verified = True  # UUIDs name the devices exactly, whatever the order
    kept: list[NvmlDevice] = []
    for d in chosen:  # one MIG device per CUDA process
        if d.mig_parent is not None and any(k.mig_parent is not None for k in kept):
            continue
        kept.append(d)
    return [CudaDevice(i, d, how, verified) for i, d in enumerate(kept)], how


def _by_uuid(token: str, gpus: list[NvmlDevice], migs: dict[str | None, list[NvmlDevice]], usable: Any) -> Any:
    legacy = re.fullmatch(r"MIG-(GPU-[0-9a-fA-F-]+)/(\d+)/(\d+)", token, flags=re.IGNORECASE)
    if legacy:
        parent_token, gi, ci = legacy.group(1), int(legacy.group(2)), int(legacy.group(3))
        parents = [g for g in gpus if _uuid_matches(parent_token, g.uuid)]
        found = [m for p in parents for m in migs.get(p.uuid, []) if (m.gpu_instance, m.compute_instance) == (gi, ci)]
        return found[0] if len(found) == 1 else None
    candidates = [*gpus, *(m for ms in migs.values() for m in ms)]
    found = [d for d in candidates if _uuid_matches(token, d.uuid)]
    if len(found) != 1:
        return None
    return usable(found[0]) if found[0].mig_enabled else found[0]


class NvmlBackend:
    """GPU memory per device from NVML (see the module docstring for cases M1-M6).

    :meth:`sample` returns one :class:`~core.monitor.sampler.DeviceSample` per NVML device: ``cuda:N`` for the devices this
    process's CUDA can use (in CUDA order), ``nvml:N`` for the others (not visible to CUDA here, or a MIG parent).

    Args:
        nvml: the ``pynvml`` module (default) or an object with the same API; ``nvmlInit`` is called here.
        env: environment for CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER (default ``os.environ``).

    Raises:
        nvml.NVMLError: NVML cannot start (no driver: ``NVMLError_LibraryNotFound``) — see :func:`default_backend`.
    """

    name = "nvml"

    def __init__(self, nvml: Any = None, env: Mapping[str, str] | None = None) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self.nvml = nvml
        nvml.nvmlInit()
        env = os.environ if env is None else env
        self.devices = discover(nvml)
        self.cuda, self.mapping_note = cuda_devices(self.devices, env.get("CUDA_VISIBLE_DEVICES"),
                                                    env.get("CUDA_DEVICE_ORDER"))
        self._lock = threading.Lock()
        self._baseline: dict[str, int] = {}
        self._take_baseline = True

    # ------------------------------------------------------------------ mapping
    def label(self, device: NvmlDevice) -> str:
        for c in self.cuda:
            if c.device.key == device.key:
                return f"cuda:{c.index}"
        return device.key

    def bind_uuid(self, cuda_device: str, torch_uuid: str) -> str:
        """Check the mapping of ``cuda_device`` (``"cuda:N"``) against the UUID torch reported for it, and correct it.

        torch's ``get_device_properties(i).uuid`` is bare hex; it is compared without ``GPU-``/``MIG-`` prefixes,
        against the devices CUDA can use (a MIG parent's UUID stands for its MIG device in this process's list).

        Returns:
            one line for the screen: confirmed, corrected (which NVML device it really is), or not found.
        """
        index = int(cuda_device.split(":")[1])
        want = _hex(torch_uuid)
        usable = [d for d in self.devices if d.cuda_usable]
        found = [d for d in usable if _hex(d.uuid) == want]
        if not found:  # torch may report the parent GPU of a MIG device: the MIG device of it that we enumerate
            parents = {d.uuid for d in self.devices if d.mig_enabled and _hex(d.uuid) == want}
            found = [c.device for c in self.cuda if c.device.mig_parent in parents]
        with self._lock:
            current = next((c for c in self.cuda if c.index == index), None)
            if not found:
                return f"{cuda_device}: torch's UUID {torch_uuid} is not among NVML's devices; the mapping is unverified"
            device = found[0]
            if current is not None and current.device.key == device.key:
                self.cuda = [replace(c, verified=True, method=c.method + "; confirmed by torch's UUID")
                             if c.index == index else c for c in self.cuda]
                return f"{cuda_device} = {device.uuid} ({device.name}): confirmed by torch's UUID"
            # the device torch named takes this index; the device the order gave it moves to the index that had it
            moved = [replace(c, device=current.device, method=c.method + "; swapped after torch's UUID", verified=False)
                     if current is not None and c.device.key == device.key else c
                     for c in self.cuda if c.index != index]
            self.cuda = sorted(moved + [CudaDevice(index, device, "torch's UUID", True)], key=lambda c: c.index)
            return (f"{cuda_device} = {device.uuid} ({device.name}) by torch's UUID; the order-based mapping said "
                    f"{current.device.uuid if current else 'nothing'}")

    def reset_baseline(self) -> None:
        """Take each device's used memory at the next sample as the baseline (before the probe allocates)."""
        with self._lock:
            self._take_baseline = True

    # ------------------------------------------------------------------ sampling
    def sample(self, pids: set[int]) -> list[DeviceSample]:
        family = _family(pids)
        now = time.time()
        samples = [self._sample_device(d, pids, family, now) for d in self.devices]
        with self._lock:
            if self._take_baseline:
                self._baseline = {s.uuid: s.used_bytes.value for s in samples
                                  if s.uuid is not None and s.used_bytes.value is not None}
                self._take_baseline = False
        cuda_order = {f"cuda:{c.index}": c.index for c in self.cuda}
        return sorted(samples, key=lambda s: (0, cuda_order[s.device]) if s.device in cuda_order else (1, s.device))

    def _sample_device(self, d: NvmlDevice, pids: set[int], family: set[int], now: float) -> DeviceSample:
        nvml = self.nvml
        label = self.label(d)
        if d.error is not None:
            return _unavailable(now, label, d, d.error)
        try:
            total, used, reserved, free, caveat = self._memory(d)
        except nvml.NVMLError as exc:
            return _unavailable(now, label, d, _reason(exc))
        util = self._utilization(d)
        if d.mig_enabled:
            ours = Reading(None, "MIG mode: processes run on its MIG devices")
            note = "MIG parent"
        elif not pids:
            ours, note = Reading(None, "no probe process running"), None
        else:
            ours, note = self._ours(d, family, used), None
        used_r = Reading(used, caveat)
        return DeviceSample(t=now, device=label, name=d.name, backend=self.name, total_bytes=Reading(total),
                            used_bytes=used_r, free_bytes=Reading(free), ours_bytes=ours,
                            others_bytes=others_reading(Reading(used), ours), uuid=d.uuid,
                            reserved_bytes=reserved, utilization_pct=util, note=note)

    def _memory(self, d: NvmlDevice) -> tuple[int, int, Reading, int, str | None]:
        nvml = self.nvml
        try:
            mem = nvml.nvmlDeviceGetMemoryInfo(d.handle, version=nvml.nvmlMemory_v2)
            return int(mem.total), int(mem.used), Reading(int(mem.reserved)), int(mem.free), None
        except _old_driver_errors(nvml):
            mem = nvml.nvmlDeviceGetMemoryInfo(d.handle)  # v1: old driver
            return (int(mem.total), int(mem.used), Reading(None, "v1 memory info: reserved not reported"),
                    int(mem.free), "v1 memory info: used includes driver-reserved memory")

    def _utilization(self, d: NvmlDevice) -> Reading:
        try:
            return Reading(int(self.nvml.nvmlDeviceGetUtilizationRates(d.handle).gpu))
        except self.nvml.NVMLError as exc:
            return Reading(None, f"utilisation: {_reason(exc)}")

    def _processes(self, d: NvmlDevice) -> list[Any]:
        """Compute processes, MPS clients and graphics processes on ``d`` (each pid once, compute first); raises the
        compute query's NVMLError (the others are optional: NotSupported on many GPUs)."""
        nvml = self.nvml
        procs = list(nvml.nvmlDeviceGetComputeRunningProcesses(d.handle))
        for extra in ("nvmlDeviceGetMPSComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            fn = getattr(nvml, extra, None)
            if fn is not None:
                procs += _optional(lambda: list(fn(d.handle))) or []  # noqa: B023 - called at once
        seen: set[int] = set()
        unique = []
        for p in procs:
            if int(p.pid) not in seen:
                seen.add(int(p.pid))
                unique.append(p)
        return unique

    def _since_baseline(self, d: NvmlDevice, used: int, why: str) -> Reading:
        with self._lock:
            base = self._baseline.get(d.uuid or "")
        if base is None:
            return Reading(None, f"{why}, and no baseline was taken")
        return Reading(max(used - base, 0), f"{why}: change of the device's used memory since the probe started")

    def _ours(self, d: NvmlDevice, family: set[int], used: int) -> Reading:
        nvml = self.nvml
        try:
            procs = self._processes(d)
        except nvml.NVMLError as exc:
            return Reading(None, f"per-process memory: {_reason(exc)}")
        if not procs:  # WSL2 and some containers list nothing, even while memory is in use
            return self._since_baseline(d, used, "NVML lists no process on this device")
        mine = [p for p in procs if int(p.pid) in family]
        if mine:
            sizes = [getattr(p, "usedGpuMemory", None) for p in mine]
            if any(s is None for s in sizes):  # WDDM, MIG devices: "value not available"
                return self._since_baseline(d, used, "the driver does not report per-process memory")
            return Reading(sum(int(s) for s in sizes if s is not None))
        if any(not psutil.pid_exists(int(p.pid)) for p in procs):  # host PIDs: we are in a container
            return self._since_baseline(d, used, "NVML lists PIDs of another PID namespace (container)")
        if any("mps-server" in _process_name(int(p.pid)) for p in procs):  # MPS clients run behind the server
            return self._since_baseline(d, used, "MPS: NVML lists the MPS server, not its clients")
        return Reading(0)  # other processes of ours hold this device; our probe holds nothing on it (yet)


def _process_name(pid: int) -> str:
    try:
        return cast(str, psutil.Process(pid).name())  # psutil is untyped here (ignore_missing_imports)
    except psutil.Error:
        return ""


def _family(pids: set[int]) -> set[int]:
    """The pids and all their descendants (psutil); vanished ones are skipped."""
    out = set(pids)
    for pid in pids:
        try:
            out.update(c.pid for c in psutil.Process(pid).children(recursive=True))
        except psutil.Error:
            pass
    return out


def _unavailable(now: float, label: str, d: NvmlDevice, reason: str) -> DeviceSample:
    na = Reading(None, reason)
    return DeviceSample(t=now, device=label, name=d.name, backend="nvml", total_bytes=na, used_bytes=na, free_bytes=na,
                        ours_bytes=na, others_bytes=na, uuid=d.uuid, reserved_bytes=na, utilization_pct=na)


def default_backend(nvml: Any = None, env: Mapping[str, str] | None = None) -> tuple[Any, str]:
    """The backend for this machine and one line saying which it is: NVML when it starts and lists a device, else the
    host backend in CPU mode with NVML's reason (case M7: no driver -> ``NVMLError_LibraryNotFound``)."""
    try:
        backend = NvmlBackend(nvml, env)
    except ImportError as exc:
        return HostBackend(), f"CPU mode: nvidia-ml-py is not importable ({exc}); host memory shown"
    except Exception as exc:  # noqa: BLE001 - any NVMLError: no GPU monitoring, the host still is
        return HostBackend(), f"CPU mode: NVML unavailable ({_reason(exc)}); host memory shown"
    if not backend.devices:
        return HostBackend(), "CPU mode: NVML lists no GPU; host memory shown"
    return backend, f"NVML: {len(backend.devices)} device(s); {backend.mapping_note}"


def _old_driver_errors(nvml: Any) -> tuple[type[BaseException], ...]:
    """The NVML errors a driver without the v2 memory query raises for it (those this pynvml defines)."""
    names = ("NVMLError_FunctionNotFound", "NVMLError_ArgumentVersionMismatch", "NVMLError_NotSupported")
    found = (getattr(nvml, name, None) for name in names)
    return tuple(e for e in found if isinstance(e, type) and issubclass(e, BaseException))
