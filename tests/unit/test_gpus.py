"""A GPU by name (core/gpus.py, issue 50): ``--devices 1xH200`` plans the box as that product runs, with the total
memory CUDA reports for it; the same table names the product of a GPU torch reports."""

from __future__ import annotations

import pytest

from core.devicespec import parse_planned_devices
from core.errors import SpecError
from core.gpus import GPUS, gpu_named, gpu_of_label, nameable
from core.plan.context import cuda_context
from core.plan.devices import detect_devices
from core.plan.workspace import LARGE_WORKSPACE, SMALL_WORKSPACE, cublas_workspaces, cudnn_attention_workspace
from core.spec import RunSpec


def test_a_named_gpu_is_its_product_with_the_memory_cuda_reports():
    h200, = detect_devices("1xH200")
    assert (h200.name, h200.label, h200.capacity_bytes) == ("cuda:0", "NVIDIA H200", 150_109_880_320)
    assert h200.planned and "NVIDIA's specification 141 GB HBM3e" in h200.capacity_source
    box = detect_devices("2xH100, 1x rtx-4090")
    assert [d.label for d in box] == ["NVIDIA H100 80GB HBM3"] * 2 + ["NVIDIA GeForce RTX 4090"]
    assert [d.capacity_bytes for d in box] == [81_090 * 2**20] * 2 + [24_563 * 2**20]
    assert [d.capacity_bytes for d in detect_devices("8xA100-80GB")] == [81_920 * 2**20] * 8
    # a capacity alone is still a planned GPU of no product
    assert detect_devices("24GiB")[0].label == "planned GPU" and detect_devices("24GiB")[0].planned


def test_every_product_reads_back_from_its_name_and_from_the_name_torch_reports():
    for gpu in GPUS:
        assert gpu_named(gpu.key) is gpu
        assert gpu_of_label(gpu.name) is gpu, gpu.key
    assert gpu_named("h100-sxm") is gpu_named("H100") and gpu_named("H100 PCIe") is not gpu_named("H100")
    assert gpu_of_label("NVIDIA A100 80GB PCIe").key == "A100-80GB"  # a PCIe A100 80GB is the same memory
    assert "H200" in nameable() and "V100" not in nameable()  # no reported total known for a V100


@pytest.mark.parametrize(("devices", "says"), [
    ("1xA100", "neither a capacity nor a GPU gpuaccept knows by name"),
    ("1xV100", "knows the Tesla V100's SMs but not the memory CUDA reports"),
    ("0,1xH200", "mixes CUDA indices with devices to plan for"),
    ("0xH200", "counts must be above 0"),
])
def test_a_name_it_cannot_plan_is_refused_saying_what_to_give(devices, says):
    with pytest.raises(SpecError, match=says):
        parse_planned_devices(devices)
    with pytest.raises(SpecError, match="^devices: "):
        RunSpec.build(devices=devices)


def test_the_named_gpu_sets_the_workspaces_the_attention_backend_and_the_context_the_plan_assumes():
    """On a Hopper named H200: cuBLAS's 32 MiB workspaces and cuDNN attention's backward; on an RTX 4090 (8.9) the
    8.125 MiB default and no cuDNN attention; the CUDA context by each one's SMs. A capacity alone assumes neither."""
    h200, = detect_devices("1xH200")
    rtx, = detect_devices("1xRTX4090")
    planned, = detect_devices("24GiB")
    assert cublas_workspaces(h200.label, True, "2.13.0")[0] == [LARGE_WORKSPACE] * 2
    assert cublas_workspaces(rtx.label, True, "2.13.0")[0] == [SMALL_WORKSPACE] * 2
    assert cudnn_attention_workspace(h200.label, True, "sdpa", "bf16", 2, 32, 256, 64)[0] == 2 * 32 * 256 * 65 * 4
    assert cudnn_attention_workspace(rtx.label, True, "sdpa", "bf16", 2, 32, 256, 64)[0] == 0
    assert "does not say its generation" in cudnn_attention_workspace(planned.label, True, "sdpa", "bf16", 2, 32,
                                                                      256, 64)[1]
    assert "132 SMs" in cuda_context(h200.label, True).text and "128 SMs" in cuda_context(rtx.label, True).text
    assert "does not say its SMs" in cuda_context(planned.label, True).text
