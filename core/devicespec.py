"""The ``devices`` and ``strategy`` settings of a spec, parsed: the devices of this machine a run uses (``auto``,
``cpu``, CUDA indices), or a box planned and not run on (capacities, GPUs by name), and the strategies that spread a
run over them. Every invalid value raises :class:`~core.errors.SpecError` naming the field and what to change."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

from core.errors import SpecError
from core.gpus import Gpu, gpu_named, nameable

#: How a run is spread over devices (docs/architecture.md §3). ``fsdp`` is accepted and stored as ``zero3`` (FSDP full shard).
Strategy = Literal["single", "ddp", "zero1", "zero2", "zero3", "device_map", "tp"]
STRATEGIES: tuple[Strategy, ...] = get_args(Strategy)
STRATEGY_ALIASES = {"fsdp": "zero3"}
#: Bytes per unit of a planned device capacity: GiB/MiB are binary (2^30, 2^20), GB/MB decimal (10^9, 10^6).
CAPACITY_UNITS = {"gib": 2**30, "gb": 10**9, "mib": 2**20, "mb": 10**6}
#: The most devices a planned box may name.
MAX_PLANNED_DEVICES = 1024

def parse_devices(devices: str) -> list[str]:
    """Parse the ``devices`` setting into the devices of this machine a run uses.

    Returns:
        ``["auto"]``, ``["cpu"]`` or CUDA device names such as ``["cuda:0", "cuda:1"]``.

    Raises:
        SpecError: anything else; a planned box (``"8x80GiB"``, ``"24GiB,8GiB"``, see
            :func:`parse_device_capacities`) names devices to plan for, not devices to run on, and is refused here.
    """
    if parse_device_capacities(devices) is not None:
        raise SpecError(
            "devices",
            f"{devices!r} describes devices to plan for, not devices of this machine: plan it with `gpuaccept plan`; "
            "to run, give auto, cpu, or CUDA indices such as 0 or 0,1",
        )
    return _parse_device_names(devices)


def is_cpu(devices: str) -> bool:
    return parse_device_capacities(devices) is None and _parse_device_names(devices) == ["cpu"]


def _parse_device_names(devices: str) -> list[str]:
    text = devices.strip().lower()
    if text in ("auto", "cpu"):
        return [text]
    parts = [p.strip().removeprefix("cuda:") for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise SpecError(
            "devices",
            f"{devices!r}: give auto, cpu, or CUDA indices such as 0 or 0,1 (or, to plan for a box you do not have, "
            "capacities such as 8x80GiB or 24GiB,8GiB, or GPUs by name such as 1xH200)",
        )
    if len(set(parts)) != len(parts):
        raise SpecError("devices", f"{devices!r} names a device twice")
    return [f"cuda:{p}" for p in parts]


_BOX_ITEM = re.compile(r"^(?:(\d+)\s*[x×]\s*)?(\d+(?:\.\d+)?)\s*([a-z]+)$")
#: an item of a box naming a GPU product, with an optional count (``8xa100-80gb``, ``h200``)
_NAMED_ITEM = re.compile(r"^(?:(\d+)\s*[x×]\s*)?([a-z][a-z0-9 \-]*)$")
#: an item naming a CUDA device of this machine (``0``, ``cuda:1``) or ``auto`` / ``cpu``
_DEVICE_INDEX = re.compile(r"^(cuda:)?\d+$|^(auto|cpu)$")


@dataclass(frozen=True)
class PlannedDevice:
    """A device of a box planned, not run on: its capacity in bytes and the GPU product it was named by (None for a
    device given by its capacity alone)."""

    capacity_bytes: int
    gpu: Gpu | None = None


def parse_planned_devices(devices: str) -> list[PlannedDevice] | None:
    """The devices of a planned box, or ``None`` when ``devices`` is not a box (auto, cpu, CUDA indices).

    A box is a comma-separated list of items, each a capacity (``24GiB``) or a GPU by name (``H200``, ``A100-80GB``,
    ``RTX4090``: core/gpus.py, case, spaces and dashes aside), alone or as a count x it (``8x80GiB``, ``1xH200``):
    ``"8x80GiB"`` (eight 80 GiB devices), ``"24GiB,8GiB"`` (two devices, heterogeneous), ``"2xH100,1xRTX4090"``.
    Units: GiB = 2^30 B, GB = 10^9 B, MiB = 2^20 B, MB = 10^6 B (case-insensitive); a number without a unit is a CUDA
    index, never a capacity. A GPU named has the total memory CUDA reports for it (:attr:`core.gpus.Gpu.reported_bytes`).
    The devices are numbered ``cuda:0`` ... in the order given.

    Raises:
        SpecError: a box with a bad item (unknown unit or GPU, zero count or capacity, more than
            :data:`MAX_PLANNED_DEVICES` devices, an item mixed with CUDA indices).
    """
    text = devices.strip().lower()
    items = [p.strip() for p in text.split(",")]
    if text in ("auto", "cpu") or not any(_looks_planned(item) for item in items):
        return None  # CUDA indices, or nothing like a box: named by parse_devices
    hint = ("give a capacity per device such as 24GiB,8GiB, a count x capacity such as 8x80GiB (units GiB, GB, MiB, "
            f"MB), or GPUs by name such as 1xH200 or 8xA100-80GB ({', '.join(nameable())})")
    out: list[PlannedDevice] = []
    for item, given in zip(items, (p.strip() for p in devices.strip().split(","))):
        count, device = _box_item(devices, item, given, hint)
        if count < 1:
            raise SpecError("devices", f"{devices!r}: {given!r} names no device; counts must be above 0")
        if len(out) + count > MAX_PLANNED_DEVICES:
            raise SpecError("devices", f"{devices!r}: more than {MAX_PLANNED_DEVICES} devices; plan at most {MAX_PLANNED_DEVICES}")
        out.extend([device] * count)
    return out


def _looks_planned(item: str) -> bool:
    """An item of ``devices`` meant as a device to plan for: a capacity, a count x something, or a GPU's name."""
    named = _NAMED_ITEM.match(item)
    return bool(_BOX_ITEM.match(item)) or bool(named and named.group(1)) or gpu_named(item) is not None


def _box_item(devices: str, item: str, given: str, hint: str) -> tuple[int, PlannedDevice]:
    """One item of a planned box: (count, device).

    Raises:
        SpecError: neither a capacity nor a GPU known by name, or a GPU whose reported memory is not known here.
    """
    match = _BOX_ITEM.match(item)
    if match:
        count_text, number, unit = match.groups()
        if unit not in CAPACITY_UNITS:
            if gpu_named(number + unit) is None:
                raise SpecError("devices", f"{devices!r}: unknown unit {unit!r}; {hint}")
        else:
            capacity = int(round(float(number) * CAPACITY_UNITS[unit]))
            if capacity < 1:
                raise SpecError("devices", f"{devices!r}: {given!r} names no memory; capacities must be above 0")
            return (int(count_text) if count_text is not None else 1), PlannedDevice(capacity)
    named = _NAMED_ITEM.match(item)
    gpu = gpu_named(named.group(2)) if named else None
    if named is None or gpu is None:
        if _DEVICE_INDEX.match(item):
            raise SpecError("devices", f"{devices!r} mixes CUDA indices with devices to plan for; {hint}")
        raise SpecError("devices", f"{devices!r}: {given!r} is neither a capacity nor a GPU gpuaccept knows by name; "
                                   f"{hint}")
    if gpu.reported_bytes is None:
        raise SpecError("devices", f"{devices!r}: gpuaccept knows the {gpu.name}'s SMs but not the memory CUDA reports "
                                   f"for it (NVIDIA: {gpu.memory}): give its capacity, e.g. 1x24GiB")
    return (int(named.group(1)) if named.group(1) else 1), PlannedDevice(gpu.reported_bytes, gpu)


def parse_device_capacities(devices: str) -> list[int] | None:
    """Capacities in bytes of a planned box (:func:`parse_planned_devices`), or ``None`` when ``devices`` is not a box
    (auto, cpu, CUDA indices).

    Raises:
        SpecError: as :func:`parse_planned_devices`.
    """
    planned = parse_planned_devices(devices)
    return None if planned is None else [d.capacity_bytes for d in planned]


def device_count(devices: str) -> int | None:
    """How many devices the ``devices`` setting names: 1 for cpu, the number of CUDA indices or planned devices, and
    ``None`` for auto (known only when the devices are detected).

    Raises:
        SpecError: ``devices`` is none of the forms of :func:`parse_devices` and :func:`parse_device_capacities`.
    """
    capacities = parse_device_capacities(devices)
    if capacities is not None:
        return len(capacities)
    names = _parse_device_names(devices)
    return None if names == ["auto"] else len(names)


def check_strategy(strategy: str, tp: int, count: int | None, devices: str = "") -> None:
    """Check the strategy and tensor-parallel degree against the number of devices (``None``: not known yet).

    Rules:
        - ``strategy`` is one of :data:`STRATEGIES` (``fsdp`` is stored as ``zero3``);
        - ``tp`` is at least 1, and above 1 only with strategy ``tp``;
        - every strategy but ``single`` needs at least 2 devices (one device is strategy ``single``);
        - strategy ``tp`` needs ``tp`` >= 2 and ``tp`` must divide the number of devices: the devices are
          ``tp``-device tensor-parallel groups, repeated as data-parallel replicas (each group holds the same, so the
          per-device plan does not depend on the number of replicas).

    Raises:
        SpecError: naming ``strategy``, ``tp`` or ``devices`` and what to change.
    """
    if strategy not in STRATEGIES:
        raise SpecError(
            "strategy",
            f"{strategy!r} is not a strategy; choose one of {', '.join(STRATEGIES)} (fsdp is accepted as zero3)",
        )
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise SpecError("tp", f"the tensor-parallel degree must be an integer of at least 1 (got {tp!r})")
    if strategy != "tp" and tp != 1:
        raise SpecError("tp", f"tp = {tp} is used only with strategy tp; set strategy = \"tp\" or tp = 1")
    if strategy == "tp" and tp < 2:
        raise SpecError("tp", "strategy tp needs a tensor-parallel degree of at least 2; set tp = 2 or more "
                              "(tp must divide the number of devices)")
    if strategy == "single" or count is None:
        return
    where = f" ({devices!r})" if devices else ""
    if count < 2:
        raise SpecError(
            "strategy",
            f"{strategy} spreads a run over several devices but devices{where} names {count}; give at least 2 devices "
            "(e.g. devices = \"0,1\" or \"2x80GiB\"; on the CPU, ranks: torchrun.nproc_per_node = 2, flag --nproc 2) "
            "or use strategy single",
        )
    if strategy == "tp" and count % tp != 0:
        divisors = [d for d in range(2, count + 1) if count % d == 0]
        raise SpecError(
            "tp",
            f"tp = {tp} does not divide the {count} devices{where}: the devices are tp-device tensor-parallel groups "
            f"(devices = tp x data-parallel replicas); choose tp among {', '.join(map(str, divisors))}",
        )
