"""The NVML backend against the monitor cases M1-M7 (tests/cases/monitor.md), on a constructed NVML layer that raises
pynvml's own exception classes (tests/fake_nvml.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pynvml
import pytest

from core.monitor.nvml import NvmlBackend, cuda_devices, default_backend, discover
from core.monitor.sampler import HostBackend, ReplayBackend, Sampler
from tests.fake_nvml import FakeGpu, FakeNvml

BIG, SMALL = 25_447_170_048, 8_513_978_368  # case M1's two cards
UUID_BIG, UUID_SMALL = "GPU-aaaa1111-0000-0000-0000-000000000000", "GPU-bbbb2222-0000-0000-0000-000000000000"
FOREIGN_PID = 2**22 + 1  # above PID_MAX_LIMIT (2^22): a PID of another namespace, never one in ours


def two_cards(**small_kw) -> FakeNvml:
    return FakeNvml([FakeGpu(UUID_BIG, name="NVIDIA RTX 3090", bus="00000000:01:00.0", total=BIG),
                     FakeGpu(UUID_SMALL, name="NVIDIA RTX 2070", bus="00000000:02:00.0", total=SMALL, **small_kw)])


def by_device(samples):
    return {s.device: s for s in samples}


# ------------------------------------------------------------------------------------------------ M1 index mapping
def test_m1_cuda_visible_devices_index_maps_to_the_small_card_not_nvml_index_0():
    backend = NvmlBackend(two_cards(), env={"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    samples = by_device(backend.sample(set()))
    assert samples["cuda:0"].total_bytes.value == SMALL and samples["cuda:0"].uuid == UUID_SMALL
    assert samples["nvml:0"].total_bytes.value == BIG  # the other card: shown, but not as a CUDA device here
    assert backend.cuda[0].verified


def test_m1_uuid_prefix_in_cuda_visible_devices_is_exact_whatever_the_order():
    backend = NvmlBackend(two_cards(), env={"CUDA_VISIBLE_DEVICES": "GPU-bbbb2222"})
    assert [c.device.uuid for c in backend.cuda] == [UUID_SMALL]
    assert backend.cuda[0].verified  # a UUID names the device; FASTEST_FIRST does not matter


def test_m1_fastest_first_with_different_models_is_unverified_until_torch_reports_its_uuid():
    backend = NvmlBackend(two_cards(), env={})
    assert [c.device.uuid for c in backend.cuda] == [UUID_BIG, UUID_SMALL]  # PCI order assumed
    assert not backend.cuda[0].verified and "unverified" in backend.mapping_note
    # torch says cuda:0 is the small card (CUDA ranked it faster): the mapping follows torch and swaps the other
    line = backend.bind_uuid("cuda:0", UUID_SMALL.removeprefix("GPU-"))
    assert "by torch's UUID" in line
    samples = by_device(backend.sample(set()))
    assert samples["cuda:0"].total_bytes.value == SMALL
    assert samples["cuda:1"].total_bytes.value == BIG
    assert backend.bind_uuid("cuda:0", UUID_SMALL).endswith("confirmed by torch's UUID")


def test_m1_cuda_visible_devices_parsing_follows_cuda():
    devices = discover(two_cards())

    def uuids(visible):
        return [c.device.uuid for c in cuda_devices(devices, visible, "PCI_BUS_ID")[0]]

    assert uuids("1,7,0") == [UUID_SMALL]  # the list ends at the first entry that matches nothing
    assert uuids("") == [] and uuids("-1") == []
    assert uuids("1,0") == [UUID_SMALL, UUID_BIG]
    assert uuids("0,0") == [] and uuids("GPU-aaaa,GPU-aaaa1111") == []  # a repeated device hides them all
    assert uuids("1gpu2") == [UUID_SMALL]  # indices parse like strtoul
    assert uuids("²") == []  # not an ASCII digit: matches nothing, no exception
    assert uuids("GPU-bbbb,0") == [UUID_SMALL]  # the first entry's kind decides; the other kind ends the list


# ------------------------------------------------------------------------------------------------- M2 used semantics
def test_m2_idle_gpu_used_is_0_with_v2_and_driver_reserved_memory_is_its_own_reading():
    nvml = FakeNvml([FakeGpu(UUID_BIG, used=0, reserved=308 * 2**20)])
    (s,) = NvmlBackend(nvml, env={}).sample(set())
    assert s.used_bytes.value == 0 and s.used_bytes.ok
    assert s.reserved_bytes.value == 308 * 2**20
    assert s.free_bytes.value == s.total_bytes.value - 308 * 2**20


def test_m2_an_old_driver_without_v2_falls_back_to_v1_and_says_used_includes_reserved():
    nvml = FakeNvml([FakeGpu(UUID_BIG, used=0, reserved=308 * 2**20)], v2=False)
    (s,) = NvmlBackend(nvml, env={}).sample(set())
    assert s.used_bytes.value == 308 * 2**20
    assert not s.used_bytes.ok and "includes driver-reserved" in s.used_bytes.reason
    assert s.reserved_bytes.value is None


# ---------------------------------------------------------------------------------------------------- M3 containers
def test_m3_in_a_container_ours_is_the_change_since_the_baseline_with_the_reason():
    gpu = FakeGpu(UUID_BIG, used=2**30, procs=[(FOREIGN_PID, None)])
    backend = NvmlBackend(FakeNvml([gpu]), env={})
    sampler = Sampler(backend)
    sampler.follow({os.getpid()})  # the baseline is taken at the next sample
    sampler.sample_once()
    gpu.used = 5 * 2**30
    gpu.procs = [(FOREIGN_PID, None), (FOREIGN_PID + 1, None)]
    (s,) = sampler.sample_once()
    assert s.ours_bytes.value == 4 * 2**30
    assert "another PID namespace" in s.ours_bytes.reason and "since the probe started" in s.ours_bytes.reason
    assert s.others_bytes.value == 2**30
    assert sampler.peak_ours("cuda:0") == 4 * 2**30


def test_m3_no_process_listed_or_no_per_process_memory_falls_back_to_the_baseline():
    """WSL2 and some containers list no process; WDDM and MIG report no per-process bytes (usedGpuMemory None)."""
    gpu = FakeGpu(UUID_BIG, used=2**30)
    sampler = Sampler(NvmlBackend(FakeNvml([gpu]), env={}))
    sampler.follow({os.getpid()})
    sampler.sample_once()
    gpu.used = 3 * 2**30
    (s,) = sampler.sample_once()
    assert s.ours_bytes.value == 2 * 2**30 and "lists no process" in s.ours_bytes.reason
    gpu.procs = [(os.getpid(), None)]
    (s,) = sampler.sample_once()
    assert s.ours_bytes.value == 2 * 2**30 and "does not report per-process" in s.ours_bytes.reason


def test_m3_behind_an_mps_server_ours_is_the_change_since_the_baseline(monkeypatch):
    import core.monitor.nvml

    server = os.getppid()
    monkeypatch.setattr(core.monitor.nvml, "_process_name", lambda pid: "nvidia-cuda-mps-server" if pid == server else "x")
    gpu = FakeGpu(UUID_BIG, used=2**30, procs=[(server, 2**30)])
    sampler = Sampler(NvmlBackend(FakeNvml([gpu]), env={}))
    sampler.follow({os.getpid()})
    sampler.sample_once()
    gpu.used = 5 * 2**30
    (s,) = sampler.sample_once()
    assert s.ours_bytes.value == 4 * 2**30 and s.ours_bytes.reason.startswith("MPS")


def test_m3_mps_clients_count_as_ours():
    gpu = FakeGpu(UUID_BIG, used=6 * 2**30, procs=[(os.getppid(), 2**30)], mps=[(os.getpid(), 5 * 2**30)])
    (s,) = NvmlBackend(FakeNvml([gpu]), env={}).sample({os.getpid()})
    assert s.ours_bytes.value == 5 * 2**30 and s.others_bytes.value == 2**30


def test_m3_outside_a_container_ours_is_our_process_tree_from_nvml():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        gpu = FakeGpu(UUID_BIG, used=7 * 2**30, procs=[(child.pid, 3 * 2**30), (os.getppid(), 4 * 2**30)])
        (s,) = NvmlBackend(FakeNvml([gpu]), env={}).sample({os.getpid()})  # the child is a descendant of ours
        assert s.ours_bytes.value == 3 * 2**30 and s.ours_bytes.ok
        assert s.others_bytes.value == 4 * 2**30
    finally:
        child.kill()
        child.wait()


# ---------------------------------------------------------------------------------------------------- M4 a bad GPU
def test_m4_a_lost_gpu_is_na_with_its_reason_and_the_other_keeps_updating():
    nvml = two_cards(errors={"nvmlDeviceGetMemoryInfo": pynvml.NVMLError_GpuIsLost})
    backend = NvmlBackend(nvml, env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    samples = by_device(backend.sample({os.getpid()}))
    assert samples["cuda:1"].total_bytes.value is None and samples["cuda:1"].used_bytes.reason == "GPU is lost"
    assert samples["cuda:1"].ours_bytes.reason == samples["cuda:1"].utilization_pct.reason == "GPU is lost"
    nvml.gpus[0].used = 3 * 2**30
    assert by_device(backend.sample(set()))["cuda:0"].used_bytes.value == 3 * 2**30


def test_m4_a_gpu_that_fails_at_enumeration_is_kept_as_na():
    nvml = FakeNvml([FakeGpu(UUID_BIG), FakeGpu(UUID_SMALL, errors={"nvmlDeviceGetUUID": pynvml.NVMLError_Unknown})])
    samples = by_device(NvmlBackend(nvml, env={}).sample(set()))
    assert samples["nvml:1"].used_bytes.reason == "Unknown Error"
    assert samples["cuda:0"].total_bytes.ok


# ------------------------------------------------------------------------------------------- M5 unsupported fields
def test_m5_unsupported_utilisation_and_process_list_are_na_and_memory_still_reads():
    gpu = FakeGpu(UUID_BIG, used=2**30, errors={"nvmlDeviceGetUtilizationRates": pynvml.NVMLError_NotSupported,
                                                "nvmlDeviceGetComputeRunningProcesses": pynvml.NVMLError_NotSupported})
    (s,) = NvmlBackend(FakeNvml([gpu]), env={}).sample({os.getpid()})
    assert s.utilization_pct.value is None and "Not Supported" in s.utilization_pct.reason
    assert s.ours_bytes.value is None and "Not Supported" in s.ours_bytes.reason
    assert s.used_bytes.value == 2**30 and s.used_bytes.ok and s.total_bytes.ok


# ---------------------------------------------------------------------------------------------------------- M6 MIG
def test_m6_mig_devices_are_the_cuda_devices_and_the_parent_is_shown_as_mig():
    migs = [FakeGpu("MIG-1111aaaa-0000-0000-0000-000000000000", name="H200 MIG 1g.18gb", total=18 * 2**30, used=2**30),
            FakeGpu("MIG-2222bbbb-0000-0000-0000-000000000000", name="H200 MIG 3g.71gb", total=71 * 2**30)]
    parent = FakeGpu(UUID_BIG, name="NVIDIA H200", total=141 * 2**30, mig=migs,
                     errors={"nvmlDeviceGetUtilizationRates": pynvml.NVMLError_NotSupported})
    backend = NvmlBackend(FakeNvml([parent]), env={})
    # a CUDA process enumerates one MIG device at most (CUDA guide: "only single MIG instance enumeration")
    assert [c.device.uuid for c in backend.cuda] == [migs[0].uuid]
    samples = by_device(backend.sample({os.getpid()}))
    assert samples["nvml:0"].note == "MIG parent" and "MIG" in samples["nvml:0"].ours_bytes.reason
    assert samples["cuda:0"].total_bytes.value == 18 * 2**30
    assert samples["nvml:0/mig:1"].total_bytes.value == 71 * 2**30  # shown, not a CUDA device of this process
    only = NvmlBackend(FakeNvml([parent]), env={"CUDA_VISIBLE_DEVICES": "MIG-2222bbbb"})
    assert [c.device.uuid for c in only.cuda] == [migs[1].uuid]
    both = NvmlBackend(FakeNvml([parent]), env={"CUDA_VISIBLE_DEVICES": "MIG-2222bbbb,MIG-1111aaaa"})
    assert [c.device.uuid for c in both.cuda] == [migs[1].uuid]
    # torch reports bare hex; a MIG device's UUID binds to it
    assert "confirmed" in only.bind_uuid("cuda:0", migs[1].uuid.removeprefix("MIG-"))


def test_m6_legacy_mig_names_and_indices_of_mig_gpus():
    migs = [FakeGpu("MIG-1111aaaa-0000-0000-0000-000000000000", gi=1, ci=0),
            FakeGpu("MIG-2222bbbb-0000-0000-0000-000000000000", gi=2, ci=0)]
    parent = FakeGpu(UUID_BIG, name="NVIDIA H200", bus="00000000:01:00.0", mig=migs)
    other = FakeGpu(UUID_SMALL, name="NVIDIA H200", bus="00000000:02:00.0")
    devices = discover(FakeNvml([parent, other]))
    legacy = cuda_devices(devices, f"MIG-{UUID_BIG}/2/0", None)[0]
    assert [c.device.uuid for c in legacy] == [migs[1].uuid]
    # an index is an ordinal of the physical GPUs: 1 is the second GPU, not the second MIG device
    assert [c.device.uuid for c in cuda_devices(devices, "1", "PCI_BUS_ID")[0]] == [UUID_SMALL]
    assert [c.device.uuid for c in cuda_devices(devices, "0", "PCI_BUS_ID")[0]] == [migs[0].uuid]


# ----------------------------------------------------------------------------------------------------- M7 no driver
def test_m7_no_driver_is_cpu_mode_with_nvmls_reason():
    backend, note = default_backend(FakeNvml([], init_error=pynvml.NVMLError_LibraryNotFound), env={})
    assert isinstance(backend, HostBackend)
    assert note.startswith("CPU mode") and "NVML Shared Library Not Found" in note
    (s,) = backend.sample(set())
    assert s.device == "cpu" and s.total_bytes.ok


def test_m7_on_this_machine_without_a_driver_the_real_pynvml_gives_cpu_mode():
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        backend, note = default_backend(env={})
        assert isinstance(backend, HostBackend) and note.startswith("CPU mode")
    else:  # a GPU box: the real NVML backend starts and lists its devices
        pynvml.nvmlShutdown()
        backend, note = default_backend(env={})
        assert isinstance(backend, NvmlBackend) and backend.devices


# ----------------------------------------------------------------------------------------------- recording, replay
def test_an_nvml_trace_records_and_replays_with_uuid_reserved_and_utilisation(tmp_path):
    gpu = FakeGpu(UUID_BIG, used=2**30, reserved=2**20, util=37)
    sampler = Sampler(NvmlBackend(FakeNvml([gpu]), env={}))
    sampler.record(tmp_path / "trace.jsonl")
    first = sampler.sample_once()
    gpu.used = 2 * 2**30
    second = sampler.sample_once()
    sampler.stop()
    replay = ReplayBackend.from_jsonl(tmp_path / "trace.jsonl")
    assert replay.frames == [first, second]
    assert replay.frames[0][0].uuid == UUID_BIG and replay.frames[0][0].utilization_pct.value == 37
    assert replay.frames[1][0].reserved_bytes.value == 2**20


@pytest.mark.parametrize("visible", ["0", "GPU-aaaa"])
def test_each_sample_orders_cuda_devices_first(visible):
    backend = NvmlBackend(two_cards(), env={"CUDA_VISIBLE_DEVICES": visible, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert [s.device for s in backend.sample(set())] == ["cuda:0", "nvml:1"]
