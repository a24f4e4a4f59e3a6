"""Ending a process group a child leads (``start_new_session=True``): the one way gpuaccept makes sure a helper it
started (a trace, a conversion, ssh-keygen) never outlives the call that started it, on a timeout, a cancel or a
signal turned into ``SystemExit``."""

from __future__ import annotations

import os
import signal
from typing import Any


def end_group(proc: Any) -> None:
    """SIGKILL the process group ``proc`` leads and reap ``proc``, if it is still running (a ``subprocess.Popen``;
    ``start_new_session=True``: its pid is its group's). A group already gone is not an error."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
