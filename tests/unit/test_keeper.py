"""The keeper of a command's run (core/command/keeper.py): its log is capped with the tail kept, a program that cannot
start is named, and the command's exit status comes back as the command's (issue 35)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from core.command import process
from core.command.keeper import CappedLog
from core.errors import StageError


def test_a_capped_log_keeps_the_tail_and_says_how_much_was_cut(tmp_path):
    log = CappedLog(tmp_path / "command.log", 8192)
    lines = [f"line {i:05d} ".ljust(199, "x") + "\n" for i in range(100)]  # 200 bytes each, 20,000 in all
    for line in lines:
        log.write(line.encode())
    text = (tmp_path / "command.log").read_text()
    assert len(text.encode()) <= 8192
    kept = text.splitlines(keepends=True)
    assert kept[-1] == lines[-1] and kept[1:] == lines[-(len(kept) - 1):]  # whole lines, the last ones, in order
    assert log.cut_bytes == 20_000 - sum(len(x) for x in kept[1:])
    assert kept[0].startswith(f"[gpuaccept: the command's output passed the log's cap of 8192 bytes; the first "
                              f"{log.cut_bytes} bytes were cut")


def test_a_flooding_command_is_capped_and_its_status_comes_back(tmp_path, monkeypatch):
    """A command's stdout was kept whole (100 MB in one test): now capped, the tail kept, the cut reported."""
    monkeypatch.setattr(process, "LOG_CAP_BYTES", 64 * 1024)
    flood = "import sys\nfor i in range(20000): print(f'{i:08d}', 'y' * 90)\nsys.exit(3)\n"
    job = process.start_job("probe", [sys.executable, "-c", flood], tmp_path, tmp_path / "job", {})
    assert job.proc.wait(timeout=60) == 3  # the keeper exits with the command's status
    log = (tmp_path / "job" / "command.log").read_bytes()
    assert len(log) <= 64 * 1024 and log.endswith(b"00019999 " + b"y" * 90 + b"\n")
    report = job.report()
    assert report["exit_status"] == 3 and report["log_cut_bytes"] == 20000 * 100 - (len(log) - len(log.split(b"\n")[0]) - 1)


def test_a_program_that_cannot_start_is_named(tmp_path):
    with pytest.raises(StageError, match=r"probe: cannot start no-such-program-here \(No such file or directory\)"):
        process.start_job("probe", ["no-such-program-here", "--flag"], tmp_path, tmp_path / "job", {})
    assert not list(Path(tmp_path / "job").glob("keeper.json"))


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_a_full_disk_never_hangs_the_command_its_output_is_drained_and_the_loss_reported(tmp_path):
    """Issue 52: on a full disk the log pump's write raised ENOSPC in its thread, the thread died, nothing drained the
    pipe, the command blocked writing and the keeper waited on it for ever. The command's log is /dev/full here: the
    command runs to its end, its output is dropped and counted, and the report names the error."""
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "command.log").symlink_to("/dev/full")
    flood = "import sys\nfor i in range(20000): print(f'{i:08d}', 'y' * 90)\nsys.exit(0)\n"
    job = process.start_job("probe", [sys.executable, "-c", flood], tmp_path, tmp_path / "job", {})
    assert job.proc.wait(timeout=60) == 0  # 2 MB through a 64 KiB pipe: it would block without the pump
    report = job.report()
    assert report["exit_status"] == 0 and report["log_dropped_bytes"] == 20000 * 100
    assert "No space left on device" in report["log_write_error"]


def test_a_log_the_disk_refuses_drops_and_counts_and_keeps_the_first_error():
    log = CappedLog(Path("/dev/full"), 8192)
    log.write(b"x" * 100)
    log.write(b"y" * 50)
    assert log.dropped_bytes == 150 and log.write_error is not None and "No space left" in log.write_error
