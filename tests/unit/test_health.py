"""Issue 38: the health preflight, read through a fake NVML (tests/fake_nvml.py, pynvml's own exceptions and constants).

A healthy GPU meets every health criterion; each fault (an uncorrected ECC error, a pending row remap, a failed one, a
pending page retirement, a thermal slowdown, a PCIe link at x4 of x16) fails its own criterion, and only it, with the
evidence in the row; a reading NVML refuses is "not judged" with NVML's reason; no NVML is "not run", named. The
record's ``probe.health`` table is judged again by ``gpuaccept verify``.
"""

from __future__ import annotations

import shutil
import tomllib

import pynvml
import pytest

from core.criteria import AcceptCriteria, judge_health, missed
from core.monitor.health import HealthReport, preflight
from core.record.verdicts import RecordValueError
from core.record.verify import recompute_verdicts
from tests.fake_nvml import FakeGpu, FakeNvml

UNCORRECTED, CORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
VOLATILE, AGGREGATE = pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC
H100 = "NVIDIA H100 80GB HBM3"


def gpu(**faults) -> FakeGpu:
    return FakeGpu(uuid="GPU-aaaa-0001", name=H100, **faults)


def judged(g: FakeGpu, criteria: AcceptCriteria | None = None):
    report = preflight(["cuda:0"], FakeNvml([g]), env={})
    assert report.status == "measured", report.reason
    return report, judge_health(criteria or AcceptCriteria(), report.facts())


def by_criterion(rows):
    return {r.criterion: r for r in rows}


def test_a_healthy_gpu_meets_every_health_criterion_and_its_readings_are_recorded():
    report, rows = judged(gpu())
    assert [r.criterion for r in rows] == ["max_ecc_uncorrected", "max_pending_repairs", "max_fault_clock_events",
                                           "min_pcie_width_share"]
    assert all(r.met is True for r in rows), [r.words() for r in rows]
    d = report.devices[0]
    assert (d.ecc_mode, d.ecc_uncorrected_volatile, d.row_remap_pending, d.clock_events) == \
        ("enabled", 0, False, ("gpu_idle",))
    # the link generation idles down (gen 1 of 5) and is recorded, not judged: only the width is a criterion
    assert (d.pcie_generation, d.pcie_generation_max, d.pcie_width, d.pcie_width_max) == (1, 5, 16, 16)
    assert (d.sm_clock_mhz, d.sm_clock_max_mhz, d.persistence_mode, d.compute_mode) == (345, 1980, "enabled", "default")
    assert "retired_pages_pending" in d.unread  # an H100 remaps rows: page retirement is NotSupported, named
    assert (report.driver_version, report.cuda_driver_version) == ("580.95.05", "13.0")


@pytest.mark.parametrize("faults,criterion,value,evidence", [
    ({"ecc_errors": {(UNCORRECTED, VOLATILE): 2, (UNCORRECTED, AGGREGATE): 7, (CORRECTED, VOLATILE): 40}},
     "max_ecc_uncorrected", 2.0, "7 over its life"),
    ({"remapped_rows": (3, 1, 1, 0)}, "max_pending_repairs", 1.0, "waiting for a GPU reset"),
    ({"remapped_rows": (3, 1, 0, 1)}, "max_pending_repairs", "failed", "the GPU needs service"),
    ({"remapped_rows": None, "retired_pages": {0: 2, 1: 1}, "retired_pending": True},  # a V100: page retirement
     "max_pending_repairs", 1.0, "waiting for a GPU reset"),
    ({"clock_events": 0x40 | 0x4}, "max_fault_clock_events", 1.0, "sw_power_cap, hw_thermal_slowdown"),
    ({"pcie": (4, 5, 4, 16)}, "min_pcie_width_share", 0.25, "x4 of x16"),
])
def test_each_fault_fails_its_own_criterion_with_evidence(faults, criterion, value, evidence):
    _, rows = judged(gpu(**faults))
    failed = missed(rows)
    assert [r.criterion for r in failed] == [criterion], [r.words() for r in rows]
    row = failed[0]
    assert row.value == value and evidence in row.on and row.on.startswith("cuda:0")
    assert "MISSED" in row.words()


def test_a_threshold_set_in_accept_moves_the_line():
    faulty = gpu(ecc_errors={(UNCORRECTED, VOLATILE): 2}, pcie=(4, 5, 8, 16))
    _, rows = judged(faulty, AcceptCriteria(max_ecc_uncorrected=2, min_pcie_width_share=0.5))
    assert missed(rows) == []
    _, rows = judged(faulty, AcceptCriteria(max_ecc_uncorrected=1, min_pcie_width_share=0.75))
    assert [r.criterion for r in missed(rows)] == ["max_ecc_uncorrected", "min_pcie_width_share"]


def test_a_reading_nvml_refuses_is_not_judged_with_its_reason_never_passed():
    consumer = gpu(ecc=False, remapped_rows=None, errors={"nvmlDeviceGetCurrPcieLinkWidth": pynvml.NVMLError_NoPermission})
    _, rows = judged(consumer)
    rows = by_criterion(rows)
    assert rows["max_ecc_uncorrected"].met is None and "ECC is disabled" in rows["max_ecc_uncorrected"].why
    assert rows["max_pending_repairs"].met is None and "Not Supported" in rows["max_pending_repairs"].why
    assert rows["min_pcie_width_share"].met is None and "Insufficient Permissions" in rows["min_pcie_width_share"].why
    assert rows["max_fault_clock_events"].met is True


def test_without_nvml_or_on_the_cpu_the_preflight_is_not_run_and_says_why():
    no_driver = preflight(["cuda:0"], FakeNvml([], init_error=pynvml.NVMLError_LibraryNotFound), env={})
    assert no_driver.status == "not_run" and "NVML unavailable" in no_driver.reason
    assert "NVML Shared Library Not Found" in no_driver.summary()
    cpu = preflight(["cpu"], FakeNvml([gpu()]), env={})
    assert cpu.status == "not_run" and "on the CPU" in cpu.reason
    assert judge_health(AcceptCriteria(), no_driver.facts()) == []


def test_each_cuda_device_is_read_as_cuda_numbers_it():
    """CUDA_VISIBLE_DEVICES=1 makes the second GPU cuda:0 (core/monitor/nvml.py's mapping)."""
    first, second = FakeGpu(uuid="GPU-0", bus="00000000:01:00.0"), FakeGpu(uuid="GPU-1", bus="00000000:02:00.0",
                                                                           pcie=(4, 4, 4, 16))
    report = preflight(["cuda:0"], FakeNvml([first, second]), env={"CUDA_VISIBLE_DEVICES": "1"})
    assert [(d.device, d.uuid) for d in report.devices] == [("cuda:0", "GPU-1")]
    missing = preflight(["cuda:0", "cuda:1"], FakeNvml([first]), env={})
    assert "device" in missing.devices[1].unread


def test_the_report_reads_back_from_its_record_table_to_the_same_facts():
    report, _ = judged(gpu(ecc_errors={(UNCORRECTED, VOLATILE): 1}, clock_events=0x20))
    table = report.to_table()
    assert "pcie_generation_note" in table and table["devices"][0]["clock_events"] == ["sw_thermal_slowdown"]
    again = HealthReport.from_table(table)
    assert again is not None and again.facts() == report.facts()


@pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="the committed record's checks use ssh-keygen")
def test_verify_judges_the_records_health_table_again(tmp_path):
    from tests.records import path_of

    rec = tomllib.loads(path_of("lora").read_text())
    report, _ = judged(gpu(remapped_rows=(0, 0, 1, 0)))
    rec["probe"]["health"] = report.to_table()
    problems = recompute_verdicts(rec)
    assert any("max_pending_repairs" in p for p in problems), problems  # the record says pass; its data says fail
    rec["probe"]["health"]["devices"][0]["row_remap_pending"] = "no"  # verify reports it as a schema finding
    with pytest.raises(RecordValueError, match=r"probe.health.devices\[0\].row_remap_pending is 'no', not true"):
        recompute_verdicts(rec)


def test_the_probe_screens_rows_name_the_missed_criteria_beside_the_readings():
    from core.monitor.health import HEALTH_COLUMNS, health_table

    report, rows = judged(gpu(pcie=(4, 5, 4, 16), clock_events=0x40))
    table = health_table(report, rows)
    assert len(table) == 1 and len(table[0]) == len(HEALTH_COLUMNS)
    assert table[0][3] == "hw_thermal_slowdown" and table[0][4] == "gen 4/5, x4/x16"
    assert table[0][5] == "MISSED max_fault_clock_events, min_pcie_width_share"
    healthy, rows = judged(gpu())
    assert health_table(healthy, rows)[0][5] == "met"


def test_the_gpu_check_keeps_the_same_health_criteria():
    from benchmarks.gpu_check import HEALTH_CRITERIA as KEPT
    from core.monitor.health import HEALTH_CRITERIA

    assert KEPT == HEALTH_CRITERIA


def test_command_mode_takes_the_health_criteria_and_judges_the_gpus_the_command_used():
    from core.criteria import command_criteria
    from core.record.verdicts import health_facts

    assert command_criteria({"max_ecc_uncorrected": 3, "min_pcie_width_share": 0.5}).max_ecc_uncorrected == 3.0
    # every visible GPU is read (devices=None), those the command used are judged
    healthy = FakeGpu(uuid="GPU-0", bus="00000000:01:00.0")
    narrow = FakeGpu(uuid="GPU-1", bus="00000000:02:00.0", pcie=(4, 5, 4, 16))
    report = preflight(None, FakeNvml([healthy, narrow]), env={})
    assert [d.device for d in report.devices] == ["cuda:0", "cuda:1"]
    probe = {"health": report.to_table()}
    assert [f.on for f in health_facts(probe, used=["cuda:0"])] == ["cuda:0"]
    assert missed(judge_health(AcceptCriteria(), health_facts(probe, used=["cuda:1"])))[0].value == 0.25
    assert preflight(None, FakeNvml([]), env={}).reason == "NVML lists no GPU that CUDA can use here"
