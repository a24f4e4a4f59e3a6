"""The reaper of command mode: when gpuaccept is gone, every process of the user's job goes too, Python or not.

Each run's keeper (core/command/keeper.py) ends the processes of its run when gpuaccept is gone; the ``sitecustomize``
lifeline (core/child/inject) ends the job's Python processes; a process of
another program (a shell wrapper's ``sleep``, ``nvidia-smi`` in a loop, a logger a launcher started with ``setsid``)
has no such thread. :func:`start_reaper` starts ``python -m core.command.reaper OWNER RUN_DIR`` in a session of its
own, with none of the job's variables (so no kill of the job reaches it): five times a second it checks that gpuaccept
(``OWNER``) runs; when it does not, it kills the processes each keeper last listed in its ``job-pids.json`` and what
they started (:func:`kill_listed`), reads every ``job.json`` under ``RUN_DIR`` (each run of the command's token:
:func:`core.command.process.start_job`), SIGKILLs every process whose environment holds one of those tokens, and
exits. :func:`stop_reaper` ends it when the run is closed normally (every job already ended). Standard library and
psutil only: it starts in a tenth of a second.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from core.command.keeper import REAPER_INTERVAL_S as INTERVAL_S  # seconds between two checks of gpuaccept's pid


def start_reaper(run_dir: Path) -> subprocess.Popen[bytes]:
    """Start the reaper of ``run_dir``'s jobs for this process (see the module docstring)."""
    from core.interpreter import python_argv, python_env

    # gpuaccept importable from where this process imported it (a tree that is not installed: the GPU box's case)
    env = python_env({k: v for k, v in os.environ.items() if not k.startswith("GPUACCEPT_")})
    with open(os.devnull, "rb") as devnull, open(run_dir / "reaper.log", "ab") as log:
        return subprocess.Popen(python_argv("core.command.reaper", str(os.getpid()), str(run_dir)),
                                stdin=devnull, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                                cwd=str(Path(__file__).resolve().parents[2]))


def stop_reaper(proc: subprocess.Popen[bytes] | None) -> None:
    """End the reaper (the run was closed: nothing of it runs any more)."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()


def tokens(run_dir: Path) -> set[str]:
    """The token of every run of the command under ``run_dir`` (their ``job.json``)."""
    out = set()
    for path in run_dir.rglob("job.json"):
        try:
            token = json.loads(path.read_text(encoding="utf-8")).get("env_added", {}).get("GPUACCEPT_JOB")
        except (OSError, ValueError):
            continue
        if token:
            out.add(str(token))
    return out


def cgroups(run_dir: Path) -> list[Path]:
    """The cgroup of every run of the command under ``run_dir`` that had one (their ``job.json``) and still exists."""
    out = []
    for path in run_dir.rglob("job.json"):
        try:
            folder = json.loads(path.read_text(encoding="utf-8")).get("cgroup")
        except (OSError, ValueError):
            continue
        if folder and Path(folder).is_dir():
            out.append(Path(folder))
    return out


def listed(run_dir: Path) -> dict[int, int]:
    """The processes every keeper under ``run_dir`` last saw in its command (their ``job-pids.json``: pid -> start
    time in clock ticks after boot, core/command/keeper.py ``write_pids``)."""
    from core.command.keeper import PIDS_NAME

    out: dict[int, int] = {}
    for path in run_dir.rglob(PIDS_NAME):
        try:
            rows = json.loads(path.read_text(encoding="utf-8")).get("pids", [])
            out.update((int(pid), int(ticks)) for pid, ticks in rows)
        except (OSError, ValueError, TypeError, AttributeError):
            continue
    return out


def kill_listed(run_dir: Path) -> list[int]:
    """SIGKILL the processes the keepers listed that still run (the same pid and start time: never a process that
    took a reused pid) and every descendant of theirs; each is stopped (SIGSTOP) first and the tree walked again until
    no new process shows, so a process that forks while it is being killed leaves no child behind. The pids
    killed."""
    from core.command.keeper import start_ticks, tree

    todo = [pid for pid, ticks in listed(run_dir).items() if pid != os.getpid() and start_ticks(pid) == ticks]
    frozen: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid in frozen or pid == os.getpid():
            continue
        try:
            os.kill(pid, signal.SIGSTOP)
        except OSError:
            continue
        frozen.add(pid)
        todo.extend(tree(pid))
    for pid in frozen:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return sorted(frozen)


def reap(run_dir: Path) -> list[int]:
    """SIGKILL every process of ``run_dir``'s jobs: the members of their cgroups (removed after), and every process
    holding a token of theirs (and the groups they lead); the pids killed. Each job's keeper does the same when
    gpuaccept is gone (core/command/keeper.py): this is for a keeper that was itself killed."""
    import psutil

    from core.command.keeper import kill_cgroup, remove_cgroup

    killed: list[int] = []
    for folder in cgroups(run_dir):
        killed += kill_cgroup(folder)
        remove_cgroup(folder)
    killed += kill_listed(run_dir)
    wanted = tokens(run_dir)
    if not wanted:
        return killed
    for p in psutil.process_iter():
        try:
            if p.pid == os.getpid() or p.environ().get("GPUACCEPT_JOB") not in wanted:
                continue
            if os.getpgid(p.pid) == p.pid:
                os.killpg(p.pid, signal.SIGKILL)
            p.send_signal(signal.SIGKILL)
            killed.append(p.pid)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return killed


def main(argv: list[str]) -> int:
    owner, run_dir = int(argv[0]), Path(argv[1])
    stopping: dict[str, Any] = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stopping.update(now=True))
    while not stopping["now"]:
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            killed = reap(run_dir)
            print(f"gpuaccept ({owner}) is gone: killed {len(killed)} process(es) of its jobs {killed}", flush=True)
            return 0
        except PermissionError:
            pass
        time.sleep(INTERVAL_S)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
