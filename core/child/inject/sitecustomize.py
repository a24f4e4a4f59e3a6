"""Run by Python at the start of every process whose ``PYTHONPATH`` holds this folder (the ``site`` module imports
``sitecustomize``): with ``GPUACCEPT_EVENTS`` set, installs gpuaccept's Trainer hook (core/child/inject/trainer_hook.py),
then runs the ``sitecustomize`` this one shadows, if the environment has one. Without the variable it does nothing.
A failure is one line on stderr, never the user's job's failure."""

import os
import sys


def _install() -> None:
    path = os.environ.get("GPUACCEPT_EVENTS")
    if not path:
        return
    try:
        from core.child.inject.trainer_hook import install

        install(path)
    except Exception as exc:  # noqa: BLE001 - the user's job runs whatever happens here
        print(f"gpuaccept: the Trainer hook was not installed ({type(exc).__name__}: {exc})", file=sys.stderr)


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


_install()
_chain()
