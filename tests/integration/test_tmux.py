"""gpuaccept as a real process in a real terminal (tmux, 80x24): keys in, screen text out."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

TMUX = shutil.which("tmux")
pytestmark = pytest.mark.skipif(TMUX is None, reason="tmux is not installed (.ci/run installs it in CI)")


class Tmux:
    def __init__(self, tmp_path: Path) -> None:
        self.socket = f"gpuaccept-test-{tmp_path.name}"
        self.session = "t"

    def tmux(self, *args: str) -> str:
        return subprocess.run([TMUX, "-L", self.socket, *args], capture_output=True, text=True, check=True).stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", self.session)

    def wait_for(self, *texts: str, timeout_s: float = 90.0) -> str:
        """The screen once every one of ``texts`` is on it (a slow machine may show a screen half drawn)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            shown = self.screen()
            if all(t in shown for t in texts):
                return shown
            time.sleep(0.2)
        raise AssertionError(f"{texts!r} not all on screen after {timeout_s} s; screen:\n{self.screen()}")


def test_walk_to_the_plan_screen_with_keys(tmp_path, tiny_model_dir):
    exe = Path(sys.executable).parent / "gpuaccept"
    term = Tmux(tmp_path)
    command = f"cd {tmp_path} && {exe} run --model {tiny_model_dir} --devices cpu --seq-len 64; sleep 5"
    term.tmux("new-session", "-d", "-s", term.session, "-x", "80", "-y", "24", command)
    try:
        term.wait_for("Step 1 · Mode", "Inference", "Full fine-tuning", "LoRA", "Your own command")  # fails after 90 s if one is missing
        term.tmux("send-keys", "-t", term.session, "Enter")
        term.wait_for("Step 2/7 · Setup (lora)", "Micro-batch / device", "Precision")
        term.tmux("send-keys", "-t", term.session, "C-n")
        plan = term.wait_for("Step 3/7 · Plan (estimates)", "→ fits", "ACT activations")
        assert "micro-batch 4 × 64 tokens" in " ".join(plan.split())  # the line may wrap at 80 columns
        assert "W weights" in plan and "ACT activations" in plan
        term.tmux("send-keys", "-t", term.session, "q")
        time.sleep(1.0)
        assert "Step 3/7" not in term.screen()  # the app has quit; no stage was running
        assert not (tmp_path / "runs").exists()  # nothing ran: no run directory
    finally:
        subprocess.run([TMUX, "-L", term.socket, "kill-server"], capture_output=True)


def test_a_dropped_terminal_during_the_probe_ends_the_wizard_and_its_child_and_keeps_the_record(tmp_path, tiny_model_dir):
    """An SSH connection that drops closes the terminal: the wizard must not linger (it used to spin on the dead
    terminal), its probe child's process group must be gone, and what was measured is written, unsigned."""
    import psutil

    def ours() -> list:
        found = []
        for proc in psutil.process_iter(["cmdline", "cwd"]):
            try:
                cmd = " ".join(proc.info["cmdline"] or [])
                if ("core.child.worker" in cmd or cmd.endswith("gpuaccept run --model " + str(tiny_model_dir) + " --devices cpu "
                                                           "--seq-len 64 --probe-steps 400")) and \
                        str(proc.info.get("cwd") or "").startswith(str(tmp_path)):
                    found.append(proc)
            except psutil.Error:
                pass
        return found

    exe = Path(sys.executable).parent / "gpuaccept"
    term = Tmux(tmp_path)
    command = (f"cd {tmp_path} && {exe} run --model {tiny_model_dir} --devices cpu --seq-len 64 --probe-steps 400; "
               "sleep 30")
    term.tmux("new-session", "-d", "-s", term.session, "-x", "80", "-y", "24", command)
    try:
        term.wait_for("Step 1 · Mode")
        term.tmux("send-keys", "-t", term.session, "Enter")
        term.wait_for("Step 2/7")
        term.tmux("send-keys", "-t", term.session, "C-n")
        term.wait_for("Step 3/7", "→ fits")
        term.tmux("send-keys", "-t", term.session, "C-n")
        term.wait_for("Step 4/7", "probe: child process")
        assert len(ours()) >= 2  # the wizard and its probe child are running
    finally:
        subprocess.run([TMUX, "-L", term.socket, "kill-server"], capture_output=True)

    deadline = time.monotonic() + 20
    while ours() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ours() == []
    (record,) = (tmp_path / "runs").glob("*/record.toml")
    text = record.read_text()
    assert 'status = "unsigned"' in text and "cancelled" in text
