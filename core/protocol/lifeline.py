"""A child process ends when gpuaccept does: no probe or trace is left holding memory on a shared box.

Every child gets ``GPUACCEPT_PARENT_PID`` (:func:`core.interpreter.child_env`). :func:`exit_with_parent` starts a
daemon thread that checks once a second whether that process (and the child's own parent, which under torchrun is
torchrun) still runs, and ends the child with exit status 3 when either is gone, after removing the folder it was
given (a trace's temporary folder), so a ``kill -9`` of gpuaccept leaves neither a process nor a folder behind.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

#: the environment variable naming gpuaccept's own process id
PARENT_PID_ENV = "GPUACCEPT_PARENT_PID"
#: the exit status of a child that ended because gpuaccept was gone
ORPHANED_EXIT = 3
#: set in a child forked by the fork server (core/child/zygote.py)
FORKED_ENV = "GPUACCEPT_FORKED"


def owner_alive(owner: int) -> bool:
    """True while process ``owner`` exists (0: no owner named, taken as alive)."""
    if not owner:
        return True
    try:
        os.kill(owner, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exit_with_parent(cleanup: Path | None = None, interval_s: float = 1.0) -> None:
    """Start the watchdog thread (see the module docstring); ``cleanup`` is removed before the child exits."""
    parent = os.getppid()
    owner = int(os.environ.get(PARENT_PID_ENV, "0") or 0)  # gpuaccept itself (under torchrun: not the parent)
    # a child forked by the fork server (core/child/zygote.py) answers to gpuaccept alone: the server ending (it is
    # gpuaccept's helper; gpuaccept, a subreaper, then waits for the child itself) must not end a stage mid-run
    forked = os.environ.get(FORKED_ENV) == "1"

    def watchdog() -> None:
        while True:
            if (os.getppid() != parent and not forked) or not owner_alive(owner):
                if cleanup is not None:
                    shutil.rmtree(cleanup, ignore_errors=True)
                os._exit(ORPHANED_EXIT)
            time.sleep(interval_s)

    threading.Thread(target=watchdog, name="parent-watchdog", daemon=True).start()
