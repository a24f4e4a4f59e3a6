"""The caching allocator simulation (core/plan/allocator.py), one behaviour per case, each derived by hand from the
rule of c10/cuda/CUDACachingAllocator.cpp it cites (line numbers at pytorch/pytorch b944315b93d3; constants at
cf30153c4c13, torch 2.13.0's)."""

from __future__ import annotations

import pytest

from core.allocconf import AllocConf, MiB
from core.errors import SpecError
from core.plan.allocator import (
    CachingAllocator,
    OutOfMemory,
    replay,
    round_size,
    segment_size,
)

KiB = 1024


@pytest.mark.parametrize(("size", "conf", "want"), [
    (1, "", 512),  # below kMinBlockSize: 512 (.cpp:2494-2495)
    (513, "", 1024),  # a multiple of 512 (.cpp:2502)
    (3 * MiB + 1, "", 3 * MiB + 512),
    # 4 divisions everywhere: 3 MiB + 1 lies in [2, 4) MiB, a quarter of 2 MiB is 512 KiB: up to 3.5 MiB (.cpp:2482-2490)
    (3 * MiB + 1, "roundup_power2_divisions:4", 3 * MiB + 512 * KiB),
    (1200, "roundup_power2_divisions:4", 1536),  # 1200 <= 512 x 4: the division rule does not apply (.cpp:2499)
    (4 * MiB, "roundup_power2_divisions:4", 4 * MiB),  # a power of two is its own size (.cpp:2474-2475)
    # the list form [256:1,>:8]: 256 (MB) is interval 8, [256, 512) MiB, and those below it: 1 division (off);
    # ">" gives the intervals after it 8 (AllocatorConfig.cpp :126-153): 600 MiB -> the next 64 MiB step, 640 MiB
    (600 * MiB, "roundup_power2_divisions:[256:1,>:8]", 640 * MiB),
    (300 * MiB, "roundup_power2_divisions:[256:1,>:8]", 300 * MiB),
])
def test_a_request_is_rounded_as_round_size_does(size, conf, want):
    assert round_size(size, AllocConf.parse(conf)) == want


@pytest.mark.parametrize(("rounded", "segment"), [
    (1 * MiB, 2 * MiB),  # <= kSmallSize: the small pool's 2 MiB segment (.cpp:2998-2999)
    (1 * MiB + 512, 20 * MiB),  # above 1 MiB, below kMinLargeAlloc: 20 MiB (.cpp:3000-3001)
    (10 * MiB, 10 * MiB),  # from 10 MiB: its size rounded to 2 MiB (.cpp:3002-3003)
    (11 * MiB + 512, 12 * MiB),
])
def test_a_pool_miss_allocates_the_segment_get_allocation_size_gives(rounded, segment):
    assert segment_size(rounded) == segment


def test_exactly_1_mib_goes_to_the_small_pool_and_one_byte_more_to_the_large_pool():
    """get_pool (.cpp:2954-2977): a rounded size <= kSmallSize (1048576) is the small pool's, anything above the large
    pool's. 1 MiB is a multiple of 512 (.cpp:2502): kept, small pool, a 2 MiB segment (kSmallBuffer, .cpp:2998-2999),
    1 MiB of it left cached. 1 MiB + 1 rounds to 1 MiB + 512: large pool, a 20 MiB segment (kLargeBuffer,
    .cpp:3000-3001) at address 2 MiB, split (more than 1 MiB remains)."""
    a = CachingAllocator()
    a.malloc(1 * MiB)
    assert round_size(1 * MiB) == 1 * MiB
    assert (a.pool_reserved, a.pool_allocated, a.pool_segments) == ({True: 2 * MiB, False: 0},
                                                                     {True: 1 * MiB, False: 0}, {True: 1, False: 0})
    assert a.small.keys == [(1 * MiB, 1 * MiB)] and a.large.keys == []
    a.malloc(1 * MiB + 1)
    assert round_size(1 * MiB + 1) == 1 * MiB + 512
    assert (a.pool_reserved, a.pool_allocated, a.pool_segments) == ({True: 2 * MiB, False: 20 * MiB},
                                                                     {True: 1 * MiB, False: 1 * MiB + 512},
                                                                     {True: 1, False: 1})
    assert a.large.keys == [(19 * MiB - 512, 3 * MiB + 512)]
    assert (a.reserved, a.segments, a.requested) == (22 * MiB, 2, 2 * MiB + 1)


def test_small_requests_share_a_2_mib_segment_split_down_to_512_bytes():
    """Two 600 KiB tensors: the first makes a 2 MiB small segment and is split off it (a remainder >= 512 B,
    .cpp:2989-2990); the second is the best fit in that remainder: one segment, 2 MiB reserved."""
    a = CachingAllocator()
    a.malloc(600 * KiB)
    a.malloc(600 * KiB)
    assert (a.reserved, a.allocated, a.segments) == (2 * MiB, 1200 * KiB, 1)


def test_a_large_block_is_not_split_for_a_remainder_of_1_mib_or_less_and_counts_whole():
    """A 10 MiB segment freed, then 9.5 MiB asked: the remainder 0.5 MiB is not above kSmallSize, so the block is
    handed out whole (.cpp:2992) and allocated counts 10 MiB, requested 9.5 MiB."""
    a = CachingAllocator()
    a.free(a.malloc(10 * MiB))
    a.malloc(9 * MiB + 512 * KiB)
    assert (a.reserved, a.allocated, a.requested) == (10 * MiB, 10 * MiB, 9 * MiB + 512 * KiB)


def test_a_large_block_splits_when_more_than_1_mib_remains_and_a_freed_neighbour_merges_back():
    """5 MiB then 4 MiB come out of one 20 MiB segment (remainders 15 and 11 MiB > 1 MiB: split); freeing both merges
    the segment whole again (.cpp:2867-2874), so a 19 MiB request fits in it: still one segment, handed out whole
    (1 MiB left is not above kSmallSize)."""
    a = CachingAllocator()
    x, y = a.malloc(5 * MiB), a.malloc(4 * MiB)
    assert (a.reserved, a.segments) == (20 * MiB, 1)
    a.free(x)
    a.free(y)
    assert a.large.keys == [(20 * MiB, 0)]
    a.malloc(19 * MiB)
    assert (a.reserved, a.segments, a.allocated) == (20 * MiB, 1, 20 * MiB)


def test_a_cached_block_is_reused_across_sizes_by_best_fit():
    """8 MiB splits a 20 MiB segment (12 MiB left, cached); 12 MiB would reuse that, but 14 MiB needs its own 14 MiB
    segment. Both freed (the first merges whole: 20 MiB), 4 MiB takes the smallest block that fits, the 14 MiB one
    (.cpp:3016, lower_bound on size): nothing new is reserved, 10 MiB of it left cached."""
    a = CachingAllocator()
    x, y = a.malloc(8 * MiB), a.malloc(14 * MiB)
    a.free(x)
    a.free(y)
    a.malloc(4 * MiB)
    assert (a.reserved, a.segments) == (34 * MiB, 2)
    assert a.large.keys == [(10 * MiB, 24 * MiB), (20 * MiB, 0)]  # the 14 MiB segment at 20 MiB: 4 used, 10 left


def test_max_split_size_keeps_oversize_blocks_whole_and_unused_for_small_requests():
    """max_split_size_mb:20: a free 30 MiB block is never used for a 4 MiB request (.cpp:3054-3056): a new 20 MiB
    segment; a 30 MiB request may take a 40 MiB block (below 30 + 20 MiB, .cpp:3058-3061) but not a 60 MiB one."""
    conf = AllocConf.parse("max_split_size_mb:20")
    a = CachingAllocator(conf)
    a.free(a.malloc(30 * MiB))
    a.malloc(4 * MiB)
    assert (a.reserved, a.segments) == (50 * MiB, 2)
    b = CachingAllocator(conf)
    b.free(b.malloc(40 * MiB))
    b.malloc(30 * MiB)
    assert (b.reserved, b.allocated) == (40 * MiB, 40 * MiB)  # oversize: never split, counted whole
    c = CachingAllocator(conf)
    c.free(c.malloc(60 * MiB))
    c.malloc(30 * MiB)
    assert c.reserved == 90 * MiB


def test_expandable_segments_grow_by_pages_and_reuse_what_fixed_segments_cannot():
    """12, 14, then 16 MiB, each freed before the next. Fixed segments: 12 MiB cached, too small for 14 (a new 14 MiB
    segment), both too small for 16: 42 MiB reserved. Expandable (.cpp:2728: 20 MiB pages in the large pool): the
    first maps one 20 MiB page, the others fit in it: 20 MiB."""
    events = [("alloc", 1, 12 * MiB), ("free", 1, 0), ("alloc", 2, 14 * MiB), ("free", 2, 0),
              ("alloc", 3, 16 * MiB)]
    fixed = replay(events)
    grown = replay(events, AllocConf.parse("expandable_segments:True"))
    assert (fixed.peak_reserved, fixed.segments) == (42 * MiB, 3)
    assert (grown.peak_reserved, grown.peak_allocated) == (20 * MiB, 16 * MiB)


def test_an_expandable_segment_maps_only_what_its_tail_lacks():
    """Two 15 MiB tensors, expandable: the first maps 20 MiB (5 MiB free at the end); the second grows that free 5 MiB
    by one more 20 MiB page (.cpp:2809-2840): 40 MiB reserved, 30 allocated, 10 MiB free mapped. Small tensors map
    2 MiB pages (.cpp:2728)."""
    a = CachingAllocator(AllocConf.parse("expandable_segments:True"))
    a.malloc(15 * MiB)
    a.malloc(15 * MiB)
    assert (a.reserved, a.allocated) == (40 * MiB, 30 * MiB)
    assert a.large.keys[0][0] == 10 * MiB
    a.malloc(600 * KiB)
    assert a.reserved == 42 * MiB


def test_garbage_collection_releases_the_oldest_cached_blocks_under_a_memory_fraction():
    """Fraction 0.6 of 100 MiB (60 MiB allowed), threshold 0.5 (30 MiB). 24 MiB freed, 26 MiB asked: reserved 24 MiB is
    under 30, no collection, a new segment (50 MiB). 26 MiB freed, 28 asked: 50 > 30, so blocks at least as old as
    the mean age are released (.cpp:3076-3133): the 24 MiB block (2 searches old) against the 26 MiB one (1): 54 MiB.
    Without collection the fraction refuses 78 MiB and the OOM retry releases every cached segment: 28 MiB."""
    events = [("alloc", 1, 24 * MiB), ("free", 1, 0), ("alloc", 2, 26 * MiB), ("free", 2, 0),
              ("alloc", 3, 28 * MiB)]
    collected = CachingAllocator(AllocConf.parse("garbage_collection_threshold:0.5,per_process_memory_fraction:0.6"),
                                 capacity=100 * MiB)
    replay(events, allocator=collected)
    assert (collected.reserved, collected.segments, collected.retries) == (54 * MiB, 2, 0)
    plain = CachingAllocator(AllocConf.parse("per_process_memory_fraction:0.6"), capacity=100 * MiB)
    replay(events, allocator=plain)
    assert (plain.reserved, plain.segments, plain.retries) == (28 * MiB, 1, 1)


def test_what_does_not_fit_after_releasing_every_cached_segment_is_out_of_memory():
    a = CachingAllocator(capacity=30 * MiB)
    a.malloc(20 * MiB)
    with pytest.raises(OutOfMemory, match="20971520 B reserved"):
        a.malloc(12 * MiB)


def test_a_replay_reports_the_peaks_and_the_slack_at_the_peak_reserved():
    """600 KiB and 3 MiB: 2 + 20 MiB reserved, 600 KiB + 3 MiB allocated: the slack at the peak is the rest."""
    got = replay([("alloc", 1, 600 * KiB), ("alloc", 2, 3 * MiB), ("free", 1, 0)])
    assert (got.peak_reserved, got.peak_allocated) == (22 * MiB, 600 * KiB + 3 * MiB)
    assert got.slack_at_peak == 22 * MiB - (600 * KiB + 3 * MiB)
    assert got.fragmentation == pytest.approx(got.slack_at_peak / (22 * MiB))
    marked = replay([("alloc", 1, 600 * KiB), ("alloc", 2, 3 * MiB + 100), ("mark", "step 1", 0), ("free", 1, 0)])
    (window,) = marked.windows
    lines = dict((text.split(":")[0], n) for text, n in window.at_peak.slack_lines())
    assert lines == {"small pool (tensors <= 1 MiB)": 2 * MiB - 600 * KiB, "large pool": 20 * MiB - (3 * MiB + 512),
                     "rounding inside allocated blocks (512 B multiples; large blocks handed out whole when <= 1 MiB "
                     "would remain)": 512 - 100}
    assert sum(lines.values()) == window.peak_reserved - (600 * KiB + 3 * MiB + 100)  # reserved - requested, explained


@pytest.mark.parametrize(("text", "says"), [
    ("max_split_size_mb:10", "at least 20"),
    ("garbage_collection_threshold:1.5", "fraction in (0, 1)"),
    ("roundup_power2_divisions:3", "not 0 or a power of two"),
    ("backend:cudaMallocAsync", "not an allocator setting gpuaccept simulates"),
    ("expandable_segments:yes", "True or False"),
])
def test_an_alloc_conf_pytorch_refuses_is_refused_by_name(text, says):
    with pytest.raises(SpecError, match=says.replace("(", r"\(").replace(")", r"\)")):
        AllocConf.parse(text)


def test_the_spec_names_a_bad_alloc_conf_and_its_children_run_under_a_good_one():
    from core.spec import RunSpec
    from core.stages.childproc import launch_options

    with pytest.raises(SpecError) as err:
        RunSpec.build(alloc_conf="max_split_size_mb:10")
    assert err.value.field == "alloc_conf" and "at least 20" in str(err.value)
    spec = RunSpec.build(alloc_conf="expandable_segments:True")
    assert launch_options(spec, ["cuda:0"]).alloc_conf == "expandable_segments:True"


@pytest.mark.parametrize(("label", "training", "torch", "environ", "blocks"), [
    # CublasHandlePool.cpp :147-150: 32 MiB on compute capability 9.0; two threads in training (forward, autograd)
    ("NVIDIA H200", True, "2.13.0+cu130", {}, [32 * MiB, 32 * MiB]),
    # up to 2.11, cuBLASLt's own 1 MiB block per thread as well (:186, :283)
    ("NVIDIA H100 80GB HBM3", False, "2.11.0", {}, [32 * MiB, 1 * MiB]),
    # Blackwell: 32 MiB from torch 2.12, 8.125 MiB (2 x 4 MiB + 8 x 16 KiB) before
    ("NVIDIA B200", False, "2.13.0", {}, [32 * MiB]),
    ("NVIDIA B200", False, "2.11.0", {}, [2 * 4 * MiB + 8 * 16 * KiB, 1 * MiB]),
    ("NVIDIA A100-SXM4-80GB", False, "2.13.0", {}, [2 * 4 * MiB + 8 * 16 * KiB]),
    # CUBLAS_WORKSPACE_CONFIG sums its :SIZE_KiB:COUNT pairs (:156-168)
    ("NVIDIA H200", False, "2.13.0", {"CUBLAS_WORKSPACE_CONFIG": ":4096:8:16:8"}, [32 * MiB + 128 * KiB]),
])
def test_cublas_takes_its_workspaces_as_pytorchs_handle_pool_sizes_them(label, training, torch, environ, blocks):
    from core.plan.workspace import cublas_workspaces

    assert cublas_workspaces(label, training, torch, environ)[0] == blocks


def test_cudnn_attention_backward_takes_its_float32_dq_accumulator_and_softmax_sum():
    """core/plan/workspace.py ``cudnn_attention_workspace``: on Hopper and Blackwell SDPA tries cuDNN attention first
    (sdp_utils.cpp ``check_prefer_cudnn_attention``), whose backward graph holds a float32 dQ accumulator of
    b x h_q x s_q x d and a float32 softmax sum of b x h_q x s_q (cudnn-frontend
    ``scaled_dot_product_flash_attention.h``), allocated through the caching allocator for each call (MHA.cpp)."""
    from core.plan.workspace import cudnn_attention_workspace

    # a 1.2B Llama shape, micro-batch 2 x 256 tokens, 32 heads of 64: 2 x 32 x 256 x 65 x 4 B = 4,259,840 B (4.06 MiB)
    size, how = cudnn_attention_workspace("NVIDIA H200", True, "sdpa", "bf16", 2, 32, 256, 64)
    assert size == 4_259_840 and "float32 dQ accumulator 2 x 32 heads x 256 x 64 x 4 B" in how
    assert cudnn_attention_workspace("NVIDIA B200", True, "sdpa", "fp16", 1, 8, 128, 128)[0] == 1 * 8 * 128 * 129 * 4
    # where cuDNN attention is not reached, none, with the reason
    for args, why in [(("NVIDIA A100-SXM4-80GB", True, "sdpa", "bf16"), "flash attention first"),
                      (("NVIDIA H200", True, "sdpa", "fp32"), "fp16 and bf16 only"),
                      (("NVIDIA H200", True, "eager", "bf16"), "not SDPA"),
                      (("NVIDIA H200", False, "sdpa", "bf16"), "no training step"),
                      (("planned GPU", True, "sdpa", "bf16"), "does not say its generation")]:
        size, how = cudnn_attention_workspace(*args, 2, 32, 256, 64)
        assert size == 0 and why in how, (args, how)
    size, how = cudnn_attention_workspace("NVIDIA H200", True, "sdpa", "bf16", 2, 32, 256, 64,
                                          {"TORCH_CUDNN_SDPA_DEPRIORITIZED": "1"})
    assert size == 0 and "DEPRIORITIZED" in how


def test_the_traced_replay_holds_cudnns_block_beside_cublas_on_hopper():
    from types import SimpleNamespace

    from core.plan.devices import DeviceInfo
    from core.plan.traced import workspaces_of
    from core.spec import RunSpec

    spec = RunSpec(mode="lora", dtype="bf16", batch_size=2, seq_len=256)
    config = SimpleNamespace(num_attention_heads=32, hidden_size=2048, head_dim=None)
    h200 = DeviceInfo("cuda:0", "cuda", "NVIDIA H200", 140 * 2**30, "given")
    blocks, how = workspaces_of(spec, h200, config)
    assert blocks[-1] == 2 * 32 * 256 * 65 * 4 and "cuDNN attention's backward workspace" in how
    assert workspaces_of(spec, h200)[0] == blocks[:-1]  # without the model's heads: cuBLAS's only
