"""Host memory as this process may use it: the machine's available memory, or less where a cgroup limits it.

A job in a container or a batch slot (Slurm, Kubernetes, systemd) is held to its cgroup's memory limit, not to the
machine's: ``psutil.virtual_memory().available`` there says what the *machine* has free, and a process that plans
with it is killed by the kernel's OOM killer at the limit. The capacity is the smaller of the two, and
:attr:`HostMemory.source` says which applied.

- **cgroup v2** (``/proc/self/cgroup`` line ``0::<path>``): ``memory.max`` ("max": no limit) and ``memory.current``
  of the process's cgroup and of every ancestor up to the mount point (an ancestor's limit holds as well;
  kernel Documentation/admin-guide/cgroup-v2.rst, "memory.max").
- **cgroup v1** (a line ``N:...memory...:<path>``): ``memory.limit_in_bytes`` and ``memory.usage_in_bytes`` of the
  same walk under the ``memory`` controller's mount (a limit of 2^63 rounded down to a page is "no limit";
  Documentation/admin-guide/cgroup-v1/memory.rst).
- What a cgroup counts as used includes page cache the kernel reclaims before it OOM-kills, so the headroom is the
  limit minus the *working set*: usage minus ``inactive_file`` of ``memory.stat`` (``total_inactive_file`` on v1),
  the convention of the kubelet's eviction and of ``docker stats``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: v1 writes "no limit" as the largest page-aligned int64; anything from 2^62 up is taken as unlimited.
UNLIMITED = 2**62


@dataclass(frozen=True)
class CgroupLimit:
    """The tightest memory limit over a cgroup and its ancestors.

    Attributes:
        version: 1 or 2.
        path: the cgroup directory whose limit is the tightest.
        limit_bytes: its limit.
        headroom_bytes: limit minus its working set (usage minus inactive file pages), >= 0.
    """

    version: int
    path: Path
    limit_bytes: int
    headroom_bytes: int

    def describe(self) -> str:
        return (f"cgroup v{self.version} memory limit {self.limit_bytes / 2**30:.2f} GiB ({self.path}): "
                f"{self.headroom_bytes / 2**30:.2f} GiB left in it")


@dataclass(frozen=True)
class HostMemory:
    """What the host gives this process (bytes) and which rule decided it.

    Attributes:
        total_bytes: the machine's memory, or the cgroup limit when smaller.
        available_bytes: what a new process may use now: ``psutil`` available, or the cgroup headroom when smaller.
        source: in words, e.g. "available host memory (psutil)" or "cgroup v2 memory limit 8.00 GiB (...): ...".
        cgroup: the limit found, or None.
    """

    total_bytes: int
    available_bytes: int
    source: str
    cgroup: CgroupLimit | None = None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= UNLIMITED else value


def _inactive_file(folder: Path, version: int) -> int:
    key = "inactive_file" if version == 2 else "total_inactive_file"
    try:
        for line in (folder / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_paths(proc_cgroup: str) -> dict[int, str]:
    """``{2: path}`` from the unified line ``0::<path>``, ``{1: path}`` from the v1 line whose controllers include
    ``memory``."""
    out: dict[int, str] = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        ident, controllers, path = parts
        if ident == "0" and controllers == "":
            out.setdefault(2, path)
        elif "memory" in controllers.split(","):
            out[1] = path
    return out


def cgroup_limit(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
                 ) -> CgroupLimit | None:
    """The tightest memory limit of this process's cgroup and its ancestors, or None when there is none (or no
    cgroup file system to read). v1's ``memory`` controller is read where it is mounted (a hybrid host mounts v2 at
    ``root/unified`` without the memory controller); else v2's ``memory.max``.

    Args:
        root: where the cgroup file systems are mounted.
        proc_cgroup: the process's ``/proc/<pid>/cgroup``.
    """
    try:
        paths = _cgroup_paths(proc_cgroup.read_text())
    except OSError:
        return None
    candidates: list[tuple[int, Path]] = []
    if 1 in paths and (root / "memory").is_dir():
        candidates.append((1, root / "memory"))
    if 2 in paths:
        for base in (root, root / "unified"):
            if (base / "cgroup.controllers").is_file():
                candidates.append((2, base))
                break
    best: CgroupLimit | None = None
    for version, base in candidates:
        limit_file, usage_file = (("memory.max", "memory.current") if version == 2
                                  else ("memory.limit_in_bytes", "memory.usage_in_bytes"))
        folder = base / paths[version].lstrip("/")
        # inside a cgroup namespace the path names a folder that is not there: the mount point is our own cgroup
        while not folder.is_dir() and folder != base:
            folder = folder.parent
        while True:
            limit = _read_int(folder / limit_file)
            usage = _read_int(folder / usage_file)
            if limit is not None and usage is not None:
                headroom = max(0, limit - max(0, usage - _inactive_file(folder, version)))
                if best is None or headroom < best.headroom_bytes:
                    best = CgroupLimit(version, folder, limit, headroom)
            if folder == base:
                break
            folder = folder.parent
    return best


def host_memory(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> HostMemory:
    """The host memory this process may use now (:class:`HostMemory`): psutil's, or a cgroup's where it is smaller."""
    import psutil

    vm = psutil.virtual_memory()
    limit = cgroup_limit(root, proc_cgroup)
    if limit is None or limit.headroom_bytes >= vm.available:
        return HostMemory(int(vm.total), int(vm.available), "available host memory (psutil)", limit)
    return HostMemory(min(int(vm.total), limit.limit_bytes), limit.headroom_bytes, limit.describe(), limit)
