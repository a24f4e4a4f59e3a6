"""The devices a plan is made for, and the one rule of a device's capacity.

:class:`DeviceInfo` is a device with the memory the plan must fit in; :func:`detect_devices` reads them from a spec's
``devices`` setting (CUDA through torch, the host through :func:`host_capacity`, or a box you do not have, built
without asking torch); :func:`judged_capacity` says which capacity a live bar's device was judged by. Split out of
core/plan/memory.py (issue 36: one concern per module).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from core.devicespec import PlannedDevice, parse_devices, parse_planned_devices

#: the label of a device of a planned box given by its capacity alone
PLANNED_LABEL = "planned GPU"


@dataclass(frozen=True)
class DeviceInfo:
    """A device the plan is made for.

    Attributes:
        name: ``"cpu"`` or ``"cuda:N"`` (CUDA order, as torch numbers devices in this process).
        kind: ``"cpu"`` | ``"cuda"``.
        label: for people, e.g. ``"host CPU"`` or ``"NVIDIA H200"``.
        capacity_bytes: memory the plan must fit in, in bytes; ``None`` when it cannot be known here. The one rule
            (:func:`detect_devices`; the host's in :func:`host_capacity`): a GPU's total memory; on the host the
            memory available to a new process when it was read (or a cgroup's headroom), never the host's total.
        capacity_source: where ``capacity_bytes`` came from (or why it is unknown).
        total_bytes: the device's whole memory (what a live bar is drawn against), or None when not read; equal to
            ``capacity_bytes`` on a GPU.
        read_at: when a capacity that moves (host memory available now) was read, as ``time.time()``; None for one
            that does not move (a GPU's total, a box given).
        others_bytes: a GPU's memory in use by other processes when it was planned (NVML's used memory of the device,
            :func:`others_on_gpus`), which the plan's overhead line adds; None when not read, with
            ``others_source`` saying why (empty for a GPU planned from its size: nothing of it is known).
    """

    name: str
    kind: str
    label: str
    capacity_bytes: int | None
    capacity_source: str
    # not compared: two readings of one device with the same capacity are the same device to plan for
    total_bytes: int | None = field(default=None, compare=False)
    read_at: float | None = field(default=None, compare=False)
    # a GPU's memory other processes hold when planned (NVML used), which the plan adds to its overhead line: what
    # NVML will show is ours and theirs (None: not read, or a GPU planned from its size, with ``others_source`` why)
    others_bytes: int | None = field(default=None, compare=False)
    others_source: str = field(default="", compare=False)

    @property
    def planned(self) -> bool:
        """A device of a box planned, not of this machine (``--devices 8x80GiB``, ``1xH200``)."""
        return self.capacity_source.startswith("given:")

    def capacity_text(self, digits: int = 2) -> str:
        """The capacity as every screen and command line says it, e.g. ``23.04 GiB (available host memory (psutil),
        read at 14:02:11)`` or ``139.81 GiB (torch.cuda total memory)``: GiB = 2^30 bytes with ``digits`` decimals,
        the source, and the time of a reading that moves (two readings of available memory differ)."""
        if self.capacity_bytes is None:
            return f"unknown capacity ({self.capacity_source})"
        return f"{self.capacity_bytes / 2**30:.{digits}f} GiB ({self.capacity_source}{self.read_at_text()})"

    def capacity_short(self) -> str:
        """The capacity in a few words for a bar or a line: ``23.04 GiB available (read at 14:02:11)``."""
        if self.capacity_bytes is None:
            return "unknown capacity"
        when = f" (read at {_clock(self.read_at)})" if self.read_at is not None else ""
        return f"{self.capacity_bytes / 2**30:.2f} GiB {self.capacity_kind}{when}"

    def read_at_text(self) -> str:
        """``, read at 14:02:11`` for a capacity that moves, else empty."""
        return f", read at {_clock(self.read_at)}" if self.read_at is not None else ""

    @property
    def capacity_kind(self) -> str:
        """Which capacity this is, in a word or two for a screen: ``total`` (a GPU's memory), ``available`` (host
        memory free now), ``cgroup limit`` (the headroom under a cgroup memory limit), ``given`` (a box planned
        for), ``per rank`` (a share of the host), or ``unknown``."""
        source = self.capacity_source
        if self.capacity_bytes is None:
            return "unknown"
        if "ranks sharing" in source:
            return "per rank"
        for marker, kind in (("cgroup", "cgroup limit"), ("given", "given"), ("available", "available"),
                             ("total", "total")):
            if marker in source:
                return kind
        return source


def _clock(t: float | None) -> str:
    """A reading's local time of day, ``14:02:11``."""
    import time

    return time.strftime("%H:%M:%S", time.localtime(t))



def detect_devices(devices: str, cpu_ranks: int = 1) -> list[DeviceInfo]:
    """The devices named by a spec's ``devices`` setting, with their capacity.

    ``cpu_ranks`` >= 2 (torchrun's ranks on the CPU, ``torchrun.nproc_per_node``): when the run is on the host CPU it
    is planned as that many devices ``cpu:0`` ... ``cpu:N-1``, one per rank, each given an equal share of the host's
    available memory (the ranks are processes sharing one host memory; a share is a convention, not a partition).

    - ``"cpu"``: the host, capacity = ``psutil.virtual_memory().available`` (bytes free for a new process now), or
      the headroom of a cgroup memory limit (v1 or v2) where that is smaller (:func:`core.monitor.hostmem.host_memory`;
      ``capacity_source`` says which);
    - ``"auto"``: every visible CUDA device if ``torch.cuda.is_available()``, else the host CPU;
    - ``"0,1"`` / ``"cuda:0"``: those CUDA devices, capacity = ``torch.cuda.get_device_properties(i).total_memory``,
      or ``None`` (with ``capacity_source`` saying why) when CUDA is unavailable or the index is not visible;
    - a box you do not have, to plan for (``"8x80GiB"``, ``"24GiB,8GiB"``, ``"1xH200"``, see
      :func:`core.devicespec.parse_planned_devices`): ``DeviceInfo("cuda:i", "cuda", "planned GPU", capacity,
      "given: 8x80GiB")`` per device given by its capacity, labelled with the product name for a GPU named
      (``"NVIDIA H200"``, the total CUDA reports for it), in the order given; torch is not asked.

    Raises:
        SpecError: ``devices`` is none of the forms above.
    """
    planned = parse_planned_devices(devices)
    if planned is not None:
        return [_planned(i, d, devices.strip()) for i, d in enumerate(planned)]
    names = parse_devices(devices)
    if names == ["cpu"]:
        return _host_devices(cpu_ranks)
    import torch

    cuda = torch.cuda.is_available()
    if names == ["auto"]:
        if not cuda:
            return _host_devices(cpu_ranks)
        names = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    count = torch.cuda.device_count() if cuda else 0
    out = []
    for name in names:
        index = int(name.split(":", 1)[1])
        if not cuda:
            out.append(DeviceInfo(name, "cuda", f"{name} (CUDA unavailable)", None, "unknown: CUDA is not available in this process"))
        elif index >= count:
            out.append(DeviceInfo(name, "cuda", f"{name} (not visible)", None, f"unknown: only {count} CUDA device(s) visible"))
        else:
            props = torch.cuda.get_device_properties(index)
            out.append(DeviceInfo(name, "cuda", props.name, int(props.total_memory), "torch.cuda total memory",
                                  int(props.total_memory)))
    return others_on_gpus(out)


def _planned(index: int, device: PlannedDevice, given: str) -> DeviceInfo:
    """A device of a box planned: ``planned GPU`` with the capacity given, or the GPU named, labelled with its product
    name (so the plan assumes what that GPU runs: its cuBLAS workspace, cuDNN attention, CUDA context)."""
    if device.gpu is None:
        return DeviceInfo(f"cuda:{index}", "cuda", PLANNED_LABEL, device.capacity_bytes, f"given: {given}",
                          device.capacity_bytes)
    gpu = device.gpu
    return DeviceInfo(f"cuda:{index}", "cuda", gpu.name, device.capacity_bytes,
                      f"given: {given}; the total CUDA reports for it: {gpu.reported_source}; NVIDIA's specification "
                      f"{gpu.memory}", device.capacity_bytes)


def others_on_gpus(devices: list[DeviceInfo], nvml: Any = None) -> list[DeviceInfo]:
    """``devices`` with what other processes hold on each readable GPU now: NVML's used memory of the device
    (``nvmlDeviceGetMemoryInfo``; nothing of this run holds it yet), through the live bars' own reader
    (core/monitor/nvml.py, which maps ``cuda:N`` to its NVML device as CUDA numbers them). A GPU NVML cannot read
    keeps ``others_bytes`` None with the reason; devices that are not live GPUs are returned as they are.

    Args:
        nvml: the ``pynvml`` module or a stand-in with its functions (tests); default: pynvml.
    """
    gpus = [d for d in devices if d.kind == "cuda" and d.capacity_bytes is not None and not d.planned]
    if not gpus:
        return devices
    from core.monitor.nvml import NvmlBackend, default_backend

    backend, line = default_backend(nvml)
    readings: dict[str, tuple[int | None, str]]
    if not isinstance(backend, NvmlBackend):
        readings = {d.name: (None, f"not read: {line}") for d in gpus}
    else:
        when = time.time()
        readings = {s.device: (s.others_bytes.value, f"NVML used when planned (read at {_clock(when)})"
                               if s.others_bytes.value is not None else f"not read: {s.others_bytes.reason}")
                    for s in backend.sample(set())}
    unlisted = (None, "not read: NVML does not list it")
    return [dataclasses.replace(d, others_bytes=readings.get(d.name, unlisted)[0],
                                others_source=readings.get(d.name, unlisted)[1]) if d in gpus else d for d in devices]


def _host_devices(ranks: int) -> list[DeviceInfo]:
    host = host_capacity()
    if ranks < 2:
        return [host]
    share = None if host.capacity_bytes is None else host.capacity_bytes // ranks
    return [DeviceInfo(f"cpu:{r}", "cpu", f"host CPU, rank {r} of {ranks}", share,
                       f"{host.capacity_source} / {ranks} ranks sharing it", host.total_bytes, host.read_at)
            for r in range(ranks)]


def host_capacity() -> DeviceInfo:
    """The host CPU as a device, with the capacity plans are judged against: the one rule, read once per call.

    The capacity is the memory *available* to a new process now (``psutil.virtual_memory().available``), or the
    headroom under a cgroup memory limit where that is smaller (:func:`core.monitor.hostmem.host_memory`); never the
    host's total, which other processes share. ``capacity_source`` says which ("available host memory (psutil)"),
    ``total_bytes`` is the host's whole memory (what a live bar is drawn against) and ``read_at`` when it was read:
    available memory moves, so two readings a minute apart differ (a screen says when each was read)."""
    import time

    from core.monitor.hostmem import host_memory

    read_at = time.time()
    host = host_memory()  # the cgroup's headroom where a cgroup limit is tighter than the machine
    return DeviceInfo("cpu", "cpu", "host CPU", host.available_bytes, host.source, host.total_bytes, read_at)


def judged_capacity(devices: list[DeviceInfo], name: str) -> str:
    """The capacity the plan judged device ``name`` (a live bar's ``cpu`` or ``cuda:N``) by, in a few words for
    beside the bar's total: ``22.87 GiB available when planned (14:02:11)``; CPU ranks (``cpu:0`` ...) share the
    host, so ``cpu`` is their shares together. Empty when the plan has no such device or its capacity is unknown."""
    found = [d for d in devices if d.name == name]
    if name == "cpu" and not found:
        ranks = [d for d in devices if d.kind == "cpu"]
        if ranks and all(d.capacity_bytes is not None for d in ranks):
            found = [dataclasses.replace(ranks[0], name="cpu",
                                         capacity_bytes=sum(d.capacity_bytes or 0 for d in ranks),
                                         capacity_source=ranks[0].capacity_source.split(" / ")[0])]
    capacity = found[0].capacity_bytes if found else None
    if capacity is None:
        return ""
    d = found[0]
    when = f" ({_clock(d.read_at)})" if d.read_at is not None else ""
    return f"{capacity / 2**30:.2f} GiB {d.capacity_kind} when planned{when}"
