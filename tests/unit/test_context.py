"""Issue 38: the CUDA context by GPU (core/plan/context.py): thread stacks by SMs x resident threads x 1 KiB, the heap and
printf FIFO, and the modules and driver part one H200 measured; each value below is worked by hand from those rules."""

from __future__ import annotations

from core.plan.context import MEASURED_H200_INFERENCE, MEASURED_H200_TRAINING, cuda_context, gpu_shape

MiB = 2**20


def test_on_the_measured_gpu_the_estimate_is_the_measurement():
    assert cuda_context("NVIDIA H200", training=True).bytes == MEASURED_H200_TRAINING == 804_061_184
    assert cuda_context("NVIDIA H200", training=False).bytes == MEASURED_H200_INFERENCE == 728_563_712


def test_other_gpus_differ_by_their_thread_stacks():
    # A100: 108 SMs x 2048 threads x 1 KiB = 216 MiB, 48 MiB less than the H200's 132 x 2048 x 1 KiB = 264 MiB
    assert cuda_context("NVIDIA A100-SXM4-80GB", training=True).bytes == 804_061_184 - 48 * MiB == 753_729_536
    # RTX 4090 (compute capability 8.9: 1536 resident threads per SM): 128 x 1536 x 1 KiB = 192 MiB
    assert cuda_context("NVIDIA GeForce RTX 4090", training=False).bytes == 728_563_712 - 72 * MiB
    # an H100 PCIe has 114 SMs, the SXM part 132: its name decides
    assert gpu_shape("NVIDIA H100 PCIe") == (114, 2048, "9.0")
    assert gpu_shape("NVIDIA H100 80GB HBM3") == (132, 2048, "9.0")
    text = cuda_context("NVIDIA A100-SXM4-80GB", training=True).text
    assert "108 SMs x 2048 threads x 1 KiB = 216 MiB" in text and "measured on an H200" in text


def test_a_gpu_its_name_does_not_describe_gets_the_measured_total_said_so():
    estimate = cuda_context("planned GPU", training=True)
    assert estimate.bytes == MEASURED_H200_TRAINING and "does not say its SMs" in estimate.text


def test_eager_module_loading_makes_the_estimate_a_floor():
    assert "a floor" in cuda_context("NVIDIA H200", True, {"CUDA_MODULE_LOADING": "EAGER"}).text
    assert "a floor" not in cuda_context("NVIDIA H200", True, {}).text


def test_nccl_buffers_are_channels_times_connections_times_the_three_protocols():
    from core.plan.context import nccl_buffers

    # NCCL's defaults: SIMPLE 4 MiB, LL 8 x 512 x 8 x 16 B = 512 KiB, LL128 120 x 640 x 8 x 8 B = 4,915,200 B
    per_connection = 4 * MiB + 512 * 1024 + 4_915_200
    total, text = nccl_buffers({})
    assert total == 16 * 2 * per_connection == 308_281_344 and "NCCL's defaults" in text
    # NCCL_BUFFSIZE=1 MiB and at most 4 channels: 4 x 2 x (1 MiB + 512 KiB + 4,915,200 B)
    small, text = nccl_buffers({"NCCL_BUFFSIZE": str(MiB), "NCCL_MAX_NCHANNELS": "4"})
    assert small == 4 * 2 * (MiB + 512 * 1024 + 4_915_200) and "NCCL_BUFFSIZE=1048576" in text


def test_other_processes_on_a_gpu_count_in_what_nvml_will_show():
    """core/plan/devices.py ``others_on_gpus``: a GPU's used memory before the run, read by NVML, is added to the
    plan's overhead line (NVML shows every process's memory); not read, it is said why; a planned GPU is left alone."""
    import pynvml

    from core.plan.devices import DeviceInfo, others_on_gpus
    from core.plan.lines import overhead_line
    from tests.fake_nvml import FakeGpu, FakeNvml

    h100 = DeviceInfo("cuda:0", "cuda", "NVIDIA H100 80GB HBM3", 80 * 2**30, "torch.cuda total memory", 80 * 2**30)
    planned = DeviceInfo("cuda:1", "cuda", "planned GPU", 80 * 2**30, "given: 80GiB", 80 * 2**30)
    busy = FakeNvml([FakeGpu("GPU-aaaa", name="NVIDIA H100 80GB HBM3", used=12 * 2**30, procs=[(4242, 12 * 2**30)])])
    (read, same) = others_on_gpus([h100, planned], busy)
    assert (read.others_bytes, same) == (12 * 2**30, planned)
    context = cuda_context("NVIDIA H100 80GB HBM3", training=True).bytes
    line = overhead_line(read)
    assert line.bytes == context + 12 * 2**30 and "+ other processes on this GPU: 12,288 MiB (NVML used" in line.method
    assert overhead_line(h100).bytes == context and "other processes" not in overhead_line(planned).method
    (unread,) = others_on_gpus([h100], FakeNvml([], init_error=pynvml.NVMLError_LibraryNotFound))
    assert unread.others_bytes is None and overhead_line(unread).bytes == context
    assert "other processes on this GPU not read: CPU mode: NVML unavailable" in overhead_line(unread).method


def test_another_cuda_than_the_measurements_is_said():
    same = cuda_context("NVIDIA H200", True, {}, "13.0").text
    other = cuda_context("NVIDIA H200", True, {}, "12.8").text
    assert "under CUDA 13.0" in same and "may differ" not in same
    assert other.endswith("this torch runs CUDA 12.8, the module part was measured under CUDA 13.0: it may differ "
                          "(not measured)")
    assert cuda_context("NVIDIA H200", True, {}, "12.8").bytes == MEASURED_H200_TRAINING  # said, not guessed
