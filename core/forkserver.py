"""The parent's side of the fork server (:mod:`core.child.zygote`): stage children forked from a process that has
already imported torch, transformers and peft, instead of each importing them again.

:func:`start` forks a child (``<module>.main(argv)``, or a script by path) with its log, environment and working
directory, and returns a :class:`Forked` that answers like ``subprocess.Popen`` (``pid``, ``poll``, ``wait``,
``returncode``); it returns None where the caller must spawn the child itself: the fork server is switched off
(``GPUACCEPT_FORKSERVER=0``), could not start, initialised CUDA while preloading, or was started with an environment
the child's differs from (a variable read at import time could differ; only :data:`AFTER_FORK` may). The first call
starts the server and waits for its preload; :func:`warm` starts it early, so the imports overlap the plan.

A forked child is a session leader like a spawned one (its process group is what the resume check kills), its parent is
the server, and it ends itself when gpuaccept is gone (``GPUACCEPT_PARENT_PID``, :mod:`core.protocol.lifeline`), as the
server does. Torchrun's ranks are spawned by torchrun, never forked from here.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from core.interpreter import python_argv

#: ``GPUACCEPT_FORKSERVER=0`` spawns every child as a fresh interpreter (the behaviour before the fork server)
SWITCH_ENV = "GPUACCEPT_FORKSERVER"
#: variables a forked child may have other than the server's: read after the fork (CUDA reads its visible devices when
#: a child first uses CUDA; the child sets transformers' verbosity itself), or by pytest and gpuaccept at run time only
AFTER_FORK = ("CUDA_VISIBLE_DEVICES", "PYTEST_CURRENT_TEST", "TRANSFORMERS_VERBOSITY")
AFTER_FORK_PREFIXES = ("GPUACCEPT_",)
#: the server's own: torch.cuda.is_available() asks NVML, never the driver (no CUDA context before a fork)
SERVER_ONLY = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
#: how long a start waits for the server's preload before spawning the child itself
READY_TIMEOUT_S = 180.0
#: bytes of the server's command line a forked child rewrites with its own (``ps`` shows ``python -P -m
#: core.child.worker <job.json>``, not the server's): room for the longest run-folder path
TITLE_ROOM = 4096


class Process(Protocol):
    """What the stages use of a child process: ``subprocess.Popen``'s or a :class:`Forked`'s."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class Forked:
    """A child forked by the server: its exit status arrives from the server (negative: the signal that ended it)."""

    def __init__(self, server: ForkServer, pid: int, argv: list[str]) -> None:
        self._server = server
        self.pid = pid
        self.args = argv
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        if self.returncode is None and self._server.gone():
            self.returncode = _reap(self.pid)  # the server died first: the child is this process's now (subreaper)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status, waiting up to ``timeout`` seconds (None: for ever).

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._server.wait_for_exit(0.05)
        assert self.returncode is not None
        return self.returncode


def _reap(pid: int) -> int | None:
    """The exit status of a forked child whose server is gone: this process, a subreaper (:func:`_subreaper`), is its
    parent now and waits for it (negative: the signal that ended it); None while it runs; 1 when it cannot be waited
    for (not a child of this process: no subreaper here) and no longer runs."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return 1
        except PermissionError:
            return None
        return None
    return None if done == 0 else os.waitstatus_to_exitcode(status)


def _subreaper() -> None:
    """Make this process the child subreaper of its descendants (Linux ``PR_SET_CHILD_SUBREAPER``): a forked stage
    child whose server ends (the OOM killer may choose the server) becomes this process's child, so its exit status is
    still known. Nothing happens elsewhere (one home for the call: command mode's keeper, core/command/keeper.py)."""
    from core.command.keeper import become_subreaper

    become_subreaper()


def _comparable(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in AFTER_FORK and k not in SERVER_ONLY
            and not k.startswith(AFTER_FORK_PREFIXES)}


class ForkServer:
    """One ``python -P -m core.child.zygote`` and the thread reading its replies."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self.executable = sys.executable  # a server serves children of this interpreter only
        self.info: dict[str, Any] | None = None
        self._exits: dict[int, int] = {}
        self._replies: dict[int, dict[str, Any]] = {}
        self._next = 0
        self._cond = threading.Condition()
        self._write = threading.Lock()
        self._closed = False
        self.started = time.monotonic()
        # the room a forked child's command line is written into (core.child.zygote.retitle)
        room = ["--title-room", "-" * TITLE_ROOM]
        self.proc = subprocess.Popen(python_argv("core.child.zygote", *room), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, start_new_session=True,
                                     env={**self.env, **SERVER_ONLY})
        self._reader = threading.Thread(target=self._read, name="gpuaccept-forkserver", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                message = json.loads(raw)
            except ValueError:
                continue
            with self._cond:
                if "ready" in message:
                    self.info = message
                elif "exit" in message:
                    self._exits[int(message["exit"])] = int(message["code"])
                elif "id" in message:
                    self._replies[int(message["id"])] = message
                self._cond.notify_all()
        with self._cond:
            self._closed = True
            if self.info is None:
                self.info = {"ready": False, "error": f"the fork server exited ({self.proc.wait()})"}
            self._cond.notify_all()

    def ready(self, timeout_s: float = READY_TIMEOUT_S) -> bool:
        """True once the server preloaded without initialising CUDA (waits up to ``timeout_s``)."""
        with self._cond:
            self._cond.wait_for(lambda: self.info is not None, timeout=timeout_s)
            info = self.info
        return bool(info and info.get("ready") and not info.get("cuda_initialized") and not self._closed)

    def spawn(self, argv: list[str], log: Path, env: Mapping[str, str], cwd: str | None = None,
              module: str | None = None, path: str | None = None) -> Forked | None:
        """Fork one child (``module``'s ``main(argv)``, or the script ``path``); None when the server cannot."""
        shown = python_argv(module, *argv) if module else [sys.executable, str(path), *argv]
        with self._write:
            self._next += 1
            ident = self._next
            request = {"id": ident, "module": module, "path": path, "argv": argv, "log": str(log), "env": dict(env),
                       "cwd": cwd or os.getcwd(), "title": shown}
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write((json.dumps(request) + "\n").encode("utf-8"))
                self.proc.stdin.flush()
            except (OSError, ValueError):
                return None
        with self._cond:
            self._cond.wait_for(lambda: ident in self._replies or self._closed, timeout=30.0)
            reply = self._replies.pop(ident, None)
        if reply is None or "pid" not in reply:
            return None
        return Forked(self, int(reply["pid"]), shown)

    def gone(self) -> bool:
        """The server has exited (no more exit statuses will come)."""
        with self._cond:
            return self._closed

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            return self._exits.get(pid)

    def wait_for_exit(self, timeout_s: float) -> None:
        with self._cond:
            self._cond.wait(timeout=timeout_s)

    def close(self) -> None:
        """No more requests: the server leaves once its children have."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass


_servers: list[ForkServer] = []
_lock = threading.Lock()


def enabled() -> bool:
    """Forking is possible here and not switched off (``GPUACCEPT_FORKSERVER=0``)."""
    return hasattr(os, "fork") and os.environ.get(SWITCH_ENV, "1") != "0"


def _server_for(env: Mapping[str, str]) -> ForkServer:
    """The running server started with ``env`` (but :data:`AFTER_FORK`), or a new one; an older server with another
    environment is closed (it leaves once its children have)."""
    key = _comparable(env)
    with _lock:
        for server in _servers:
            if _comparable(server.env) == key and server.executable == sys.executable and server.proc.poll() is None:
                return server
        for server in _servers:
            server.close()
        _servers.clear()
        _subreaper()
        server = ForkServer(env)
        _servers.append(server)
        return server


def warm(env: Mapping[str, str]) -> None:
    """Start the server for children of ``env`` now (its preload runs while the caller goes on)."""
    if enabled():
        _server_for(env)


def start(module: str | None, argv: list[str], log: Path, env: Mapping[str, str], cwd: str | None = None,
          path: str | None = None) -> Forked | None:
    """Fork a child of ``module`` (its ``main(argv)``) or of the script ``path``, appending its output to ``log``;
    None when the caller must spawn it itself (see the module docstring)."""
    if not enabled():
        return None
    server = _server_for(env)
    if not server.ready():
        return None
    return server.spawn(argv, log, env, cwd=cwd, module=module, path=path)


def server_info() -> dict[str, Any] | None:
    """The running server's ``ready`` line (preload seconds, CUDA untouched), or None."""
    with _lock:
        return dict(_servers[-1].info) if _servers and _servers[-1].info else None


@atexit.register
def _close_all() -> None:
    for server in _servers:
        server.close()
