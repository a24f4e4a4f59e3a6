"""The CPU live-tensor tracker: new storages count, views and in-place results do not, freed ones are released."""

from __future__ import annotations

import torch

from core.measure import LiveTensorTracker, optimizer_state_bytes, parameter_placement

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
