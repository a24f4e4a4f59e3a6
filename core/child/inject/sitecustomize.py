"""Run by Python at the start of every process whose ``PYTHONPATH`` holds this folder (the ``site`` module imports
``sitecustomize``), in the user's own Python: gpuaccept's command mode (core/command/) puts it there.

- With ``GPUACCEPT_EVENTS`` set, it installs the Trainer hook (``trainer_hook.py`` beside it, loaded by file path
  under a private name: nothing of gpuaccept needs to be importable in the user's environment).
- With ``GPUACCEPT_PARENT_PID`` set, a daemon thread ends this process (exit status 3) once that process, gpuaccept,
  is gone: a ``kill -9`` of gpuaccept leaves no rank of the user's job holding a device.
- With ``GPUACCEPT_NUDGE_ULP=1`` (the resume check's nudged twin) it moves every trainable parameter by one ulp before
  the first optimizer step; with ``GPUACCEPT_TEST_JITTER`` set (tests only), it perturbs every optimizer step's
  gradients (both: ``jitter.py`` beside it; the latter a stand-in for a GPU's run-to-run noise).
- Then it runs the ``sitecustomize`` this one shadows, if the environment has one.

Without the variables it does nothing. A failure is one line on stderr, never the user's job's failure. Standard
library only, and no syntax newer than the Pythons a user's job may run on.
"""

import os
import sys
import types


def _install() -> None:
    path = os.environ.get("GPUACCEPT_EVENTS")
    if not path:
        return
    try:
        _load("_gpuaccept_trainer_hook", "trainer_hook.py").install(path)
    except Exception as exc:  # noqa: BLE001 - the user's job runs whatever happens here
        print(f"gpuaccept: the Trainer hook was not installed ({type(exc).__name__}: {exc})", file=sys.stderr)


def _lifeline() -> None:
    """End this process when gpuaccept (``GPUACCEPT_PARENT_PID``) is gone, checked once a second."""
    owner = os.environ.get("GPUACCEPT_PARENT_PID", "")
    if not owner.isdigit():
        return
    import threading
    import time

    pid = int(owner)

    def watch() -> None:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(3)
            except PermissionError:
                pass
            time.sleep(1.0)

    threading.Thread(target=watch, name="gpuaccept-lifeline", daemon=True).start()


def _jitter() -> None:
    """The twin's one-ulp nudge and the test-only gradient jitter (``jitter.py``), when ``GPUACCEPT_NUDGE_ULP`` or
    ``GPUACCEPT_TEST_JITTER`` asks for them."""
    nudge = os.environ.get("GPUACCEPT_NUDGE_ULP", "").strip() == "1"
    if not os.environ.get("GPUACCEPT_TEST_JITTER") and not nudge:
        return
    try:
        module = _load("_gpuaccept_jitter", "jitter.py")
        module.install_when_imported(module.amplitude(), nudge)
    except Exception as exc:  # noqa: BLE001 - the user's job runs whatever happens here
        print(f"gpuaccept: the twin's nudge or the test jitter was not installed ({type(exc).__name__}: {exc})",
              file=sys.stderr)


def _load(name: str, filename: str) -> types.ModuleType:
    """A module beside this file, loaded by path under a private ``name``."""
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(name, os.path.join(here, filename))
    if spec is None or spec.loader is None:
        raise ImportError(f"{here}/{filename} cannot be loaded")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _chain() -> None:
    """Run the next ``sitecustomize`` on ``sys.path`` (this one shadows it)."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None and spec.origin != os.path.abspath(__file__):
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_lifeline()
_install()
_jitter()
_chain()
