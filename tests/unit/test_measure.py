"""The CPU live-tensor tracker: new storages count, views and in-place results do not, freed ones are released."""

from __future__ import annotations

import torch

from core.child.measure import LiveTensorTracker, optimizer_state_bytes, parameter_placement

MiB = 2**20


def test_tracker_counts_new_storages_not_views():
    w = torch.randn(1024, 1024)  # 4 MiB, exists before: the baseline
    tracker = LiveTensorTracker(baseline_bytes=w.nbytes)
    with tracker:
        x = torch.randn(256, 1024)  # +1 MiB
        y = x @ w.t()  # w.t() is a view (0); y +1 MiB
        y.mul_(2)  # in place: 0
        del x  # -1 MiB
        z = y * 2  # +1 MiB
    assert tracker.peak_bytes == 6 * MiB
    assert tracker.current == 2 * MiB  # y and z still alive
    del y, z
    assert tracker.current == 0


def test_placement_counts_tied_weights_once():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    placement = parameter_placement(model)
    assert placement == {"cpu": {"parameters": 40, "bytes": 160, "trainable": 40}}


def test_optimizer_state_bytes_after_an_adamw_step():
    p = torch.nn.Parameter(torch.zeros(100))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones(100)
    opt.step()
    assert optimizer_state_bytes(opt) == 2 * 100 * 4 + 4  # two fp32 moments + the fp32 step counter


def test_a_storage_kept_from_an_earlier_step_is_counted_once():
    """The probe's bug this fixes: the optimizer states made in step 1 were tracked (created inside it) and then added
    to step 2's baseline as well, so every later step counted them twice (the embedded full fine-tuning default
    measured 3.43 GiB where 2.43 GiB were alive). ``restart`` takes what is alive as the step starts, once."""
    weights = torch.zeros(1024, 256)  # 1 MiB, before any step
    tracker = LiveTensorTracker(baseline_bytes=weights.nbytes)
    with tracker:  # step 1: states appear and stay
        states = torch.zeros(1024, 512)  # 2 MiB, kept
        tmp = torch.ones(1024, 256)  # 1 MiB, freed in the step
        del tmp
    assert tracker.peak_bytes == 4 * MiB
    tracker.restart(weights.nbytes + states.nbytes)  # step 2 starts: 3 MiB alive, each counted once
    with tracker:
        grads = torch.ones(1024, 256)  # +1 MiB
        del grads
    assert tracker.peak_bytes == 4 * MiB  # not 6 MiB (the states again)
    assert tracker.current == 0


def test_a_storage_regrown_in_place_is_counted_and_its_release_too():
    """FSDP2 all-gathers into a storage it grows with UntypedStorage.resize_ and frees with resize_(0): no op is
    dispatched, so the tracker follows resize_ itself."""
    buffer = torch.empty(0)  # exists before the step, empty (an FSDP2 unsharded parameter between all-gathers)
    tracker = LiveTensorTracker(baseline_bytes=0)
    with tracker:
        buffer.untyped_storage().resize_(MiB)  # all-gather: 1 MiB appears
        x = torch.ones(256, 1024)  # +1 MiB
        del x
        buffer.untyped_storage().resize_(0)  # reshard: freed
        y = torch.ones(256, 1024)  # +1 MiB
    assert tracker.peak_bytes == 2 * MiB
    assert tracker.current == MiB  # y
    del y
    assert torch.UntypedStorage.resize_ is not None and tracker.current == 0
