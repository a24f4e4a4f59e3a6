"""Issue 8: the inference probe with a device_map (one process, layers split over devices) records which modules went
where and a measurement per device. Several GPUs are not here: the worker's path runs on the CPU with an explicit
one-device map; the split and the per-device ledger are checked on accelerate-shaped data."""

from __future__ import annotations

from dataclasses import replace

import pytest

from core.child.probe import layer_placement
from core.errors import GpuAcceptError
from core.protocol.events import DeviceMap, Ledger
from core.protocol.job import worker_job
from core.spec import RunSpec
from core.stages.childproc import Launch, check_exit, launch_options, start_child, watch
from core.stages.probe import _measurement, _per_device


def test_layer_placement_joins_consecutive_layers_per_device():
    hf_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0, "model.layers.2": 0,
              "model.layers.3": 1, "model.layers.4": 1, "model.norm": 1, "model.rotary_emb": 1, "lm_head": 1}
    got = layer_placement(hf_map, {"cuda:0": "cuda:2", "cuda:1": "cuda:5"})
    assert got == {"cuda:2": ["model.embed_tokens", "model.layers.0-2"],
                   "cuda:5": ["model.layers.3-4", "model.norm", "model.rotary_emb", "lm_head"]}
    # a layer sent back to an earlier device (accelerate never does, but a hand-made map may) is not joined
    odd = layer_placement({"model.layers.0": 0, "model.layers.1": 1, "model.layers.2": 0}, {})
    assert odd == {"cuda:0": ["model.layers.0", "model.layers.2"], "cuda:1": ["model.layers.1"]}


def test_one_process_over_two_devices_gives_a_measurement_per_device():
    from core.protocol.events import parse_event

    ledger = parse_event({
        "kind": "ledger", "t": 1.0, "device": "cuda:0", "global_rank": 0, "local_rank": 0, "world_size": 1,
        "node_rank": 0, "host": "h", "wrapper": "none", "steps": 3, "weights_bytes": 300, "weights_loaded_bytes": 300,
        "gradients_bytes": 0, "optimizer_states_bytes": 0, "step_time_s": 0.5, "tokens_per_s": 10.0,
        "rss_start_bytes": 4, "peak_rss_bytes": 10, "rss_after_load_bytes": 5, "torch_threads": 1,
        "peak_allocated_bytes": 999, "peak_reserved_bytes": 1999,
        "per_device": [{"device": "cuda:0", "weights_bytes": 100, "peak_allocated_bytes": 150,
                        "peak_reserved_bytes": 200},
                       {"device": "cuda:1", "weights_bytes": 200, "peak_allocated_bytes": 260,
                        "peak_reserved_bytes": 300}]})
    placement = {"cuda:0": {"parameters": 25, "bytes": 100, "trainable": 0},
                 "cuda:1": {"parameters": 50, "bytes": 200, "trainable": 0}}
    ms = [_measurement(x, placement) for x in _per_device([ledger])]
    assert [(m.device, m.weights_bytes, m.peak_bytes, m.peak_reserved_bytes, m.parameters) for m in ms] == [
        ("cuda:0", 100, 150, 200, 25), ("cuda:1", 200, 260, 300, 50)]
    assert all(m.wrapper == "device_map (accelerate)" and m.gradients_bytes == 0 for m in ms)


def test_the_worker_loads_with_a_device_map_and_reports_where_modules_went(tiny_model_dir, tmp_path):
    spec = RunSpec.build(model=str(tiny_model_dir), mode="inference", devices="0,1", strategy="device_map",
                         seq_len=32, batch_size=2, probe_steps=2)
    job = replace(worker_job(spec, "probe", tiny_model_dir, "cpu", ["cpu"]), device_map={"": "cpu"})
    child = start_child("probe", tmp_path / "probe", job)
    events = list(watch(child))
    check_exit(child)
    (placed,) = [e for e in events if isinstance(e, DeviceMap)]
    assert placed.layers == {"cpu": ["(the whole model)"]}  # accelerate's hf_device_map, as loaded
    (ledger,) = [e for e in events if isinstance(e, Ledger)]
    assert ledger.weights_bytes > 0 and ledger.gradients_bytes == 0


def test_device_map_runs_inference_only_and_in_one_process(tiny_model_dir):
    spec = RunSpec.build(model=str(tiny_model_dir), mode="inference", devices="0,1", strategy="device_map")
    assert launch_options(spec, ["cuda:0", "cuda:1"]) == Launch(nproc=1, visible_devices=["cuda:0", "cuda:1"])
    from core.pipeline import AcceptanceRun

    training = RunSpec.build(model=str(tiny_model_dir), mode="full", devices="0,1", strategy="device_map")
    with pytest.raises(GpuAcceptError, match="device_map is probed for inference"):
        AcceptanceRun(training, devices_override=_two_cuda())


def _two_cuda():
    from core.plan.devices import DeviceInfo

    return [DeviceInfo(f"cuda:{i}", "cuda", "test GPU", 24 * 2**30, "constructed for tests") for i in (0, 1)]


def test_a_cuda_ledger_of_one_device_reads_the_allocator_not_a_tracker(monkeypatch):
    """One CUDA device without a device map: the peak is the allocator's. (Before the probe's split the ledger took
    the CPU tracker's branch for every ledger without a device map, and a CUDA probe, which has no tracker, failed.)"""
    import torch

    from core.child.probe import Seen, measured_ledger

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1500)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 2048)
    spec = RunSpec.build(mode="lora", devices="cpu", seq_len=32, batch_size=2, grad_accum=3, probe_steps=3)
    seen = Seen(tracker=None, gradients=10, optimizer_states=20, step_times=[9.0, 0.5, 1.5])
    ledger = Ledger(**measured_ledger(spec, seen, "cuda:0", "cuda:3", 300, 200, "none", 1, 2))
    assert (ledger.device, ledger.peak_allocated_bytes, ledger.peak_reserved_bytes) == ("cuda:3", 1500, 2048)
    assert ledger.peak_tracked_tensor_bytes is None and ledger.tracked_method is None and ledger.per_device is None
    assert ledger.step_time_s == 1.0  # the first step (one-off allocations) is left out of the mean
    assert ledger.tokens_per_s == 2 * 32 * 3 / 1.0
    assert (ledger.weights_bytes, ledger.weights_loaded_bytes) == (200, 300)
