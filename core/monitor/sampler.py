"""Device memory sampling behind the live per-device memory bars (docs/architecture.md §1: the DeviceSampler in the parent).

A :class:`Backend` turns "which processes are ours" into one :class:`DeviceSample` per device; a :class:`Sampler` calls
it on a background thread (default 10 Hz), keeps a bounded history and the peaks, and can record every sample as JSON
lines that :meth:`ReplayBackend.from_jsonl` plays back. All memory values are bytes.

Any reading may be unavailable: it is then a :class:`Reading` with ``value=None`` and a reason, never an exception
(nvitop's ``NA``). A backend reports a failing device or an unsupported field that way and keeps the other devices
(monitor cases M4, M5). Backends here: ``host`` (psutil) and ``replay`` (recorded or constructed frames); the NVML
backend is :class:`core.monitor.nvml.NvmlBackend` (CUDA devices mapped to NVML devices by UUID, v2 memory info, the device's
change from a baseline when our PIDs are not visible), chosen by :func:`core.monitor.nvml.default_backend`.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil


@dataclass(frozen=True)
class Reading:
    """One memory reading in bytes.

    ``value`` is None when the reading is not available, and ``reason`` says why (shown as ``"N/A: <reason>"``).
    A value with a reason is a caveated figure (e.g. an estimate); only a plain value is :attr:`ok`.
    """

    value: int | None
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.value is not None and self.reason is None

    def to_json(self) -> dict[str, Any]:
        return {"value": self.value} if self.reason is None else {"value": self.value, "reason": self.reason}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Reading:
        return cls(d.get("value"), d.get("reason"))


#: why ``ours`` is None when no probe holds memory (nothing followed yet, or all of it exited): every used byte is then
#: another process's
NOTHING_FOLLOWED = ("no probe process running", "followed processes have exited")


def others_reading(used: Reading, ours: Reading) -> Reading:
    """Memory of every process but ours: ``used - ours``, when both are known (never below 0, since ours by RSS can
    count shared or reclaimable pages that "used" does not); all of ``used`` when no probe process is running
    (:data:`NOTHING_FOLLOWED`); unknown when ours could not be read."""
    if used.value is not None and ours.value is None and ours.reason in NOTHING_FOLLOWED:
        return Reading(used.value)
    if used.value is None or ours.value is None:
        return Reading(None, used.reason if used.value is None else ours.reason)
    return Reading(max(used.value - ours.value, 0))


_READINGS = ("total_bytes", "used_bytes", "free_bytes", "ours_bytes", "others_bytes")
_OPTIONAL_READINGS = ("reserved_bytes", "utilization_pct")


@dataclass(frozen=True)
class DeviceSample:
    """Memory of one device at time ``t`` (seconds since the epoch, ``time.time()``).

    ``device`` is ``"cpu"``, ``"cuda:N"`` (CUDA numbering, as the probe sees it) or ``"nvml:N"`` (a GPU this process's
    CUDA cannot use); ``backend`` names where the figures came from (``"host"``, ``"replay"``, ``"nvml"``).
    ``used_bytes`` is the whole device, all processes; ``ours_bytes`` is the followed processes and their descendants;
    ``others_bytes`` is used minus ours; ``reserved_bytes`` is memory the driver reserves (NVML v2), outside "used";
    ``utilization_pct`` the GPU's utilisation in percent; ``uuid`` the NVML UUID; ``note`` a remark for the screen
    (``"MIG parent"``, why a device is N/A).
    """

    t: float
    device: str
    name: str
    backend: str
    total_bytes: Reading
    used_bytes: Reading
    free_bytes: Reading
    ours_bytes: Reading
    others_bytes: Reading
    uuid: str | None = None
    reserved_bytes: Reading = Reading(None, "not reported by this backend")
    utilization_pct: Reading = Reading(None, "not reported by this backend")
    note: str | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"t": self.t, "device": self.device, "name": self.name, "backend": self.backend}
        d.update({k: getattr(self, k).to_json() for k in _READINGS + _OPTIONAL_READINGS})
        if self.uuid is not None:
            d["uuid"] = self.uuid
        if self.note is not None:
            d["note"] = self.note
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DeviceSample:
        """Inverse of :meth:`to_json`; keys it does not know (such as a recording's ``frame``) are ignored."""
        readings = {k: Reading.from_json(d[k]) for k in _READINGS}
        optional = {k: Reading.from_json(d[k]) for k in _OPTIONAL_READINGS if k in d}
        return cls(t=d["t"], device=d["device"], name=d["name"], backend=d["backend"], **readings, **optional,
                   uuid=d.get("uuid"), note=d.get("note"))


class Backend(Protocol):
    """Something that reads every device's memory. ``sample`` returns one :class:`DeviceSample` per device, in a
    stable order, with unavailable figures as :class:`Reading` reasons; it may raise only when nothing can be read."""

    name: str

    def sample(self, pids: set[int]) -> list[DeviceSample]: ...


class HostBackend:
    """Host memory (one device, ``"cpu"``) from psutil.

    - total: ``virtual_memory().total``; free: ``available`` (what can be given to processes without swapping);
      where a cgroup memory limit is tighter, the limit and its headroom (:func:`core.monitor.hostmem.host_memory`);
    - used: ``total - available``, so page cache and other reclaimable memory are not counted as used;
    - ours: the sum of RSS of each followed pid and all its descendants. RSS counts shared pages (libraries, forked
      copy-on-write pages) in every process that maps them, so a process tree can be over-counted.
    Followed processes that have exited (or whose pid was reused) are skipped.
    """

    name = "host"

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}  # kept so is_running() detects a reused pid

    def _ours(self, pids: set[int]) -> tuple[Reading, Reading]:
        """RSS of the followed processes and their descendants, and the anonymous part of it (RSS minus file-backed
        and shared pages: ``rss - shared`` of /proc/PID/statm), both in bytes."""
        if not pids:
            return (Reading(None, "no probe process running"),) * 2
        self._procs = {p: self._procs.get(p) or _process(p) for p in pids}
        rss: dict[int, tuple[int, int]] = {}
        for proc in self._procs.values():
            try:
                if proc is None or not proc.is_running():
                    continue
                for member in [proc, *proc.children(recursive=True)]:
                    try:
                        info = member.memory_info()
                        rss[member.pid] = (info.rss, max(info.rss - getattr(info, "shared", 0), 0))
                    except psutil.Error:  # vanished, zombie, or not ours to read
                        pass
            except psutil.Error:
                pass
        if not rss:
            return (Reading(None, "followed processes have exited"),) * 2
        return Reading(sum(r for r, _ in rss.values())), Reading(sum(a for _, a in rss.values()))

    def sample(self, pids: set[int]) -> list[DeviceSample]:
        """The host's memory; ``ours`` is the followed processes' RSS (as their peak RSS is reported), and ``others``
        is "used" (total - available) minus their anonymous pages only: the file pages in their RSS (libraries,
        memory-mapped weights) are page cache, which "used" does not count, so ``used - RSS`` went to 0 while a
        probe ran."""
        from core.monitor.hostmem import host_memory

        host = host_memory()
        used = Reading(host.total_bytes - host.available_bytes)
        ours, anon = self._ours(pids)
        name = "host memory" if host.cgroup is None else f"host memory (cgroup v{host.cgroup.version} limit)"
        return [DeviceSample(t=time.time(), device="cpu", name=name, backend=self.name,
                             total_bytes=Reading(host.total_bytes), used_bytes=used,
                             free_bytes=Reading(host.available_bytes), ours_bytes=ours,
                             others_bytes=others_reading(used, anon))]


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


class ReplayBackend:
    """Plays back frames (each frame: the samples of one ``sample()`` call), one frame per call, then stays on the last.

    The samples are returned exactly as recorded (their ``t`` and ``backend`` included); ``pids`` are ignored.
    """

    name = "replay"

    def __init__(self, frames: Iterable[list[DeviceSample]]) -> None:
        self.frames = [list(f) for f in frames]
        if not self.frames:
            raise ValueError("ReplayBackend needs at least one frame")
        self._next = 0
        self._lock = threading.Lock()

    def sample(self, pids: set[int]) -> list[DeviceSample]:
        with self._lock:
            frame = self.frames[min(self._next, len(self.frames) - 1)]
            self._next += 1
        return list(frame)

    @classmethod
    def from_jsonl(cls, path: str | Path) -> ReplayBackend:
        """Read what :meth:`Sampler.record` wrote: one sample a line, grouped into frames by their ``frame`` number
        (or, in files without one, by equal ``t``); a device seen twice also starts a new frame."""
        frames: list[list[DeviceSample]] = []
        key = object()
        for line in Path(path).read_text().splitlines():
            if not line.strip():
                continue
            d = json.loads(line)
            k = d.get("frame", ("t", d["t"]))
            if not frames or k != key or any(s.device == d["device"] for s in frames[-1]):
                frames.append([])
                key = k
            frames[-1].append(DeviceSample.from_json(d))
        return cls(frames)


def constructed_frames(device: str = "cuda:0", name: str = "Test GPU", total: int = 80 * 2**30,
                       ours: Iterable[int | None] = (0, 2**30, 4 * 2**30, 8 * 2**30, 6 * 2**30),
                       others: int | Iterable[int] = 2**30, t0: float = 1_700_000_000.0,
                       dt: float = 0.1) -> list[list[DeviceSample]]:
    """Deterministic frames for one device, for tests and snapshots.

    Frame i has ``ours[i]`` bytes (None: no probe running, and others is then N/A as from a real backend) and ``others``
    bytes (one value, or one per frame) of other processes; used = ours + others, free = total - used, t = t0 + i * dt.
    Combine devices with ``[a + b for a, b in zip(frames0, frames1)]``."""
    ours = list(ours)
    others_list = [others] * len(ours) if isinstance(others, int) else list(others)
    if len(others_list) != len(ours):
        raise ValueError("others must be one value or one per frame")
    frames = []
    for i, (o, x) in enumerate(zip(ours, others_list)):
        used = (o or 0) + x
        ours_r = Reading(o) if o is not None else Reading(None, "no probe process running")
        frames.append([DeviceSample(t=t0 + i * dt, device=device, name=name, backend="replay",
                                    total_bytes=Reading(total), used_bytes=Reading(used),
                                    free_bytes=Reading(total - used),
                                    ours_bytes=ours_r, others_bytes=others_reading(Reading(used), ours_r))])
    return frames


class Sampler:
    """Samples a backend every ``interval_s`` seconds on a daemon thread; keeps the last ``history`` samples per device.

    Thread-safe: the UI thread reads (:meth:`latest`, :meth:`history`, peaks) while the sampling thread writes. An
    exception from the backend never kills the thread: it is kept in :attr:`last_error` (the most recent one, not
    cleared by later successes) and counted in :attr:`error_count`.
    """

    def __init__(self, backend: Backend, interval_s: float = 0.1, history: int = 600) -> None:
        self.backend = backend
        self.interval_s = interval_s
        self._maxlen = history
        self._lock = threading.Lock()
        self._pids: set[int] = set()
        self._generation = 0  # bumped by follow(), so a sample taken for the old pids does not touch the new peaks
        self._latest: list[DeviceSample] = []
        self._history: dict[str, collections.deque[DeviceSample]] = {}
        self._peak_ours: dict[str, int] = {}
        self._peak_used: dict[str, int] = {}
        self._record_file: Any = None
        self._frame = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.last_error: BaseException | None = None
        self.error_count = 0

    def follow(self, pids: set[int]) -> None:
        """Count these processes (and, through the backend, their descendants) as ours; resets both peaks."""
        with self._lock:
            self._pids = set(pids)
            self._generation += 1
            self._peak_ours.clear()
            self._peak_used.clear()
        reset = getattr(self.backend, "reset_baseline", None)
        if reset is not None:  # NVML in a container: ours = the device's change since this moment (case M3)
            reset()

    def start(self) -> None:
        """Start the sampling thread (no-op when running)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="gpuaccept-monitor", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop and join the sampling thread and close the record file (no-op when stopped)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._lock:
            self._thread = None
            if self._record_file is not None:
                self._record_file.close()
                self._record_file = None

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.sample_once()
            except Exception as e:  # noqa: BLE001 - a failing read must not stop the bars
                with self._lock:
                    self.last_error = e
                    self.error_count += 1
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def sample_once(self) -> list[DeviceSample]:
        """Sample now (on the calling thread), add to history, peaks and the recording; backend errors propagate."""
        with self._lock:
            pids, generation = set(self._pids), self._generation
        samples = self.backend.sample(pids)  # outside the lock: a slow read must not block the UI's reads
        with self._lock:
            self._latest = list(samples)
            for s in samples:
                self._history.setdefault(s.device, collections.deque(maxlen=self._maxlen)).append(s)
                if generation == self._generation:
                    _raise_peak(self._peak_ours, s.device, s.ours_bytes)
                    _raise_peak(self._peak_used, s.device, s.used_bytes)
            if self._record_file is not None:
                for s in samples:
                    self._record_file.write(json.dumps({"frame": self._frame, **s.to_json()}) + "\n")
                self._record_file.flush()
                self._frame += 1
        return list(samples)

    def latest(self) -> list[DeviceSample]:
        """The samples of the most recent successful read, one per device ([] before the first)."""
        with self._lock:
            return list(self._latest)

    def history(self, device: str) -> list[DeviceSample]:
        """The last ``history`` samples of ``device``, oldest first."""
        with self._lock:
            return list(self._history.get(device, ()))

    def peak_ours(self, device: str) -> int | None:
        """Largest ours_bytes of ``device`` since :meth:`follow` was last called (None: none available)."""
        with self._lock:
            return self._peak_ours.get(device)

    def peak_used(self, device: str) -> int | None:
        """Largest used_bytes (whole device) of ``device`` since :meth:`follow` was last called."""
        with self._lock:
            return self._peak_used.get(device)

    def record(self, path: str | Path) -> None:
        """From now on also append every sample to ``path`` as a JSON line (``DeviceSample.to_json`` plus its frame
        number), flushed after each read; a previous recording is closed. :meth:`stop` ends the recording."""
        f = open(path, "a", encoding="utf-8")
        with self._lock:
            if self._record_file is not None:
                self._record_file.close()
            self._record_file = f


def _raise_peak(peaks: dict[str, int], device: str, reading: Reading) -> None:
    if reading.value is not None and reading.value > peaks.get(device, -1):
        peaks[device] = reading.value
