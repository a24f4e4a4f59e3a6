"""The user's command as a process tree: started in a session of its own, every process of it found, measured from
outside, and killed, every rank.

- **Start** (:func:`start_job`): ``subprocess.Popen`` of the command's words (no shell) in its ``workdir``, stdin from
  /dev/null, stdout and stderr appended to ``command.log`` (nothing reaches the terminal), ``start_new_session``.
  Its environment is the user's, plus ``PYTHONPATH`` led by ``core/child/inject`` (the Trainer hook, installed only in
  a Python that imports transformers' Trainer), ``GPUACCEPT_EVENTS`` (the hook's events file), ``GPUACCEPT_JOB`` (a
  token naming this run), ``GPUACCEPT_PARENT_PID`` (every Python process of the job ends itself when gpuaccept is
  gone) and ``PYTHONUNBUFFERED=1``.
- **Members** (:func:`members`): the root's descendants, and every process whose environment holds the job's token:
  torchrun starts each rank in a session of its own, and a process that daemonised left the tree, but both inherited
  the token.
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
    proc: subprocess.Popen[bytes]
    token: str
    started: float
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
    added = {k: env[k] for k in (*extra_env, "PYTHONPATH", EVENTS_ENV, JOB_ENV, OWNER_ENV, HOLD_ENV) if k in env}
    (job_dir / "job.json").write_text(json.dumps({"argv": argv, "cwd": str(cwd), "env_added": added}, indent=2),
                                      encoding="utf-8")
    with open(job_dir / "command.log", "ab") as log, open(os.devnull, "rb") as devnull:
        try:
            proc = subprocess.Popen(argv, cwd=cwd, stdin=devnull, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=env)
        except OSError as exc:
            raise StageError(f"{name}: cannot start {argv[0]} ({exc.strerror or exc}); check the command's "
                             "program") from None
    job = Job(name=name, argv=list(argv), job_dir=job_dir, proc=proc, token=token, started=time.monotonic())
    job.known[proc.pid] = _create_time(proc.pid) or 0.0
    return job


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
    try:
        root = psutil.Process(job.proc.pid)
        for p in [root, *root.children(recursive=True)]:
            found[p.pid] = p
    except psutil.Error:
        pass
    now = time.monotonic()
    if scan_env or now - job._scanned >= ENV_SCAN_S:
        job._scanned = now
        for p in psutil.process_iter():
            if p.pid in found or p.pid == os.getpid():
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
    return KillResult(pids=sorted({*first, *(p.pid for p in procs)}), groups=sorted({*first_groups, *groups}),
                      left=left)


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
