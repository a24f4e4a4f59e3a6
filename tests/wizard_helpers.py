"""Building the wizard for tests: a tiny model, a constructed device backend and a fixed device list."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.monitor.sampler import ReplayBackend, constructed_frames
from core.plan.devices import DeviceInfo
from tui.app import GpuAcceptApp

GiB = 2**30
TEST_HOST = DeviceInfo("cpu", "cpu", "test host", 64 * GiB, "constructed for tests")


def make_app(model_dir: Path, runs_root: Path, mode: str = "lora", **fields: Any) -> GpuAcceptApp:
    """The wizard on the tiny model: short runs, a replayed device backend, one 64 GiB test host."""
    base = {"model": str(model_dir), "seq_len": 64, "steps": 6, "eval_max_blocks": 4,
            "resume_checkpoint_every": 2, "resume_kill_after_checkpoint": 1}
    frames = constructed_frames(device="cpu", name="test host", total=64 * GiB,
                                ours=[None, 1 * GiB, 2 * GiB, 3 * GiB, 2 * GiB], others=4 * GiB)
    return GpuAcceptApp(runs_root=runs_root, backend=ReplayBackend(frames), devices_override=[TEST_HOST],
                        fields={**base, **fields}, mode=mode)


def worker_processes(root: Path) -> list:
    """Live gpuaccept child processes (``core.child.worker``) whose job lies under ``root``."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "core.child.worker" in cmd and str(root) in cmd:
            found.append(proc)
    return found


def text_of(widget: Any) -> str:
    """What a Static shows, as plain text."""
    return str(widget.content)


async def wait_for(pilot: Any, condition: Callable[[], bool], timeout_s: float = 240.0) -> None:
    """Let the app run until ``condition()`` holds (stages run real child processes). On a timeout the message holds
    the screen's text, so a stage that refused or failed says why."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            screen = pilot.app.screen
            shown = " | ".join(text_of(w) for w in screen.query("Static") if w.display and text_of(w).strip())
            raise AssertionError(f"timed out after {timeout_s} s waiting for {condition} on {type(screen).__name__}: "
                                 f"{shown[-3000:]}")
        await pilot.pause(0.1)


def wizard_opened_with(monkeypatch: Any, argv: list[str]) -> dict[str, Any]:
    """The keywords ``gpuaccept <argv>`` opens the wizard with (``cmd_wizard``; the app replaced by one that records
    them and runs nothing)."""
    from types import SimpleNamespace

    from tui.cli import cmd_wizard
    from tui.flags import build_parser

    seen: dict[str, Any] = {}

    class App:
        def __init__(self, **kwargs: Any) -> None:
            seen.update(kwargs)
            self.state = SimpleNamespace(record_path=None)

        def run(self) -> int:
            return 0

    monkeypatch.setattr("tui.app.GpuAcceptApp", App)
    assert cmd_wizard(build_parser().parse_args(argv)) == 0
    return seen
