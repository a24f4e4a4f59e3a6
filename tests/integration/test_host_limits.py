"""Issue 16, item 6: children end with gpuaccept and leave no temp folder; the host's capacity honours cgroup memory
limits (v1 and v2, saying which applied); a child the kernel's OOM killer ends is reported as out of memory.

The cgroup trees below are folders laid out as the kernel lays them out (its documented files); where this machine
lets a test make a real memory cgroup (root, a writable v1 ``memory`` controller or v2 with it enabled), the same is
checked against the kernel itself: a real limit, and a real OOM kill.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.monitor.hostmem import UNLIMITED, cgroup_limit, host_memory
from core.stages.childproc import killed_note, oom_kill_count
from tests.paths import REPO

GiB = 2**30


def _write(folder: Path, **files: str | int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (folder / name.replace("__", ".")).write_text(f"{value}\n")


def _proc(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cgroup"
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------------------------ cgroup v2
def test_v2_a_parents_limit_holds_and_inactive_file_pages_are_not_counted_as_used(tmp_path):
    root = tmp_path / "fs"
    _write(root, cgroup__controllers="cpu memory")
    _write(root / "slurm", memory__max=8 * GiB, memory__current=3 * GiB,
           memory__stat="anon 1\ninactive_file 1073741824")
    _write(root / "slurm" / "job1", memory__max="max", memory__current=1 * GiB, memory__stat="inactive_file 0")
    limit = cgroup_limit(root, _proc(tmp_path, "0::/slurm/job1\n"))
    assert limit is not None and limit.version == 2 and limit.path == root / "slurm"
    assert limit.limit_bytes == 8 * GiB and limit.headroom_bytes == 8 * GiB - (3 * GiB - 1 * GiB)


def test_v2_the_tightest_of_the_chain_wins(tmp_path):
    root = tmp_path / "fs"
    _write(root, cgroup__controllers="memory")
    _write(root / "a", memory__max=8 * GiB, memory__current=1 * GiB)
    _write(root / "a" / "b", memory__max=2 * GiB, memory__current=GiB // 2)
    limit = cgroup_limit(root, _proc(tmp_path, "0::/a/b\n"))
    assert (limit.path, limit.limit_bytes, limit.headroom_bytes) == (root / "a" / "b", 2 * GiB, 2 * GiB - GiB // 2)


def test_v2_inside_a_cgroup_namespace_the_mount_is_our_own_cgroup(tmp_path):
    """In a container /proc/self/cgroup says ``0::/`` (or a path the container cannot see); the mount point's own
    files are the limit."""
    root = tmp_path / "fs"
    _write(root, cgroup__controllers="memory", memory__max=4 * GiB, memory__current=GiB)
    for text in ("0::/\n", "0::/kubepods/pod1/abc\n"):
        limit = cgroup_limit(root, _proc(tmp_path, text))
        assert limit is not None and (limit.limit_bytes, limit.headroom_bytes) == (4 * GiB, 3 * GiB), text


def test_no_limit_anywhere_is_none(tmp_path):
    root = tmp_path / "fs"
    _write(root, cgroup__controllers="memory")
    _write(root / "user", memory__max="max", memory__current=GiB)
    assert cgroup_limit(root, _proc(tmp_path, "0::/user\n")) is None
    assert cgroup_limit(tmp_path / "nothing", _proc(tmp_path, "0::/user\n")) is None
    assert cgroup_limit(root, tmp_path / "no-proc-file") is None


# ------------------------------------------------------------------------------------------------------ cgroup v1
def test_v1_memory_controller_on_a_hybrid_host(tmp_path):
    """This machine's layout: v1 controllers, v2 mounted at ``unified`` without the memory controller."""
    root = tmp_path / "fs"
    _write(root / "unified", cgroup__controllers="")
    _write(root / "memory", memory__limit_in_bytes=UNLIMITED * 2 - 4096, memory__usage_in_bytes=5 * GiB)
    _write(root / "memory" / "job", memory__limit_in_bytes=3 * GiB, memory__usage_in_bytes=2 * GiB,
           memory__stat="cache 5\ntotal_inactive_file 536870912\n")
    text = "12:cpu,cpuacct:/\n4:memory:/job\n0::/\n"
    limit = cgroup_limit(root, _proc(tmp_path, text))
    assert limit is not None and limit.version == 1 and limit.path == root / "memory" / "job"
    assert limit.headroom_bytes == 3 * GiB - (2 * GiB - GiB // 2)
    assert "cgroup v1 memory limit 3.00 GiB" in limit.describe()


def test_the_capacity_is_the_cgroups_when_smaller_and_says_so(tmp_path, monkeypatch):
    import psutil

    from core.plan import devices as plan

    root = tmp_path / "fs"
    _write(root, cgroup__controllers="memory", memory__max=2 * GiB, memory__current=GiB // 2)
    proc = _proc(tmp_path, "0::/\n")
    host = host_memory(root, proc)
    if psutil.virtual_memory().available <= host.cgroup.headroom_bytes:
        pytest.skip("this machine has less than 1.5 GiB available: the cgroup would not be the smaller")
    assert (host.total_bytes, host.available_bytes) == (2 * GiB, 2 * GiB - GiB // 2)
    assert host.source.startswith("cgroup v2 memory limit 2.00 GiB")
    monkeypatch.setattr("core.monitor.hostmem.host_memory", lambda *a, **k: host)
    device = plan.detect_devices("cpu")[0]
    assert device.capacity_bytes == host.available_bytes and device.capacity_source == host.source
    shares = plan.detect_devices("cpu", cpu_ranks=2)
    assert [d.capacity_bytes for d in shares] == [host.available_bytes // 2] * 2
    assert shares[0].capacity_source.endswith("/ 2 ranks sharing it") and "cgroup v2" in shares[0].capacity_source


def test_without_a_limit_the_capacity_is_psutils(tmp_path):
    host = host_memory(tmp_path / "none", _proc(tmp_path, "0::/\n"))
    assert host.cgroup is None and host.source == "available host memory (psutil)"


# ----------------------------------------------------------------------------------------------- OOM kill, words
def test_a_sigkill_while_the_oom_count_rose_is_out_of_memory():
    note = killed_note(-signal.SIGKILL, 4, 3 * GiB, oom_kills_now=5)
    assert note.startswith(" (SIGKILL): out of memory: the kernel's OOM killer ended a process")
    assert "oom_kill 4 -> 5" in note and "peak RSS of its processes seen 3.00 GiB" in note


def test_a_rank_killed_under_torchrun_is_out_of_memory_too():
    """torchrun exits 1 when a rank is killed; the count says what happened."""
    assert killed_note(1, 0, GiB, oom_kills_now=1).startswith(": out of memory")


def test_other_exits_are_not_called_out_of_memory():
    assert killed_note(1, 3, GiB, oom_kills_now=3) == ""
    assert killed_note(0, 3, GiB, oom_kills_now=9) == ""
    other = killed_note(-signal.SIGKILL, 3, 0, oom_kills_now=3)
    assert "not sent by gpuaccept" in other and "out of memory" not in other and "not sampled" in other
    assert "not sent by gpuaccept" in killed_note(-signal.SIGKILL, None, GiB, oom_kills_now=None)


def test_the_oom_count_is_read_from_vmstat(tmp_path):
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 1\noom_kill 7\npgfault 3\n")
    assert oom_kill_count(vmstat) == 7
    vmstat.write_text("nr_free_pages 1\n")
    assert oom_kill_count(vmstat) is None


# ------------------------------------------------------------------------------------- a real cgroup, if we may
@pytest.fixture
def memory_cgroup(tmp_path):
    """A fresh memory cgroup below this process's own, and a way to set its limit; skips where none can be made."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    v1 = next((line.split(":", 2)[2] for line in lines if "memory" in line.split(":", 2)[1].split(",")), None)
    root = Path("/sys/fs/cgroup")
    if v1 is not None and (root / "memory").is_dir():
        base, limit_file = root / "memory" / v1.lstrip("/"), "memory.limit_in_bytes"
    else:
        v2 = next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), None)
        base, limit_file = (root / v2.lstrip("/")) if v2 else root, "memory.max"
    folder = base / f"gpuaccept-test-{os.getpid()}-{tmp_path.name}"
    try:
        folder.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup here ({exc})")
    if not (folder / limit_file).exists():
        folder.rmdir()
        pytest.skip("the memory controller is not enabled for a new cgroup here")

    def limit(nbytes: int) -> Path:
        (folder / limit_file).write_text(str(nbytes))
        return folder

    yield limit
    for _ in range(50):  # its processes are gone; the kernel may take a moment to let the folder go
        try:
            folder.rmdir()
            break
        except OSError:
            time.sleep(0.1)


def _wrapper(tmp_path: Path, cgroup: Path) -> Path:
    """A python that moves itself into ``cgroup`` first: only the child runs under the limit, not the test."""
    path = tmp_path / "python-in-cgroup"
    path.write_text(f"#!/bin/sh\necho $$ > {cgroup}/cgroup.procs\nexec {sys.executable} \"$@\"\n")
    path.chmod(0o755)
    return path


def test_a_real_cgroup_limit_is_the_capacity_a_process_in_it_sees(memory_cgroup, tmp_path):
    cgroup = memory_cgroup(1 * GiB)
    code = ("import json; from core.monitor.hostmem import host_memory; h = host_memory(); "
            "print(json.dumps([h.total_bytes, h.available_bytes, h.source]))")
    out = subprocess.run([str(_wrapper(tmp_path, cgroup)), "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO)
    total, available, source = json.loads(out.stdout)
    assert total == 1 * GiB and 0 < available <= 1 * GiB
    assert source.startswith("cgroup v") and "memory limit 1.00 GiB" in source and str(cgroup) in source


def test_a_probe_the_oom_killer_ends_is_reported_out_of_memory_and_the_record_kept(memory_cgroup, tmp_path,
                                                                                   tiny_model_dir, monkeypatch):
    """The probe child of the tiny LoRA run needs ~0.35 GiB of RSS (measured here); under a 300 MiB cgroup limit
    the kernel kills it. Before issue 16 the stage said "exit status -9"."""
    import tomllib

    from core.events import RunFinished
    from core.pipeline import run_pipeline
    from core.spec import RunSpec

    before = oom_kill_count()
    if before is None:
        pytest.skip("/proc/vmstat has no oom_kill count (Linux before 4.13)")
    cgroup = memory_cgroup(300 * 2**20)
    monkeypatch.setattr(sys, "executable", str(_wrapper(tmp_path, cgroup)))
    spec = RunSpec.build(model=str(tiny_model_dir), mode="lora", steps=4, seq_len=32, probe_steps=2, resume_check=False)
    events = list(run_pipeline(spec, runs_root=tmp_path / "runs"))
    final = events[-1]
    assert isinstance(final, RunFinished) and final.status == "fail" and final.record_path
    probe = tomllib.loads(Path(final.record_path).read_text())["verdict"]["stages"]["probe"]
    assert probe["status"] == "error", probe
    assert "exit status -9 (SIGKILL): out of memory: the kernel's OOM killer ended a process" in probe["evidence"]
    seen = float(probe["evidence"].split("peak RSS of its processes seen ")[1].split(" GiB")[0])
    # RSS counts shared library pages the cgroup charged to whoever read them first, so it can pass the limit
    assert 0.05 < seen < 2.0, probe["evidence"]


# ------------------------------------------------------------------------------ children end with gpuaccept
def _pids_running(needle: str) -> list[int]:
    import psutil

    out = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if needle in " ".join(proc.info["cmdline"] or []):
                out.append(proc.info["pid"])
        except psutil.Error:
            continue
    return out


def test_the_trace_child_ends_and_removes_its_folder_when_gpuaccept_is_killed(tmp_path, tiny_model_dir):
    """``kill -9`` of the process that started a traced plan: its child (a session of its own, so the kill does not
    reach it) used to run on and leave ``gpuaccept-trace-*`` in the temp folder."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    code = ("import sys; from core.spec import RunSpec; from core.prerun import make_plan; "
            "from core.plan.traced import trace_in_child; "
            f"spec = RunSpec.build(model={str(tiny_model_dir)!r}, mode='lora', seq_len=32); "
            "trace_in_child(spec, make_plan(spec).config, 'cpu')")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO,
                              env={**os.environ, "TMPDIR": str(tmp)})
    deadline = time.monotonic() + 60
    children: list[int] = []
    while time.monotonic() < deadline and not children:
        children = [p for p in _pids_running("core.plan.tracer") if p != parent.pid and str(tmp) in _cmdline(p)]
        time.sleep(0.05)
    assert children, "the trace child never started"
    assert len(list(tmp.glob("gpuaccept-trace-*"))) == 1
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (any(_alive(p) for p in children) or list(tmp.iterdir())):
        time.sleep(0.1)
    assert not any(_alive(p) for p in children), "the trace child outlived gpuaccept"
    assert list(tmp.iterdir()) == [], "the trace's temp folder was left behind"


def _cmdline(pid: int) -> str:
    import psutil

    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_a_conversion_left_by_a_killed_process_is_removed_and_a_fresh_one_kept(tmp_path):
    """The embedded model's conversion writes ``.convert-*`` beside the cache; ``kill -9`` during it left the folder
    (the model's size) for good."""
    from core.models import STALE_CONVERSION_S, remove_stale_conversions

    old, fresh, cache = tmp_path / ".convert-old", tmp_path / ".convert-new", tmp_path / "smollm2"
    for folder in (old, fresh, cache):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x" * 10)
    past = time.time() - STALE_CONVERSION_S - 5
    os.utime(old, (past, past))
    assert remove_stale_conversions(tmp_path) == [old]
    assert not old.exists() and fresh.is_dir() and cache.is_dir()


# ------------------------------------------------------------------------- the kill check waits for the groups
def test_the_kill_check_waits_for_a_group_still_being_torn_down():
    """Issue 16, item 7: the DDP kill check looked once, 50 ms after SIGKILL; a rank still being torn down then
    counted as alive. A group whose last process ends 0.5 s later is now seen gone; one that lives on is named."""
    from core.stages.childproc import groups_left_after_kill

    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"], start_new_session=True)
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        time.sleep(0.05)
        started = time.monotonic()
        assert groups_left_after_kill([slow.pid], timeout_s=10) == []
        assert 0.2 < time.monotonic() - started < 5
        assert groups_left_after_kill([stuck.pid], timeout_s=0.3) == [stuck.pid]
    finally:
        stuck.kill()
        stuck.wait()
        slow.wait()
