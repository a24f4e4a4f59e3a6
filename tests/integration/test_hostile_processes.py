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


def test_sigterm_while_the_data_is_read_stops_the_run_at_once(tmp_path, tiny_model_dir):
    """Issue 52: the headless run's signal handler only set a flag, which a stage polls while it waits on a child; the
    parent's own computation (here: reading and splitting a 150 MB data file, about 2.7 s) ran on, made its run
    folder and only then stopped. Now the signal stops it at once (core/interrupt.py): exit 143, no run folder."""
    import signal
    import subprocess
    import time

    data = tmp_path / "big.txt"
    with open(data, "w", encoding="utf-8") as f:
        for start in range(0, 300_000, 10_000):
            f.write("".join(f"document {i} " + "lorem ipsum dolor sit amet " * 18 + "\n\n"
                            for i in range(start, start + 10_000)))
    runs = tmp_path / "runs"
    proc = subprocess.Popen([str(Path(sys.executable).parent / "gpuaccept"), "run", "--headless", "--model",
                             str(tiny_model_dir), "--devices", "cpu", "--data", str(data), "--runs-dir", str(runs)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed just before the handler is installed and the run starts
        assert line.startswith("gpuaccept: lora on"), line
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert "gpuaccept: stopped by SIGTERM while the plan was made and the data read, before any run folder; nothing " \
           "was written" in err, err
    assert took < 1.0, f"{took:.1f} s after the signal"
    assert not runs.exists() or not any(runs.iterdir())


def test_a_signal_to_the_gpu_check_ends_the_run_it_started_and_that_runs_fork_server(tmp_path, tiny_model_dir):
    """Issue 52: `gpu_check.sh --dry-run` ended by `timeout` left its `gpuaccept run` and that run's fork server running
    for 20 minutes (on a GPU box they would hold the GPU). The check's own code (benchmarks/gpu_check.py:
    ``end_on_signals`` and ``Check.child``) runs a real headless run here; SIGTERM to the check ends it with 143, and
    within seconds no process of the run is left (each marked by a variable in its environment)."""
    import signal
    import subprocess
    import time
    import uuid

    import psutil

    mark = uuid.uuid4().hex
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[2] / 'benchmarks')!r})\n"
        "from pathlib import Path\n"
        "import gpu_check\n"
        "gpu_check.end_on_signals()\n"
        f"check = gpu_check.Check(Path({str(tmp_path / 'out')!r}), Path({str(tmp_path / 'work')!r}), 300, True)\n"
        f"check.child('run', [{str(Path(sys.executable).parent / 'gpuaccept')!r}, 'run', '--headless', '--model', "
        f"{str(tiny_model_dir)!r}, '--devices', 'cpu', '--seq-len', '32', '--probe-steps', '100000', '--runs-dir', "
        f"{str(tmp_path / 'runs')!r}], 300, {{'GPUACCEPT_TEST_MARK': {mark!r}}})\n")

    def ours() -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.environ().get("GPUACCEPT_TEST_MARK") == mark and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
            except psutil.Error:
                pass
        return found

    check = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any("core.child.zygote" in " ".join(p.cmdline()) for p in ours()):
            time.sleep(0.2)  # the run started and its fork server with it
        assert any("core.child.zygote" in " ".join(p.cmdline()) for p in ours()), [p.cmdline() for p in ours()]
        check.send_signal(signal.SIGTERM)
        assert check.wait(timeout=30) == 143
        deadline = time.monotonic() + 15
        while ours() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not ours(), [p.cmdline() for p in ours()]
    finally:
        check.kill()
        for proc in ours():
            proc.kill()


def test_a_yaml_bomb_in_your_own_commands_config_is_named_at_once(tmp_path, capsys):
    """Issue 52: an 858-byte YAML of nested aliases named on the training command's line grew command mode to 15.4 GB
    in 10 minutes. The config is read (bounded) to plan what ran: the plan says why there is none, by name, and the
    run ends in seconds."""
    import time

    from tests.unit.test_bounded_input import YAML_BOMB
    from tui.cli import main

    (tmp_path / "bomb.yaml").write_text(YAML_BOMB)
    (tmp_path / "train.py").write_text("print('trained')\n")
    started = time.monotonic()
    code = main(["run", "--headless", "--runs-dir", str(tmp_path / "runs"), "--workdir", str(tmp_path), "--eval",
                 "none", "--command", f"{sys.executable} train.py --config=bomb.yaml --output_dir {{out}}"])
    out = capsys.readouterr().out
    assert code == 1 and time.monotonic() - started < 30
    assert f"[plan] not_applicable: no plan: your config {tmp_path / 'bomb.yaml'}" in out and "expands to more than 100,000 values" \
        in out, out
