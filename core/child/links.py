"""The links between the ranks, measured in the probe child after its steps (under torchrun, two ranks or more).

What is measured, over the run's own process group (gloo on CPU ranks, NCCL on CUDA):

- an **all-reduce** of :func:`link_bytes` bytes over every rank, and an **all-gather** whose output is that size;
- a **one-way send** of the same size between each ordered pair of *members*: the first rank of each node when the
  run has several nodes (the links between nodes), else every rank (the links between devices). Above
  :data:`MAX_ALL_PAIRS` members only each member's ring neighbours are measured, both ways.

Each collective is one untimed warm-up operation, then :func:`iterations` operations each timed on its own after a
barrier; its time is the slowest rank's median of them (a collective is done when every rank has its result). The
median, not nccl-tests' mean: one stall of a busy host must not decide the number.

The sends go round by round: one untimed round over every pair, then :func:`iterations` rounds, each sending once
over every pair in turn after a barrier. Interleaved so, every link is timed across the same stretch of time: a busy
host slows every link's operations in that stretch alike. (Timed pair after pair, a 2-core CI machine running two
nodes measured one even link 2.5 x below the other, the median of 7 included: the whole of one direction's 20 ms fell
in a busy stretch.) Each pair keeps its slowest rank's median (``seconds``: what the link carries, which the criteria
judge) and its slowest rank's fastest operation (``best_seconds``: what the link can carry; a busy host only slows
an operation, a slow link slows every one, so this is what names a link slow).

Bandwidths are nccl-tests' (core/criteria.py ``busbw_gbps``), in GB/s (10^9 bytes per second): ``algbw = S / t``;
all-reduce ``busbw = algbw x 2(n-1)/n``; all-gather ``busbw = algbw x (n-1)/n`` with S the whole output (n x each
rank's part); a send between two ranks ``busbw = algbw``.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from core.criteria import algbw_gbps, busbw_gbps
from core.protocol.events import EventWriter, LinkCheck

#: the message on CUDA: 64 MiB, where NVLink's and InfiniBand's bus bandwidth is near its plateau in nccl-tests'
#: published runs; on CPU ranks (gloo over TCP) 4 MiB keeps the check within seconds over a slow link
CUDA_LINK_BYTES = 64 * 2**20
CPU_LINK_BYTES = 4 * 2**20
#: members up to which every ordered pair is measured (16 x 15 = 240 sends); above, ring neighbours only
MAX_ALL_PAIRS = 16


def link_bytes(cuda: bool) -> int:
    """S, the bytes of each measured operation (all-gather: its whole output)."""
    return CUDA_LINK_BYTES if cuda else CPU_LINK_BYTES


def iterations(cuda: bool) -> int:
    """Timed operations per measurement, after one warm-up."""
    return 5 if cuda else 7


def pairs_of(count: int) -> list[tuple[int, int]]:
    """The ordered pairs of ``count`` members measured: every one up to :data:`MAX_ALL_PAIRS` members, else each
    member to its ring neighbours (i -> i+1 and i -> i-1)."""
    if count <= MAX_ALL_PAIRS:
        return [(a, b) for a in range(count) for b in range(count) if a != b]
    return sorted({(a, (a + step) % count) for a in range(count) for step in (1, -1)})


def measure_links(events: EventWriter, device: str) -> None:
    """Measure the links (the module's docstring) on every rank and write one :class:`LinkCheck` from rank 0;
    nothing when the process group is not up or has one rank. Every rank must call it (collectives)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    cuda = dist.get_backend() == "nccl"
    on = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    places: list[Any] = [None] * world
    dist.all_gather_object(places, (int(os.environ.get("GROUP_RANK", 0)), socket.gethostname(), device))
    nodes = sorted({p[0] for p in places})
    if len(nodes) > 1:
        members = [min(r for r, p in enumerate(places) if p[0] == n) for n in nodes]
        names = [f"node {n} ({places[r][1]})" for n, r in zip(nodes, members)]
    else:
        members = list(range(world))
        names = [f"rank {r} ({p[2]})" for r, p in enumerate(places)]
    size, count = link_bytes(cuda), iterations(cuda)
    elements = size // 4  # float32
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)

    data = torch.ones(elements, dtype=torch.float32, device=on)
    reduce_s = _slowest(_timed(partial(dist.all_reduce, data), sync, count), on)
    part = torch.ones(elements // world, dtype=torch.float32, device=on)
    parts = [torch.empty_like(part) for _ in range(world)]
    gather_s = _slowest(_timed(partial(dist.all_gather, parts, part), sync, count), on)
    gathered = part.numel() * 4 * world  # S of the all-gather: its whole output
    del parts, part
    order = pairs_of(len(members))
    sends = _sends(data, [(members[a], members[b]) for a, b in order], sync, count, on)
    if rank != 0:
        return
    collectives = [{"op": "all_reduce", "ranks": world, "bytes": size, "seconds": reduce_s,
                    "algbw_gbps": algbw_gbps(size, reduce_s),
                    "busbw_gbps": busbw_gbps("all_reduce", world, size, reduce_s)},
                   {"op": "all_gather", "ranks": world, "bytes": gathered, "seconds": gather_s,
                    "algbw_gbps": algbw_gbps(gathered, gather_s),
                    "busbw_gbps": busbw_gbps("all_gather", world, gathered, gather_s)}]
    events.write(LinkCheck(
        backend=str(dist.get_backend()), bytes=size, iterations=count, members="node" if len(nodes) > 1 else "rank",
        names=names, collectives=collectives,
        pairs=[{"from": a, "to": b, **p, "busbw_gbps": busbw_gbps("send", 2, size, p["seconds"]),
                "best_busbw_gbps": busbw_gbps("send", 2, size, p["best_seconds"])} for (a, b), p in zip(order, sends)]))


def _timed(op: Callable[[], Any], sync: Callable[[], None], count: int) -> float:
    """One warm-up ``op``, then the median seconds of ``count`` more, each timed on its own after a barrier over
    every rank."""
    import torch.distributed as dist

    op()
    sync()
    times = []
    for _ in range(count):
        dist.barrier()
        start = time.perf_counter()
        op()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sends(data: Any, ranks: list[tuple[int, int]], sync: Callable[[], None], count: int, on: Any
           ) -> list[dict[str, float]]:
    """Per (sender, receiver) in ``ranks``: ``seconds``, the slowest of the two ranks' median, and ``best_seconds``,
    the slowest of their fastest, over ``count`` interleaved rounds after one untimed round (the module's docstring).
    Every rank must call it: each send is preceded by a barrier over every rank."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    times: list[list[float]] = [[] for _ in ranks]
    for round_ in range(count + 1):
        for i, (src, dst) in enumerate(ranks):
            dist.barrier()
            if rank not in (src, dst):
                continue
            start = time.perf_counter()
            if rank == src:
                dist.send(data, dst)
            else:
                dist.recv(data, src)
            sync()
            if round_:
                times[i].append(time.perf_counter() - start)
    mine = [(statistics.median(t), min(t)) if t else (0.0, 0.0) for t in times]
    slowest = torch.tensor([s for pair in mine for s in pair], dtype=torch.float64, device=on)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    values = slowest.tolist()
    return [{"seconds": values[2 * i], "best_seconds": values[2 * i + 1]} for i in range(len(ranks))]


def _slowest(seconds: float, on: Any) -> float:
    """The largest of every rank's ``seconds`` (all-reduce MAX): a rank not taking part gives 0."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
