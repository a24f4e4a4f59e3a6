"""core.monitor.sampler: host readings of a real process tree, replay, the sampling thread, peaks, recording."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from core.monitor.sampler import (
    DeviceSample,
    HostBackend,
    Reading,
    ReplayBackend,
    Sampler,
    constructed_frames,
    others_reading,
)

MB = 2**20
GiB = 2**30
# Touches every byte (bytearray(n) alone could be backed by untouched zero pages), then waits to be killed.
ALLOCATE = "import time; b = bytearray(b'\\x01') * (200 * 2**20); print('ready', flush=True); time.sleep(120)"


def _start(argv: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"  # the allocating python has touched its 200 MB
    return proc


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group: killing only a shell orphans its python (docs/architecture.md §6)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)
    proc.stdout.close()


def _host(pids: set[int]) -> DeviceSample:
    (sample,) = HostBackend().sample(pids)
    return sample


def test_reading_ok_only_for_a_plain_value():
    assert Reading(5).ok
    assert not Reading(None, "GPU is lost").ok
    assert not Reading(5, "estimated from the device's change since baseline").ok
    assert not Reading(None).ok


def test_others_is_used_minus_ours_when_both_known():
    assert others_reading(Reading(10 * GiB), Reading(3 * GiB)) == Reading(7 * GiB)
    # no probe running: every used byte is another process's (a finished probe revisited showed "others N/A")
    assert others_reading(Reading(10 * GiB), Reading(None, "no probe process running")) == Reading(10 * GiB)
    assert others_reading(Reading(10 * GiB), Reading(None, "followed processes have exited")) == Reading(10 * GiB)
    # ours unreadable (NVML's per-process list refused): others is unknown too, with that reason
    assert others_reading(Reading(10 * GiB), Reading(None, "per-process memory: no permission")) == Reading(
        None, "per-process memory: no permission")
    assert others_reading(Reading(None, "Unknown Error"), Reading(3 * GiB)) == Reading(None, "Unknown Error")


def test_host_without_pids_reports_the_machine_and_no_ours():
    s = _host(set())
    assert (s.device, s.name, s.backend) == ("cpu", "host memory", "host")
    assert s.total_bytes.value == psutil.virtual_memory().total
    assert s.used_bytes.value + s.free_bytes.value == s.total_bytes.value  # used is total - available
    assert s.ours_bytes == Reading(None, "no probe process running")
    assert s.others_bytes == s.used_bytes  # nothing of ours: all of it is others'


def test_host_counts_a_child_process_and_drops_it_when_it_exits():
    proc = _start([sys.executable, "-c", ALLOCATE])
    try:
        s = _host({proc.pid})
        assert s.ours_bytes.ok
        assert 200 * MB <= s.ours_bytes.value < 400 * MB  # the bytearray plus the interpreter, not the whole machine
        assert s.ours_bytes.value < s.total_bytes.value
        # others: "used" minus the child's anonymous pages (its file pages are page cache, outside "used")
        info = psutil.Process(proc.pid).memory_info()
        anon = info.rss - info.shared
        assert 200 * MB <= anon <= s.ours_bytes.value
        assert abs(s.others_bytes.value - max(s.used_bytes.value - anon, 0)) < 64 * MB  # read a moment apart
        assert s.others_bytes.value >= max(s.used_bytes.value - s.ours_bytes.value, 0)
    finally:
        _kill_group(proc)
    gone = _host({proc.pid})
    assert gone.ours_bytes == Reading(None, "followed processes have exited")


def test_host_counts_a_grandchild_through_the_shell():
    # `& wait` keeps the shell alive as the parent, so the python is really a grandchild of this test.
    proc = _start(["sh", "-c", '"$0" -c "$1" & wait', sys.executable, ALLOCATE])
    try:
        shell = psutil.Process(proc.pid)
        assert [c.pid for c in shell.children()]  # really a separate grandchild, not an exec'd shell
        assert shell.memory_info().rss < 50 * MB
        s = _host({proc.pid})
        assert 200 * MB <= s.ours_bytes.value < 400 * MB
    finally:
        _kill_group(proc)


def test_host_skips_a_vanished_pid_next_to_a_live_one():
    proc = _start([sys.executable, "-c", ALLOCATE])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        assert _host({proc.pid, dead.pid}).ours_bytes.value >= 200 * MB
    finally:
        _kill_group(proc)


def test_replay_plays_frames_in_order_and_stays_on_the_last():
    backend = ReplayBackend(constructed_frames(ours=[1 * GiB, 5 * GiB, 3 * GiB]))
    seen = [backend.sample(set())[0].ours_bytes.value for _ in range(5)]
    assert seen == [1 * GiB, 5 * GiB, 3 * GiB, 3 * GiB, 3 * GiB]


def test_constructed_frames_are_consistent():
    (s,), (none,) = constructed_frames(total=80 * GiB, ours=[3 * GiB, None], others=GiB)
    assert (s.device, s.name, s.backend) == ("cuda:0", "Test GPU", "replay")
    assert s.used_bytes.value == 4 * GiB and s.free_bytes.value == 76 * GiB and s.others_bytes.value == GiB
    assert none.ours_bytes.reason == "no probe process running" and none.used_bytes.value == GiB
    with pytest.raises(ValueError):
        constructed_frames(ours=[1, 2], others=[1])


def test_sampler_tracks_peaks_since_follow_and_bounds_history():
    sampler = Sampler(ReplayBackend(constructed_frames(ours=[1 * GiB, 5 * GiB, 3 * GiB, 2 * GiB], others=GiB)),
                      history=3)
    assert sampler.peak_ours("cuda:0") is None and sampler.latest() == []
    for _ in range(4):
        sampler.sample_once()
    assert sampler.peak_ours("cuda:0") == 5 * GiB
    assert sampler.peak_used("cuda:0") == 6 * GiB
    assert [s.ours_bytes.value for s in sampler.history("cuda:0")] == [5 * GiB, 3 * GiB, 2 * GiB]
    assert sampler.latest()[0].ours_bytes.value == 2 * GiB
    assert sampler.history("cuda:1") == []

    sampler.follow({12345})  # a new probe: the old peak must not carry over
    assert sampler.peak_ours("cuda:0") is None
    sampler.sample_once()  # replay stays on the last frame (2 GiB)
    assert sampler.peak_ours("cuda:0") == 2 * GiB


def test_sampler_thread_samples_at_about_the_interval_and_stops():
    sampler = Sampler(ReplayBackend(constructed_frames()), interval_s=0.05, history=1000)
    sampler.start()
    sampler.start()  # idempotent: still one thread
    time.sleep(1.0)
    sampler.stop()
    sampler.stop()
    n = len(sampler.history("cuda:0"))
    assert 3 <= n <= 40  # ~20 expected; far more would mean the interval is ignored
    assert not sampler.running
    time.sleep(0.15)
    assert len(sampler.history("cuda:0")) == n  # really stopped


class _FailsEveryOtherCall:
    name = "flaky"

    def __init__(self) -> None:
        self.calls = 0
        self._replay = ReplayBackend(constructed_frames())

    def sample(self, pids: set[int]) -> list[DeviceSample]:
        self.calls += 1
        if self.calls % 2:
            raise RuntimeError("GPU is lost")
        return self._replay.sample(pids)


def test_a_backend_exception_is_recorded_and_sampling_goes_on():
    backend = _FailsEveryOtherCall()
    sampler = Sampler(backend, interval_s=0.01)
    sampler.start()
    try:
        deadline = time.monotonic() + 5
        while len(sampler.history("cuda:0")) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sampler.running
    finally:
        sampler.stop()
    assert len(sampler.history("cuda:0")) >= 3  # samples kept coming after the first failure (call 1 failed)
    assert isinstance(sampler.last_error, RuntimeError) and str(sampler.last_error) == "GPU is lost"
    assert sampler.error_count >= 2


def test_sample_once_propagates_a_backend_error():
    with pytest.raises(RuntimeError):
        Sampler(_FailsEveryOtherCall()).sample_once()


@pytest.mark.parametrize("make_backend", [
    lambda: HostBackend(),
    # two devices per frame, and a repeated last frame (same t) that must stay a separate frame
    lambda: ReplayBackend([a + b for a, b in zip(constructed_frames(ours=[GiB, 2 * GiB]),
                                                  constructed_frames(device="cuda:1", ours=[None, 3 * GiB]))]),
], ids=["host", "replay-two-devices"])
def test_record_then_replay_round_trips_exactly(tmp_path, make_backend):
    path = tmp_path / "monitor.jsonl"
    sampler = Sampler(make_backend())
    sampler.follow({os.getpid()})
    sampler.sample_once()  # before record(): not written
    sampler.record(path)
    frames = [sampler.sample_once() for _ in range(3)]
    sampler.stop()  # closes the recording
    sampler.sample_once()
    lines = path.read_text().splitlines()
    assert len(lines) == sum(len(f) for f in frames)  # one JSON object per DeviceSample
    replay = ReplayBackend.from_jsonl(path)
    assert replay.frames == frames
    assert [replay.sample(set()) for _ in range(3)] == frames


def test_importing_monitor_loads_neither_torch_nor_textual():
    code = "import sys, core.monitor.sampler; print('torch' in sys.modules, 'textual' in sys.modules, 'pynvml' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False False"
