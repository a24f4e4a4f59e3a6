"""The fork server: one process that imports torch, transformers and peft once, then forks each stage's child.

A stage's child spent most of its start in imports (about 5 s of CPU here, 11-14 s on the GPU box: torch with CUDA,
transformers' Trainer, peft); a LoRA acceptance starts six of them. Started once per gpuaccept process by
:mod:`core.forkserver` (``python -P -m core.child.zygote``, with the environment its children get), it preloads those
libraries and gpuaccept's child modules, says ``ready`` and then, per request, forks a child that:

- leads a new session (``setsid``: its own process group, as ``start_new_session`` gives a spawned child), so the
  resume check's SIGKILL of the group reaches it and nothing else;
- has stdin from /dev/null and stdout and stderr appended to its log (unbuffered), the environment it was asked for,
  its working directory, ``sys.argv``;
- runs ``<module>.main(argv)`` (or a script by path, as ``python PATH``) and leaves with its return value.

The server reaps its children and reports each one's exit status (negative: the signal that ended it, as ``Popen``'s).

**CUDA is never initialised here.** A CUDA context does not survive ``fork``: the children initialise CUDA themselves,
after the fork. ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` makes ``torch.cuda.is_available()`` ask NVML instead of creating a
driver context, and ``bitsandbytes`` (which reads the device's compute capability when imported, initialising CUDA; peft
0.21 imports it from ``peft.helpers``) is kept out of the preload: a child imports it itself when its spec needs it.
The ``ready`` line says whether CUDA stayed uninitialised; the parent forks nothing from a server where it did not.

Protocol (JSON lines): requests on stdin ``{"id", "module" | "path", "argv", "log", "env", "cwd"}``; on stdout
``{"ready": true, "seconds", "cuda_initialized", ...}``, then ``{"id", "pid"}`` (or ``{"id", "error"}``) per request
and ``{"exit": pid, "code"}`` per child. On end of input it stops taking requests and leaves once its children have;
when gpuaccept (``GPUACCEPT_PARENT_PID``) is gone it leaves at once (its children's own lifelines end them).
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from typing import Any

from core.protocol.lifeline import owner_alive

#: what the server imports before it is ready: what every stage child imports (the worker's roles, the traced plan,
#: command mode's evaluation), so that none of it is imported again after a fork
PRELOAD = (
    "torch", "transformers", "transformers.trainer", "transformers.models.llama.modeling_llama", "peft",
    "safetensors.torch", "accelerate", "core.child.worker", "core.child.recipe", "core.child.callbacks",
    "core.child.probe", "core.child.evaluate", "core.child.checkpoint_eval", "core.plan.tracer",
)
#: modules kept out of the preload because importing them initialises CUDA (see the module docstring)
CUDA_ON_IMPORT = ("bitsandbytes",)


class _Refuse:
    """A meta-path finder that makes ``import bitsandbytes`` fail while the server preloads (libraries that import it
    optionally, as peft.helpers does, then go on without it)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name.split(".")[0] in CUDA_ON_IMPORT:
            raise ImportError(f"{name} is imported after the fork, never by gpuaccept's fork server")
        return None


class _LazyModule:
    """Stands for a module a preloaded library bound to ``None`` (``peft.helpers.bnb``): imports it on first use."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        import importlib

        return getattr(importlib.import_module(self._name), attr)


def preload() -> dict[str, Any]:
    """Import :data:`PRELOAD` with :data:`CUDA_ON_IMPORT` refused; say what was imported and whether CUDA stayed
    uninitialised."""
    import importlib

    started = time.perf_counter()
    refuse = _Refuse()
    sys.meta_path.insert(0, refuse)
    failed: dict[str, str] = {}
    try:
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - a child imports what is missing itself (and fails there)
                failed[name] = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        sys.meta_path.remove(refuse)
    helpers = sys.modules.get("peft.helpers")
    if helpers is not None and getattr(helpers, "bnb", 0) is None:
        import importlib.util

        if importlib.util.find_spec("bitsandbytes") is not None:
            helpers.bnb = _LazyModule("bitsandbytes")  # type: ignore[attr-defined]
    torch = sys.modules.get("torch")
    cuda = bool(torch is not None and torch.cuda.is_initialized())
    return {"ready": True, "seconds": round(time.perf_counter() - started, 3), "cuda_initialized": cuda,
            "refused": [m for m in CUDA_ON_IMPORT if m in sys.modules], "failed": failed, "pid": os.getpid()}


#: the descriptor the server's replies go to (its stdout at start; fd 1 itself then points at stderr, so that nothing a
#: library prints while preloading can corrupt a reply)
_PROTOCOL = [1]


def _reply(message: dict[str, Any]) -> None:
    os.write(_PROTOCOL[0], (json.dumps(message) + "\n").encode("utf-8"))


def _child(request: dict[str, Any]) -> None:
    """In the forked child: become a session leader with the request's files, environment and directory, run its
    module's ``main`` (or its script), leave with its status. Never returns."""
    code = 1
    try:
        os.close(_PROTOCOL[0])
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(devnull)
        os.close(log)
        sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
        retitle(request.get("title") or [sys.executable, "-P", "-m", str(request.get("module")),
                                         *map(str, request.get("argv", []))])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ["GPUACCEPT_FORKED"] = "1"  # core.protocol.lifeline: it answers to gpuaccept, not to this server
        _verbosity(os.environ.get("TRANSFORMERS_VERBOSITY"))
        os.chdir(request.get("cwd") or "/")
        argv = [str(a) for a in request.get("argv", [])]
        sys.argv = [request.get("path") or request["module"], *argv]
        try:
            if request.get("path"):
                import runpy

                runpy.run_path(request["path"], run_name="__main__")
                code = 0
            else:
                import importlib

                code = int(importlib.import_module(request["module"]).main(argv) or 0)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the traceback goes to the child's log; the status says it failed
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def retitle(argv: list[str]) -> None:
    """Show ``argv`` as this process's command line (``/proc/<pid>/cmdline``, what ``ps``, ``top`` and psutil read).
    The kernel shows the memory of the original arguments; it is rewritten here through ``/proc/self/mem``, the way
    setproctitle does it on Linux: the words joined by spaces, then NULs, the area's last byte not a NUL (the kernel
    then reads the line up to its first NUL), cut to the room the server was started with (``--title-room``).
    Without ``/proc`` (or its permission) the command line stays the server's."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48 and 49 of proc(5))
        room = end - start
        if room <= 2:
            return
        line = " ".join(argv).encode("utf-8", "replace")[: room - 2]
        data = line + b"\0" * (room - 1 - len(line)) + b" "
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            mem.write(data)
    except (OSError, ValueError, IndexError):
        pass


def _verbosity(level: str | None) -> None:
    """transformers' logging level as ``TRANSFORMERS_VERBOSITY`` asks (transformers reads it once, when imported: here
    that was before the fork, with the server's environment)."""
    logs = sys.modules.get("transformers.utils.logging")
    if logs is not None:
        logs.set_verbosity(logs.log_levels.get(level or "", logs._default_log_level))


def serve(owner: int) -> int:
    """Answer requests until the input ends (then wait for the children) or ``owner`` is gone."""
    children: set[int] = set()
    buffer = b""
    reading = True
    while True:
        while children:  # reap whatever ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            _reply({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if not owner_alive(owner):
            return 0
        if not reading:
            if not children:
                return 0
            time.sleep(0.05)
            continue
        ready, _, _ = select.select([0], [], [], 0.05)
        if not ready:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            reading = False
            continue
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if not line.strip():
                continue
            request = json.loads(line)
            try:
                pid = os.fork()
            except OSError as exc:
                _reply({"id": request.get("id"), "error": f"fork failed: {exc}"})
                continue
            if pid == 0:
                _child(request)
            children.add(pid)
            _reply({"id": request.get("id"), "pid": pid})


def main(argv: list[str]) -> int:
    owner = int(os.environ.get("GPUACCEPT_PARENT_PID", "0") or 0)
    _PROTOCOL[0] = os.dup(1)
    os.dup2(2, 1)
    retitle([sys.executable, "-P", "-m", "core.child.zygote"])  # the room stays for the children
    try:
        info = preload()
    except BaseException as exc:  # noqa: BLE001 - said to the parent, which then spawns its children itself
        _reply({"ready": False, "error": f"{type(exc).__name__}: {exc}"[:300]})
        return 1
    _reply(info)
    return serve(owner)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
