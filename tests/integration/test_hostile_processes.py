"""Hostile inputs met as a process (issue 52): a signal to `verify` while its ssh-keygen runs."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from tests.records import path_of
from tests.unit.test_bounded_input import _slow_ssh_keygen


def test_sigterm_to_verify_stops_the_ssh_keygen_it_runs(tmp_path):
    """Issue 52: SIGTERM to `verify` left ssh-keygen running."""
    import signal
    import subprocess
    import time

    _slow_ssh_keygen(tmp_path / "bin")
    record = tmp_path / "record.toml"
    shutil.copyfile(path_of("lora"), record)
    (tmp_path / "record.toml.sig").write_text("-----BEGIN SSH SIGNATURE-----\n")
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "gpuaccept"), "verify", str(record)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not (tmp_path / "bin" / "pid").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    pid = int((tmp_path / "bin" / "pid").read_text())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 143
    time.sleep(0.2)
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
