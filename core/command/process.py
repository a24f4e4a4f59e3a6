"""The user's command as a process tree: started in a session of its own, every process of it found, measured from
outside, and killed, every rank.

- **Start** (:func:`start_job`): the command's words (no shell) in its ``workdir``, stdin from /dev/null, stdout and
  stderr appended to ``command.log`` (nothing reaches the terminal; capped at :data:`LOG_CAP_BYTES`, the tail kept), in
  a session of its own, as the child of a keeper (core/command/keeper.py): the command's processes are held by a cgroup
  of their own where one can be made, and by the keeper as their subreaper everywhere, so that none outlives gpuaccept.
  ``GPUACCEPT_CONTAINMENT`` (``auto``, ``cgroup``, ``subreaper``) chooses; the record's ``containment`` says which.
  Its environment is the user's, plus ``PYTHONPATH`` led by ``core/child/inject`` (the Trainer hook, installed only in
  a Python that imports transformers' Trainer), ``GPUACCEPT_EVENTS`` (the hook's events file), ``GPUACCEPT_JOB`` (a
  token naming this run), ``GPUACCEPT_PARENT_PID`` (every Python process of the job ends itself when gpuaccept is
  gone) and ``PYTHONUNBUFFERED=1``.
- **Members** (:func:`members`): the keeper's descendants (a process that daemonised is re-parented to the keeper),
  the members of the job's cgroup, and every process whose environment holds the job's token; never the keeper.
- **Memory from outside** (:func:`sample_memory`): the RSS of every member, summed per rank (the ``LOCAL_RANK`` of its
  environment: ``cpu:<r>``; ``cpu`` without ranks; the launcher apart) and, where NVML runs, each CUDA device's memory
  held by the members (NVML's per-process list). A sampled peak: a spike shorter than the interval can be missed.
- **Kill** (:func:`kill_job`): SIGKILL to every member and every process group they lead, then polled until none is
  left (:data:`core.stages.childproc.KILL_SETTLE_S`), naming any that is.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import StageError

#: the folder whose sitecustomize.py installs the Trainer hook (core/child/inject)
INJECT_DIR = Path(__file__).resolve().parents[1] / "child" / "inject"
JOB_ENV, EVENTS_ENV, HOLD_ENV, OWNER_ENV = "GPUACCEPT_JOB", "GPUACCEPT_EVENTS", "GPUACCEPT_HOLD_AT_STEP", \
    "GPUACCEPT_PARENT_PID"
#: how often the environments of every process on the machine are read to find members that left the tree
ENV_SCAN_S = 1.0
#: the cap of a run's command.log in bytes (the tail is kept, with a line saying how much was cut)
LOG_CAP_BYTES = 64 * 2**20
#: how the command's processes are held: auto (a cgroup where one can be made, else the keeper as subreaper), cgroup, or
#: subreaper (core/command/keeper.py)
CONTAINMENT_ENV = "GPUACCEPT_CONTAINMENT"
#: seconds gpuaccept waits for the keeper to say the command started
KEEPER_START_S = 30.0


@dataclass
class Job:
    """One run of the user's command: its words, folder, process and what was seen of it.

    Attributes:
        known: every member ever seen, ``pid -> create_time`` (a reused pid is another process).
        ranks: ``pid -> device label`` from the member's environment (``cpu:<LOCAL_RANK>``, ``cpu``, ``launcher``).
        peaks: the largest sampled bytes per device label (``cpu``, ``cpu:0``, ``cuda:1``), and ``tree`` (all RSS).
    """

    name: str
    argv: list[str]
    job_dir: Path
    proc: subprocess.Popen[bytes]  # the keeper: it exits with the command's status
    token: str
    started: float
    root_pid: int = 0  # the command's first process (the keeper's child)
    oom_kills_at_start: int | None = None  # /proc/vmstat's oom_kill when it started (core.stages.childproc)
    containment: str = ""  # how its processes are held (the keeper's words)
    cgroup: Path | None = None
    known: dict[int, float] = field(default_factory=dict)
    ranks: dict[int, str] = field(default_factory=dict)
    peaks: dict[str, int] = field(default_factory=dict)
    _scanned: float = 0.0

    @property
    def log_path(self) -> Path:
        return self.job_dir / "command.log"

    @property
    def events_path(self) -> Path:
        return self.job_dir / "hook-events.jsonl"

    @property
    def memory_path(self) -> Path:
        return self.job_dir / "memory.jsonl"

    @property
    def report_path(self) -> Path:
        return self.job_dir / "keeper.json"

    def report(self) -> dict[str, Any]:
        """What the keeper wrote when the command ended (core/command/keeper.py); {} before, or where it could not."""
        try:
            return dict(json.loads(self.report_path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            return {}


def job_env(base: Mapping[str, str], extra: Mapping[str, str], events: Path, token: str,
            hold_at_step: int | None = None) -> dict[str, str]:
    """The command's environment: ``base`` (this process's), the spec's ``extra``, and gpuaccept's variables (see the
    module docstring); ``hold_at_step`` makes a Trainer hold after that optimizer step (the kill of the resume check)."""
    env = {**base, **extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(INJECT_DIR), env.get("PYTHONPATH", "")) if p)
    env[EVENTS_ENV] = str(events)
    env[JOB_ENV] = token
    env[OWNER_ENV] = str(os.getpid())
    env["PYTHONUNBUFFERED"] = "1"
    env.pop(HOLD_ENV, None)
    if hold_at_step:
        env[HOLD_ENV] = str(hold_at_step)
    return env


def start_job(name: str, argv: list[str], cwd: Path, job_dir: Path, extra_env: Mapping[str, str],
              hold_at_step: int | None = None) -> Job:
    """Start ``argv`` in ``cwd`` in a session of its own (see the module docstring); ``job_dir`` gets its log, the
    hook's events, its memory samples and ``job.json`` (the words, the folder, the variables gpuaccept added).

    Raises:
        StageError: the program cannot be started (not found, not executable), naming it.
    """
    job_dir.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    events = job_dir / "hook-events.jsonl"
    env = job_env(os.environ, extra_env, events, token, hold_at_step)
    containment = os.environ.get(CONTAINMENT_ENV, "auto") or "auto"
    if containment not in ("auto", "cgroup", "subreaper"):
        raise StageError(f"{CONTAINMENT_ENV}={containment!r} is not auto, cgroup or subreaper; unset it or choose one")
    added = {k: env[k] for k in (*extra_env, "PYTHONPATH", EVENTS_ENV, JOB_ENV, OWNER_ENV, HOLD_ENV) if k in env}
    job_json = job_dir / "job.json"
    job_json.write_text(json.dumps({"argv": argv, "cwd": str(cwd), "env_added": added}, indent=2), encoding="utf-8")
    from core.stages.childproc import oom_kill_count

    oom_kills = oom_kill_count()
    proc, said = _start_keeper(argv, cwd, env, job_dir, token, containment)
    if "start_error" in said or "root_pid" not in said:
        why = said.get("start_error") or said.get("keeper_error", "the keeper said nothing")
        raise StageError(f"{name}: {why}; check the command's program")
    cgroup = Path(said["cgroup"]) if said.get("cgroup") else None
    job = Job(name=name, argv=list(argv), job_dir=job_dir, proc=proc, token=token, started=time.monotonic(),
              root_pid=int(said["root_pid"]), containment=str(said.get("containment", "")), cgroup=cgroup,
              oom_kills_at_start=oom_kills)
    _replace_json(job_json, {"argv": argv, "cwd": str(cwd), "env_added": added, "keeper_pid": proc.pid,
                             "root_pid": job.root_pid, "cgroup": str(cgroup) if cgroup else None,
                             "containment": job.containment})
    job.known[job.root_pid] = _create_time(job.root_pid) or 0.0
    return job


def _replace_json(path: Path, value: dict[str, Any]) -> None:
    """Rewrite ``path`` as ``value`` by a rename, so that a reader (the reaper, a test) sees the old whole file or the
    new one, never a half-written one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(value, indent=2), encoding="utf-8")
    os.replace(tmp, path)


def _start_keeper(argv: list[str], cwd: Path, env: dict[str, str], job_dir: Path, token: str,
                  containment: str) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """Start the keeper of ``argv`` (core/command/keeper.py) and read its first line: (its process, what it said:
    ``root_pid``, ``containment``, ``cgroup``, or ``start_error``; ``keeper_error`` when it said nothing in time)."""
    import select
    import sys

    keeper = Path(__file__).with_name("keeper.py")
    words = [sys.executable, "-I", str(keeper), "--owner", str(os.getpid()), "--token", token,
             "--log", str(job_dir / "command.log"), "--log-cap", str(LOG_CAP_BYTES),
             "--report", str(job_dir / "keeper.json"), "--containment", containment, "--", *argv]
    with open(job_dir / "keeper.log", "ab") as err, open(os.devnull, "rb") as devnull:
        try:
            proc = subprocess.Popen(words, cwd=cwd, stdin=devnull, stdout=subprocess.PIPE, stderr=err,
                                    start_new_session=True, env=env)
        except OSError as exc:
            return _dead_keeper(), {"start_error": f"cannot start in {cwd} ({exc.strerror or exc})"}
    assert proc.stdout is not None
    line = b""
    deadline = time.monotonic() + KEEPER_START_S
    while not line.endswith(b"\n") and time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break
            line += chunk
    proc.stdout.close()
    try:
        said = dict(json.loads(line.decode("utf-8", errors="replace")))
    except ValueError:
        said = {"keeper_error": f"the keeper of the command did not start (see {job_dir / 'keeper.log'})"}
    if "root_pid" not in said:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc, said


def _dead_keeper() -> subprocess.Popen[bytes]:
    """A finished process in place of a keeper that could not start (its status is never read)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc


def _create_time(pid: int) -> float | None:
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def members(job: Job, scan_env: bool = False) -> list[Any]:
    """The live processes of the job (``psutil.Process``): the root's descendants, and with ``scan_env`` (or every
    :data:`ENV_SCAN_S`) every process whose environment holds the job's token. Each is remembered in ``job.known``."""
    import psutil

    found: dict[int, Any] = {}
    keeper = job.proc.pid
    try:
        for p in psutil.Process(keeper).children(recursive=True):  # the root and what it left behind, adopted
            found[p.pid] = p
    except psutil.Error:
        pass
    if job.cgroup is not None:
        from core.command.keeper import cgroup_members

        for pid in cgroup_members(job.cgroup):
            if pid not in found and pid != keeper:
                try:
                    found[pid] = psutil.Process(pid)
                except psutil.Error:
                    continue
    now = time.monotonic()
    if scan_env or now - job._scanned >= ENV_SCAN_S:
        job._scanned = now
        for p in psutil.process_iter():
            if p.pid in found or p.pid in (os.getpid(), keeper):
                continue
            try:
                if p.environ().get(JOB_ENV) == job.token:
                    found[p.pid] = p
            except psutil.Error:
                continue
    live = []
    for pid, p in found.items():
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            job.known.setdefault(pid, float(p.create_time()))
            if pid not in job.ranks:
                job.ranks[pid] = _rank_label(p)
            live.append(p)
        except psutil.Error:
            continue
    return live


def _rank_label(p: Any) -> str:
    """``cpu:<LOCAL_RANK>`` for a torchrun rank (and the processes it started), ``launcher`` for torchrun itself (a
    process whose children are ranks but which is none), ``cpu`` for a process without ranks."""
    import psutil

    try:
        env = p.environ()
    except psutil.Error:
        return "cpu"
    if "LOCAL_RANK" in env:
        return f"cpu:{env['LOCAL_RANK']}"
    if "TORCHELASTIC_RUN_ID" in env or p.name() in ("torchrun",) or "torch.distributed.run" in " ".join(p.cmdline()):
        return "launcher"
    return "cpu"


def sample_memory(job: Job, backend: Any = None) -> dict[str, int]:
    """One sample of the job's memory (see the module docstring): bytes per device label, ``tree`` for all of its RSS;
    raises ``job.peaks`` and appends the sample to ``memory.jsonl``. ``backend``: an NVML backend
    (:class:`core.monitor.nvml.NvmlBackend`) for the CUDA devices, or None on a box without one."""
    import psutil

    procs = members(job)
    sample: dict[str, int] = {}
    for p in procs:
        try:
            rss = int(p.memory_info().rss)
        except psutil.Error:
            continue
        label = job.ranks.get(p.pid, "cpu")
        sample[label] = sample.get(label, 0) + rss
        sample["tree"] = sample.get("tree", 0) + rss
    if backend is not None and getattr(backend, "name", "") == "nvml" and procs:
        try:
            for s in backend.sample({p.pid for p in procs}):
                if s.device.startswith("cuda") and s.ours_bytes.value:
                    sample[s.device] = int(s.ours_bytes.value)
        except Exception:  # noqa: BLE001 - a failed read leaves the GPUs out of this sample, said by their absence
            pass
    for label, value in sample.items():
        job.peaks[label] = max(job.peaks.get(label, 0), value)
    if sample:
        with open(job.memory_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"t": time.time(), **sample}) + "\n")
    return sample


@dataclass(frozen=True)
class KillResult:
    """What :func:`kill_job` did: the processes and groups sent SIGKILL, and any still alive after it settled."""

    pids: list[int]
    groups: list[int]
    left: list[int]

    @property
    def clean(self) -> bool:
        return not self.left

    def evidence(self) -> str:
        what = f"SIGKILL to {len(self.pids)} process(es) (pids {', '.join(map(str, self.pids[:8]))}" + \
               (" ..." if len(self.pids) > 8 else "") + f") and {len(self.groups)} process group(s)"
        if self.left:
            return f"{what}; still alive: pids {', '.join(map(str, self.left))}"
        return f"{what}; no process of the job is left"


def kill_job(job: Job, settle_s: float | None = None) -> KillResult:
    """SIGKILL every member of the job and every process group they lead (never this process's own group), reap the
    root, and poll until no member is alive (zombies of a killed torchrun's ranks, reaped by init, do not count).

    Returns:
        a :class:`KillResult` naming what was killed and what is left.
    """
    import psutil

    from core.stages.childproc import KILL_SETTLE_S

    settle_s = KILL_SETTLE_S if settle_s is None else settle_s
    own_group = os.getpgrp()
    in_cgroup: list[int] = []
    if job.cgroup is not None:  # all of it at once, whatever left the tree (the keeper is kept: it reports the end)
        from core.command.keeper import kill_cgroup

        in_cgroup = kill_cgroup(job.cgroup, job.proc.pid)
    first, first_groups = _kill_known(job, own_group)  # what is known, at once: the scan below reads every process
    procs = members(job, scan_env=True)
    groups = sorted({g for g in (_pgid(p.pid) for p in procs) if g and g != own_group and g == _leader(g, procs)})
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    try:
        job.proc.wait(timeout=settle_s)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be caught
        pass
    deadline = time.monotonic() + settle_s
    while True:
        left = alive(job)
        if not left or time.monotonic() >= deadline:
            break
        for pid in left:  # a process started between the scan and the kill
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)
    return KillResult(pids=sorted({*in_cgroup, *first, *(p.pid for p in procs)}),
                      groups=sorted({*first_groups, *groups}), left=left)


def _kill_known(job: Job, own_group: int) -> tuple[list[int], list[int]]:
    """SIGKILL the root's process group and every live member seen so far (by pid and start time), without a scan;
    (the pids, the groups) signalled."""
    import psutil

    pids, groups = [], []
    for pid, created in list(job.known.items()):
        try:
            p = psutil.Process(pid)
            if created and abs(float(p.create_time()) - created) > 0.01 or p.status() == psutil.STATUS_ZOMBIE:
                continue
            group = os.getpgid(pid)
            if group == pid and group != own_group:  # a group the job's process leads (the root's, each rank's)
                os.killpg(group, signal.SIGKILL)
                groups.append(group)
            p.send_signal(signal.SIGKILL)
            pids.append(pid)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return pids, groups


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def _leader(group: int, procs: list[Any]) -> int | None:
    """``group`` when one of the job's processes leads it (its pid is the group's id), else None: a group the job
    only joined (none does: it runs in a session of its own) is not killed as a whole."""
    return group if any(p.pid == group for p in procs) else None


def alive(job: Job) -> list[int]:
    """The pids of the job's processes still running (not zombies): every member seen, by pid and start time, and
    any process whose environment holds the job's token."""
    import psutil

    left = []
    for pid, created in list(job.known.items()):
        try:
            p = psutil.Process(pid)
            if created and abs(float(p.create_time()) - created) > 0.01:
                continue  # the pid was reused by another process
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.Error:
            continue
    left.extend(p.pid for p in members(job, scan_env=True))  # live, not zombies, found by tree or token
    return sorted(set(left))
