"""Starting, watching and killing the worker child process (:mod:`core.child.worker`).

The child runs in its own process group (``start_new_session``) with stdin from /dev/null and stdout/stderr appended to
``child.log`` in its job directory, so nothing it prints reaches the terminal (which would corrupt a Textual screen).
Events come back over ``events.jsonl``. Killing means SIGKILL to the whole process group: killing only a wrapper
orphans the Python child (docs/architecture.md §6). Under torchrun every rank runs in a session of its own (torch.distributed.run
starts its workers with ``start_new_session``), so each rank's group is killed too (:func:`child_groups`), and each
worker also ends itself within a second when this process is gone (``GPUACCEPT_PARENT_PID``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core import forkserver
from core.errors import StageCancelled, StageError
from core.interpreter import child_env, python_argv
from core.protocol.determinism import determinism_env
from core.protocol.events import ChildError, ChildEvent, Started, read_events
from core.protocol.job import Job
from core.stages.noise import deterministic_kernels


@dataclass
class ChildJob:
    """One child run: its job directory holds ``job.json``, ``events.jsonl``, ``child.log`` and ``output/``."""

    name: str
    job_dir: Path
    job: Job  # what job.json says (core.protocol.job), with its events file and output folder filled in
    proc: forkserver.Process | None = None  # subprocess.Popen, or a child forked by core.forkserver
    events: list[ChildEvent] = field(default_factory=list)  # every event read so far, typed (core.protocol.events)
    nproc: int = 1  # processes torchrun starts (1: no torchrun)
    oom_kills_at_start: int | None = None  # the kernel's OOM-kill count when the child started (oom_kill_count)
    peak_rss_bytes: int = 0  # the largest RSS of the child's process tree seen by sample_rss
    _offsets: dict[str, int] = field(default_factory=dict)
    _sampled_at: float = 0.0

    @property
    def pid(self) -> int:
        """The started process's pid (torchrun's under torchrun), which leads its process group.

        Raises:
            RuntimeError: the job was not started (:func:`start_child` sets ``proc``)."""
        if self.proc is None:
            raise RuntimeError(f"child {self.name} was not started")
        return self.proc.pid

    @property
    def events_path(self) -> Path:
        return self.job_dir / "events.jsonl"

    @property
    def log_path(self) -> Path:
        return self.job_dir / "child.log"

    @property
    def output_dir(self) -> Path:
        return self.job_dir / "output"


@dataclass(frozen=True)
class Launch:
    """How a stage's children start (:func:`launch_options`): one process, or ``nproc`` ranks under torchrun.

    Attributes:
        nproc: processes on this node; above 1 they run under torchrun.
        torchrun_args: torchrun's options (:meth:`core.spec.TorchrunSettings.args`); None: ``--standalone
            --nproc-per-node nproc``. Given for several nodes even with one process each.
        visible_devices: the device names the ranks use, in local-rank order (CUDA ones become
            ``CUDA_VISIBLE_DEVICES``); None: the stage's one device.
        alloc_conf: the caching allocator's configuration the children run under (the spec's ``alloc_conf``, set as
            ``PYTORCH_ALLOC_CONF`` and ``PYTORCH_CUDA_ALLOC_CONF``: the plan simulated it); "": the environment's.
        deterministic: the children run CUDA's deterministic kernels (the resume check's exact mode,
            core/protocol/determinism.py: :func:`core.stages.noise.deterministic_kernels`).
    """

    nproc: int = 1
    torchrun_args: list[str] | None = None
    visible_devices: list[str] | None = None
    alloc_conf: str = ""
    deterministic: bool = False

    @property
    def torchrun(self) -> bool:
        """The children run under torchrun (several ranks, or several nodes)."""
        return self.nproc > 1 or bool(self.torchrun_args)

    def names(self, device: str) -> list[str]:
        """The devices the ranks use: :attr:`visible_devices`, or the stage's one ``device``."""
        return list(self.visible_devices) if self.visible_devices else [device]


#: one process on the stage's device: what every stage runs unless the strategy asks for ranks
SINGLE = Launch()


def start_child(name: str, job_dir: Path, job: Job, launch: Launch = SINGLE,
                module: str = "core.child.worker") -> ChildJob:
    """Write ``job.json`` and start ``python -m <module>`` on it (by default :mod:`core.child.worker` on a
    :class:`~core.protocol.job.WorkerJob`; command mode's evaluation runs :mod:`core.child.checkpoint_eval` on an
    :class:`~core.protocol.job.EvalJob`) in a new process group. The job's events file and output folder are filled
    in here (``events.jsonl`` and ``output/`` in ``job_dir``) unless it names them.

    With ``nproc`` > 1 (or ``torchrun_args``, for several nodes) it runs under torchrun (``torch.distributed.run``),
    by default ``--standalone --nproc-per-node nproc``; torchrun starts each rank in a session of its own, so
    :func:`kill_group` kills the rank groups it learned from their ``started`` events too. Each rank writes its own
    events file (:func:`core.protocol.events.rank_events_path`).

    Args:
        launch: how many ranks and with which torchrun options (:class:`Launch`). Its CUDA ``visible_devices``
            (``cuda:2``) become ``CUDA_VISIBLE_DEVICES`` (composed with the parent's own), so local rank r uses
            ``cuda:r`` inside the child, which is the r-th device named.
    """
    job_dir.mkdir(parents=True, exist_ok=True)
    nproc, torchrun = launch.nproc, launch.torchrun
    child = ChildJob(name=name, job_dir=job_dir, job=job, nproc=nproc, oom_kills_at_start=oom_kill_count())
    child.job = job.placed(str(child.events_path), str(child.output_dir))
    (job_dir / "job.json").write_text(child.job.to_json(), encoding="utf-8")
    env = child_env()
    if launch.alloc_conf:  # PyTorch reads PYTORCH_ALLOC_CONF first, the older name otherwise (AllocatorConfig.cpp)
        env["PYTORCH_ALLOC_CONF"] = env["PYTORCH_CUDA_ALLOC_CONF"] = launch.alloc_conf
    if launch.deterministic:  # before the child starts: cuBLAS reads its workspace configuration once
        env.update(determinism_env())
    cuda = [d for d in (launch.visible_devices or []) if d.startswith("cuda")]
    if cuda:
        env["CUDA_VISIBLE_DEVICES"] = visible_for(cuda, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if not torchrun:  # one process: forked from the fork server when it can (core.forkserver), else spawned
        forked = forkserver.start(module, [str(job_dir / "job.json")], child.log_path, env)
        if forked is not None:
            child.proc = forked
            return child
    launcher = launch.torchrun_args or ["--standalone", f"--nproc-per-node={nproc}"]
    with open(child.log_path, "ab") as log, open(os.devnull, "rb") as devnull:
        child.proc = subprocess.Popen(
            # -P: never import from the current directory (a user's own `core/` must not shadow ours)
            python_argv(module, str(job_dir / "job.json")) if not torchrun else
            python_argv("torch.distributed.run", *launcher, "-m", module, str(job_dir / "job.json")),
            stdin=devnull,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: SIGKILL reaches the whole tree
            env=env,
        )
    return child


def launch_options(spec: Any, names: list[str]) -> Launch:
    """How to start the children of ``spec`` whose ranks use the devices ``names`` on this node (:class:`Launch`). One
    process for strategies that do not run under torchrun (:meth:`core.spec.RunSpec.local_world_size`)."""
    nproc = spec.local_world_size(len(names))
    conf = spec.alloc_conf
    exact = spec.training and any(deterministic_kernels(n, spec.accept.resume_tier, spec.resume.noise) for n in names)
    if spec.strategy == "device_map":  # one process over every device named
        return Launch(visible_devices=list(names), alloc_conf=conf, deterministic=exact)
    if nproc == 1 and spec.torchrun.nnodes == 1:
        return Launch(alloc_conf=conf, deterministic=exact)
    return Launch(nproc=nproc, torchrun_args=spec.torchrun.args(nproc), visible_devices=list(names), alloc_conf=conf,
                  deterministic=exact)


def visible_for(names: list[str], parent_visible: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a child that should see the CUDA devices ``names`` (this process's numbering):
    their indices, mapped through the parent's own ``CUDA_VISIBLE_DEVICES`` when it has one.

    Raises:
        StageError: a name whose index the parent's ``CUDA_VISIBLE_DEVICES`` does not have.
    """
    indices = [int(n.split(":", 1)[1]) for n in names]
    if not parent_visible:
        return ",".join(map(str, indices))
    outer = [v.strip() for v in parent_visible.split(",") if v.strip()]
    missing = [f"cuda:{i}" for i in indices if i >= len(outer)]
    if missing:
        raise StageError(f"{', '.join(missing)} not visible: CUDA_VISIBLE_DEVICES={parent_visible} names "
                         f"{len(outer)} device(s)")
    return ",".join(outer[i] for i in indices)


def poll_events(child: ChildJob) -> list[ChildEvent]:
    """New complete events since the last call (also kept in ``child.events``), from every rank's events file in the
    job directory (rank numbers are global: on a second node they do not start at 0), each parsed once.

    Raises:
        EventFormatError: a line that is no child event (:func:`core.protocol.events.read_events`)."""
    new: list[ChildEvent] = []
    ranks = child.job_dir.glob(f"{child.events_path.stem}.rank*{child.events_path.suffix}")
    paths = [child.events_path, *sorted(ranks)]
    for path in paths:
        got, child._offsets[str(path)] = read_events(path, child._offsets.get(str(path), 0))
        new.extend(got)
    child.events.extend(new)
    return new


def watch(
    child: ChildJob,
    interval_s: float = 0.1,
    stop_when: Callable[[ChildEvent], bool] | None = None,
    cancelled: Callable[[], bool] | None = None,
    until: Callable[[], bool] | None = None,
) -> Iterator[ChildEvent]:
    """Yield the child's typed events (:mod:`core.protocol.events`) as they arrive, until it exits (or
    ``stop_when(event)`` is true, or ``until()`` is: the child is left running for the caller).

    When ``cancelled()`` becomes true the child's process group is killed and :class:`StageError` is raised; a line
    that is no event raises :class:`~core.protocol.events.EventFormatError` (the child is killed too).
    """
    assert child.proc is not None
    finished = False
    stopped_since: float | None = None
    try:
        while True:
            for event in poll_events(child):
                yield event
                if stop_when is not None and stop_when(event):
                    finished = True
                    return
            if cancelled is not None and cancelled():
                raise StageCancelled(f"{child.name}: cancelled; the child's process group was killed")
            if process_stopped(child.pid):  # SIGSTOP, SIGTSTP, a debugger: it would never answer
                stopped_since = stopped_since if stopped_since is not None else time.monotonic()
                if time.monotonic() - stopped_since > STOPPED_CHILD_S:
                    raise StageError(f"{child.name}: child {child.pid} was stopped (state T: SIGSTOP or SIGTSTP?) "
                                     f"for {STOPPED_CHILD_S:.0f} s; its process group was killed (log: "
                                     f"{child.log_path})")
            else:
                stopped_since = None
            if until is not None and until():
                finished = True
                return
            if child.proc.poll() is not None:
                for event in poll_events(child):  # what it wrote just before exiting
                    yield event
                finished = True
                return
            sample_rss(child)
            time.sleep(interval_s)
    finally:
        # Cancelled, interrupted (Ctrl-C), or the consumer stopped reading: never leave the child running.
        if not finished and child.proc.poll() is None:
            kill_group(child)


#: seconds a stage child may stay stopped (``T`` in /proc: SIGSTOP, SIGTSTP) before the stage names it and kills it
STOPPED_CHILD_S = 5.0


def process_stopped(pid: int) -> bool:
    """The process is stopped by a signal (state ``T``; ``t``, traced, too), from ``/proc/PID/stat``; False where it
    cannot be read (gone, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    end = stat.rfind(b")")  # the command name may hold spaces and parentheses: the state follows the last ")"
    return end >= 0 and stat[end + 2:end + 3] in (b"T", b"t")


def child_groups(child: ChildJob) -> list[int]:
    """Every process group of the child: its own (it leads it: ``start_new_session``), and under torchrun each rank's,
    from the rank's ``started`` event: torch.distributed.run starts every worker in a new session of its own, so
    killing torchrun's group does not reach the ranks."""
    assert child.proc is not None
    poll_events(child)
    ranks = sorted({e.pgid for e in child.events if isinstance(e, Started) and e.pgid})
    return [child.pid, *[g for g in ranks if g != child.pid]]


def kill_group(child: ChildJob, timeout_s: float = 10.0) -> int:
    """SIGKILL every process group of the child (:func:`child_groups`: torchrun's and each rank's) and reap it.
    Returns the child's own process group id."""
    assert child.proc is not None
    pgid = child.pid  # start_new_session: the child leads its own group
    for group in reversed(child_groups(child)):  # the ranks first, then torchrun (which would signal them)
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        child.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be caught
        pass
    return pgid


def group_alive(pgid: int) -> bool:
    """True while a process of group ``pgid`` still runs: signal 0 probes the group without killing, and a group
    holding only zombies (killed, not yet reaped: a killed torchrun's ranks wait for init to reap them) is not
    running."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    import psutil

    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.info["pid"]) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, PermissionError):
            continue
    return False


#: how long a SIGKILLed group may take to be gone: the kernel tears a process down asynchronously (a rank holding
#: gigabytes of mappings takes a while), and torchrun's ranks are reaped by init, not by us
KILL_SETTLE_S = 10.0


def groups_left_after_kill(groups: list[int], timeout_s: float = KILL_SETTLE_S, interval_s: float = 0.05) -> list[int]:
    """The groups of ``groups`` with a live (non-zombie) process after polling until none is left or ``timeout_s``
    has passed: a kill check that looked once, 50 ms after SIGKILL, could find a rank still being torn down."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [g for g in groups if group_alive(g)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(interval_s)


def check_exit(child: ChildJob) -> None:
    """Raise :class:`StageError` naming the child's error and log if it exited non-zero; a child the kernel's OOM
    killer ended is said to be out of memory, with the peak RSS seen (:func:`killed_note`)."""
    assert child.proc is not None
    rc = child.proc.wait()
    if rc != 0:
        errors = [e.error for e in child.events if isinstance(e, ChildError)]
        why = errors[-1] if errors else f"exit status {rc}"
        why += killed_note(rc, child.oom_kills_at_start, child.peak_rss_bytes)
        raise StageError(f"{child.name} failed: {why}{disk_note(child.job_dir)} (see {child.log_path})")


#: how often :func:`sample_rss` reads the child's process tree (psutil walks /proc; not every 0.1 s poll)
RSS_SAMPLE_S = 0.25


def sample_rss(child: ChildJob) -> None:
    """Read the RSS of the child's whole process tree (torchrun and its ranks) into ``child.peak_rss_bytes`` when
    :data:`RSS_SAMPLE_S` has passed since the last reading. A sampled peak: a spike shorter than the interval can be
    missed, so it is a lower bound of the true peak."""
    import psutil

    now = time.monotonic()
    if child.proc is None or now - child._sampled_at < RSS_SAMPLE_S:
        return
    child._sampled_at = now
    try:
        root = psutil.Process(child.pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    total = 0
    for proc in tree:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    child.peak_rss_bytes = max(child.peak_rss_bytes, total)


def oom_kill_count(vmstat: Path = Path("/proc/vmstat")) -> int | None:
    """How many processes the kernel's OOM killer has killed since boot (``oom_kill`` of ``/proc/vmstat``, Linux
    4.13+: global and cgroup OOM kills alike), or None where it cannot be read."""
    try:
        for line in vmstat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def killed_note(rc: int, oom_kills_before: int | None, peak_rss_bytes: int,
                oom_kills_now: int | None = None) -> str:
    """What to add to the failure of a child that exited with ``rc``: when the kernel's OOM kill count rose while it ran
    (a rank killed under torchrun counts too), that it ran out of memory; for another SIGKILL gpuaccept did not send,
    that the OOM killer is the usual sender. Both with the peak RSS seen and the host memory this process may use (a
    cgroup's limit where one applies: :func:`core.monitor.hostmem.host_memory`); ``""`` for any other exit.

    Args:
        rc: ``Popen.returncode`` (``-9`` for SIGKILL).
        oom_kills_before: :func:`oom_kill_count` when the child started.
        oom_kills_now: the count now (read when None).
    """
    if rc == 0:
        return ""
    now = oom_kill_count() if oom_kills_now is None else oom_kills_now
    oom = oom_kills_before is not None and now is not None and now > oom_kills_before
    if rc != -signal.SIGKILL and not oom:
        return ""
    from core.monitor.hostmem import host_memory

    peak = f"{peak_rss_bytes / 2**30:.2f} GiB" if peak_rss_bytes else "not sampled"
    host = host_memory()
    where = f"{host.available_bytes / 2**30:.2f} of {host.total_bytes / 2**30:.2f} GiB available now ({host.source})"
    if oom:  # under torchrun the killed rank's torchrun exits 1: the count says what happened
        signal_said = " (SIGKILL)" if rc == -signal.SIGKILL else ""
        return (f"{signal_said}: out of memory: the kernel's OOM killer ended a process (/proc/vmstat oom_kill "
                f"{oom_kills_before} -> {now}); peak RSS of its processes seen {peak}; host memory: {where}")
    return (f" (SIGKILL, not sent by gpuaccept; the kernel's OOM killer is the usual sender, see `dmesg`); peak RSS "
            f"of its processes seen {peak}; host memory: {where}")


#: below this many free bytes on the run folder's disk, a child's failure says so (a full disk fails a checkpoint write
#: with whatever the writer says: torch.save's "basic_ios::clear: iostream error", safetensors' "I/O error")
LOW_DISK_BYTES = 64 * 2**20


def disk_note(folder: Path) -> str:
    """``"; the disk holding <folder> has N bytes free"`` when it has under LOW_DISK_BYTES free, else ``""``."""
    import shutil

    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return ""
    if free >= LOW_DISK_BYTES:
        return ""
    return f"; the disk holding {folder} has {free:,} bytes free (No space left on device?)"
