"""The wizard on a GPU box: Pilot drives Mode -> Setup -> Plan -> Probe headless and saves the probe screen.

Two pictures of the probe screen, each as SVG (as the snapshots are) and as plain text: ``probe-live`` while the probe
child holds memory (the live per-device bars with the backend's real readings: NVML on a GPU box, the host backend on a
CPU) and ``probe-done`` once the probe has finished (the plan-vs-measured table). Written to ``--out``; prints one JSON
line: what was captured, the backend, the screen's verdict line, seconds.

Usage (from benchmarks/gpu_check.py): ``python benchmarks/gpu_wizard.py --model DIR --devices 0 --out DIR``.
Needs textual (carried to the GPU box as a wheel). Exits 1, with the reason in the JSON line, if a screen did not come.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SIZE = (100, 32)


def screen_text(app) -> str:
    """The current screen as plain text lines, rendered the way ``App.export_screenshot`` renders it for its SVG."""
    from rich.console import Console

    console = Console(width=app.size.width, height=app.size.height, file=io.StringIO(), record=True,
                      force_terminal=True, color_system="truecolor", legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text(styles=False)


def save(app, out: Path, name: str) -> list[str]:
    (out / f"{name}.svg").write_text(app.export_screenshot(title=f"gpuaccept {name}"))
    (out / f"{name}.txt").write_text(screen_text(app))
    return [f"{name}.svg", f"{name}.txt"]


async def wait(pilot, condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s")
        await pilot.pause(0.2)


async def drive(args) -> dict:
    from textual.content import Content
    from textual.widgets import Button, Static

    from tui.app import GpuAcceptApp
    from tui.screens.plan import PlanScreen
    from tui.screens.setup import SetupScreen
    from tui.screens.stages import ProbeScreen

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fields = {"model": args.model, "devices": args.devices, "batch_size": args.batch_size, "seq_len": args.seq_len,
              "dtype": args.dtype, "probe_steps": args.probe_steps}
    app = GpuAcceptApp(runs_root=out / "runs", fields=fields, mode="lora")
    result: dict = {"fields": fields, "saved": []}

    def next_enabled() -> bool:
        return not app.screen.query_one("#next", Button).disabled

    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("enter")  # the Mode screen opens on LoRA, selected and under the cursor
        await wait(pilot, lambda: isinstance(app.screen, SetupScreen), 10, "the Setup screen")
        await wait(pilot, next_enabled, 60, "Setup accepting the model")
        await pilot.press("ctrl+n")
        await wait(pilot, lambda: isinstance(app.screen, PlanScreen) and next_enabled(), 120, "the plan")
        await pilot.press("ctrl+n")
        await wait(pilot, lambda: isinstance(app.screen, ProbeScreen), 10, "the Probe screen")
        result["backend"] = app.backend_note
        sampler = app.start_sampler()
        device = "cpu" if args.devices == "cpu" else f"cuda:{args.devices.split(',')[0]}"
        # while the probe runs, keep the latest picture until one shows the child's memory in the bar mid-step (the
        # probe's steps can take well under a second on a GPU, after seconds of start-up)
        status = app.screen.query_one("#status", Static)
        await wait(pilot, lambda: app.state.running or next_enabled(), 30, "the probe's start")
        deadline, result["live"] = time.monotonic() + args.timeout_s, "none"
        while app.state.running and time.monotonic() < deadline and result["live"] != "holding memory, mid-step":
            ours = next((s.ours_bytes.value for s in sampler.latest() if s.device == device), None)
            holding = bool(ours) and "step" in str(status.content)
            saved = save(app, out, "probe-live")
            result["live"] = "holding memory, mid-step" if holding else "the last picture while it ran (the bar had " \
                "not shown the child's memory mid-step)"
            await pilot.pause(0.3)
        if result["live"] != "none":
            result["saved"] += saved
        await wait(pilot, lambda: app.state.running is None and next_enabled(), args.timeout_s, "the probe's end")
        await pilot.pause(0.5)
        result["saved"] += save(app, out, "probe-done")
        title = app.screen.query_one("#measured-title", Static).content
        result["verdict"] = " ".join(Content.from_markup(str(title)).plain.split())
        result["peak_ours_bytes"] = sampler.peak_ours(device)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--devices", default="0")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--out", required=True)
    parser.add_argument("--probe-steps", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=240)
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        result = asyncio.run(drive(args))
        rc = 0
    except Exception as exc:  # noqa: BLE001 - reported in the JSON line, the check goes on
        result, rc = {"error": f"{type(exc).__name__}: {exc}"}, 1
    result["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(result))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
