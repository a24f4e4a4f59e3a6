"""Stopping a computation of gpuaccept's own process at once when a signal comes.

The headless CLI turns SIGINT, SIGTERM and SIGHUP into a flag that the running stage polls while it waits on a child
(the child's process group is then killed, the stage marked cancelled and the record written). A computation of the
parent itself polls nothing: reading and splitting a data file (512 MiB take about 9 s on a 2-core CPU), making the
plan, the imports they start. Such a computation runs inside :func:`interruptible`, and the handler calls
:func:`interrupt`, which raises :class:`~core.errors.StageCancelled` there at once, in the main thread (where Python
runs signal handlers), naming the signal. Outside such a section :func:`interrupt` does nothing and the flag serves.

Nothing here installs a handler: the front end owns its signals (tui/cli.py).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from core.errors import StageCancelled

#: sections of the main thread a signal stops at once (nested sections count)
_depth = 0
#: what the innermost section is doing, for the message
_doing: list[str] = []


@contextmanager
def interruptible(doing: str) -> Iterator[None]:
    """A section of the main thread that :func:`interrupt` stops at once; ``doing`` says what it does, for the message
    (``"reading the data and making the plan, before any run folder"``). In another thread it marks nothing (a signal
    handler runs in the main thread only)."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _depth += 1
    _doing.append(doing)
    try:
        yield
    finally:
        _doing.pop()
        _depth -= 1


def interrupt(signum: int) -> None:
    """Called by a signal handler after it recorded the signal.

    Raises:
        StageCancelled: inside an :func:`interruptible` section, naming the signal and what was stopped.
    """
    if _depth:
        raise StageCancelled(f"stopped by {signal.Signals(signum).name} while {_doing[-1]}")
