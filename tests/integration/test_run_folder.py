"""The run folder under a full disk, a read-only or mistaken runs folder, and runs started in the same second
(issue 16).

A full disk is injected (``OSError(ENOSPC)`` from the write that would hit it): a real one needs a mount these machines
do not let a test make. What is checked is what the user sees: a named error or status, and the run folder kept.
"""

from __future__ import annotations

import datetime as dt
import errno
import threading
from pathlib import Path

import pytest

from core.errors import GpuAcceptError, StageError
from core.events import Message, RunFinished, StageFinished
from core.pipeline import AcceptanceRun, new_run_dir, run_pipeline
from core.spec import RunSpec

NOW = dt.datetime(2026, 12, 1, 5, 0, 0, tzinfo=dt.UTC)
ENOSPC = OSError(errno.ENOSPC, "No space left on device")


def spec(tiny_model_dir: Path) -> RunSpec:
    return RunSpec.build(model=str(tiny_model_dir), mode="full", steps=4, seq_len=32, probe_steps=2,
                         resume_checkpoint_every=2, resume_kill_after_checkpoint=1)


def test_a_runs_folder_that_is_a_file_is_named(tmp_path, tiny_model_dir):
    (tmp_path / "runs").write_text("not a folder")
    with pytest.raises(GpuAcceptError, match=r"runs is a file, not a folder; give a folder with --runs-dir"):
        new_run_dir(spec(tiny_model_dir), tmp_path / "runs", NOW)
    with pytest.raises(GpuAcceptError, match=r"a folder above it is a file"):
        new_run_dir(spec(tiny_model_dir), tmp_path / "runs" / "deeper", NOW)


def test_a_runs_folder_that_cannot_be_written_is_named(tmp_path, tiny_model_dir, monkeypatch):
    """A read-only runs folder (injected: these tests run as root, which chmod does not stop)."""
    runs = tmp_path / "runs"
    runs.mkdir()
    real_mkdir = Path.mkdir

    def mkdir(self: Path, *args, **kwargs):
        if self.parent == runs:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(GpuAcceptError, match=r"cannot make a run folder in .*runs \(Permission denied\); give a "
                                             r"writable folder with --runs-dir"):
        new_run_dir(spec(tiny_model_dir), runs, NOW)


def test_runs_started_in_the_same_second_each_get_their_own_folder(tmp_path, tiny_model_dir):
    """The folder name has the second; sixteen runs starting together (threads released at once) must not share one."""
    s, runs, n = spec(tiny_model_dir), tmp_path / "runs", 16
    barrier, made, errors = threading.Barrier(n), [], []

    def start() -> None:
        barrier.wait()
        try:
            made.append(new_run_dir(s, runs, NOW))
        except Exception as exc:  # noqa: BLE001 - collected, asserted below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(set(made)) == n
    assert sorted(p.name for p in runs.iterdir()) == sorted(p.name for p in made)
    assert {p.name for p in made} >= {"20261201T050000Z-full-tiny-llama0", "20261201T050000Z-full-tiny-llama0-16"}


def test_a_stage_that_hits_a_full_disk_fails_naming_the_file(tmp_path, tiny_model_dir):
    run = AcceptanceRun(spec(tiny_model_dir), tmp_path / "runs")

    def stage():
        yield Message("probe", text="stepping")
        raise OSError(errno.ENOSPC, "No space left on device", str(run.run_dir / "probe" / "checkpoint-2"))

    events = []
    with pytest.raises(StageError, match=r"probe: No space left on device \(.*checkpoint-2\); the run folder"):
        for event in run._stage("probe", stage()):
            events.append(event)
    assert [e.text for e in events] == ["stepping"]
    assert "checkpoint-2" in run.stopped["probe"].why and run.stopped["probe"].status == "error"
    run.close()


def test_an_event_log_that_cannot_be_written_does_not_stop_the_events(tmp_path, tiny_model_dir, monkeypatch):
    run = AcceptanceRun(spec(tiny_model_dir), tmp_path / "runs")
    monkeypatch.setattr(run._log, "emit", lambda *a, **k: (_ for _ in ()).throw(ENOSPC))
    event = Message("plan", text="hello")
    assert run.emit(event) is event
    assert run.log_error.endswith("events.jsonl: No space left on device")
    run.close()


def test_a_record_that_cannot_be_written_is_said_and_the_run_folder_kept(tmp_path, tiny_model_dir, monkeypatch):
    """No room for record.toml: the last stage says ``not_written``, the run finishes ``fail`` with no record path (the
    CLI prints "(not written: see above)" and exits 1), and the run folder keeps what was written before."""
    import core.record.written

    def full(record, path):
        raise ENOSPC

    monkeypatch.setattr(core.record.written, "write_record", full)
    events = list(run_pipeline(spec(tiny_model_dir), runs_root=tmp_path / "runs", cancelled=lambda: True))
    record_done = [e for e in events if isinstance(e, StageFinished) and e.stage == "record"]
    assert [e.status for e in record_done] == ["not_written"]
    assert "No space left on device" in record_done[0].summary
    final = events[-1]
    assert isinstance(final, RunFinished) and final.status == "fail" and final.record_path == ""
    run_dir = Path(final.run_dir)
    assert (run_dir / "events.jsonl").stat().st_size > 0
    assert not list(run_dir.glob("record.toml")) and not list(run_dir.glob(".record-*"))


def test_no_room_for_the_spec_in_a_new_run_folder_is_named(tmp_path, tiny_model_dir, monkeypatch):
    real_write = Path.write_text

    def write_text(self: Path, *args, **kwargs):
        if self.name == "spec.toml":
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    with pytest.raises(GpuAcceptError, match=r"spec.toml could not be written \(No space left on device\); free "
                                             r"space or give another --runs-dir"):
        AcceptanceRun(spec(tiny_model_dir), tmp_path / "runs")


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 400 KiB tmpfs (the tiny LoRA run below writes ~600 KiB): a real full disk. Needs mount rights (root, or a
    container allowed to mount); elsewhere the injected ENOSPC tests above stand for it."""
    import shutil
    import subprocess

    where = tmp_path / "small"
    where.mkdir()
    mount = shutil.which("mount")
    if mount is None or subprocess.run([mount, "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(where)],
                                       capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root, or the container forbids mounts)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_lora_run_that_fills_the_disk_keeps_its_record(small_tmpfs, tiny_model_dir):
    """Issue 16: a full disk during a LoRA resume check ended in ``internal error: OSError: [Errno 28]`` and no record.
    Now the stage that hit it is an error naming the disk, and the record is written in the room kept for it."""
    import tomllib

    s = RunSpec.build(model=str(tiny_model_dir), mode="lora", steps=6, seq_len=32, probe_steps=2,
                      resume_checkpoint_every=2, resume_kill_after_checkpoint=1)
    events = list(run_pipeline(s, runs_root=small_tmpfs / "runs"))
    final = events[-1]
    assert isinstance(final, RunFinished) and final.status == "fail"
    assert final.record_path, [getattr(e, "summary", getattr(e, "text", "")) for e in events[-4:]]
    record = tomllib.loads(Path(final.record_path).read_text())
    stages = record["verdict"]["stages"]
    assert stages["probe"]["status"] == "pass"
    failed = [name for name, stage in stages.items() if stage["status"] == "error"]
    assert failed == ["resume"] and "bytes free (No space left on device?)" in stages["resume"]["evidence"], stages
    assert not (Path(final.run_dir) / ".record-reserve").exists()
