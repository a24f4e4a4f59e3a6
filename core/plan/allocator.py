"""PyTorch's CUDA caching allocator, simulated: what a sequence of tensor allocations and frees *reserves* (issue 38).

A box runs out of memory on what the caching allocator has reserved from the driver (``cudaMalloc``'d segments,
cached when free), not on what tensors hold. This module replays an allocation/free sequence through the allocator's
rules as ``c10/cuda/CUDACachingAllocator.cpp`` defines them, and reports allocated, reserved and the fragmentation
(reserved that no tensor holds) at their peaks. Sources, pytorch/pytorch (line numbers of the ``.cpp`` at commit
b944315b93d3; the constants and the configuration's defaults at cf30153c4c13, the ``torch.version.git_version`` of the
torch 2.13.0 this project pins; docs/allocator.md says what each rule is):

- **rounding** (``round_size``, ``.cpp:2493-2505``): a request is rounded up to a multiple of 512 B
  (``kMinBlockSize``), or, where ``roundup_power2_divisions`` gives its power-of-two interval d > 1 divisions and the
  size is above 512·d, to the next 1/d of its power of two (``roundup_power2_next_division``, ``.cpp:2473-2491``; the
  interval of a size is ``log2(size) - 20`` clamped to 0..15, ``AllocatorConfig.cpp:40-56``).
- **pools** (``get_pool``, ``.cpp:2954-2977``): rounded sizes up to 1 MiB (``kSmallSize``) go to the small pool, the rest
  to the large pool; one stream (a training step's default stream) is simulated.
- **segments** (``get_allocation_size``, ``.cpp:2997-3005``): a small request's new segment is 2 MiB (``kSmallBuffer``),
  a large one under 10 MiB (``kMinLargeAlloc``) gets 20 MiB (``kLargeBuffer``; ``large_segment_size`` in 2.13), a
  larger one its size rounded up to 2 MiB (``kRoundLarge``).
- **best fit** (``get_free_block``, ``.cpp:3007-3065``): the smallest cached free block of at least the rounded size
  (ties: the lowest address); with ``max_split_size`` set, a block of at least it is never used for a request below
  it, and a request of at least it takes a block only below size + ``max_non_split_rounding`` (20 MiB).
- **split** (``should_split``, ``.cpp:2987-2995``): the small pool (and every expandable segment) splits off a
  remainder of at least 512 B; the large pool only when the request is below ``max_split_size`` and the remainder is
  above 1 MiB, else the whole block is handed out (and counted as allocated).
- **free** (``free_block`` / ``try_merge_blocks``, ``.cpp:2843-2952``): a freed block merges with its free neighbours in
  its segment and goes back to its pool; nothing is returned to the driver except by the OOM path (all fully free
  segments, ``release_cached_blocks``, ``.cpp:3306-3349``; oversize blocks first when ``max_split_size`` is set,
  ``.cpp:3258-3304``) and garbage collection.
- **garbage collection** (``garbage_collect_cached_blocks``, ``.cpp:3076-3133``): only with a per-process memory
  fraction set (``allowed`` bytes): on a pool miss with reserved above ``threshold x allowed``, fully free
  non-expandable large blocks whose age (free-block searches since cached) is at least the mean are released, pass
  after pass, until reserved is back under the threshold.
- **expandable segments** (``.cpp:2695-2840``): one growing segment per pool; the rounded request is mapped in pages
  of 2 MiB (small pool) or 20 MiB (large pool) at the segment's end, so reserved grows by pages, not by segments.

Everything is bytes. Addresses: segments are laid out in the order they are allocated (real device addresses only
break ties between free blocks of equal size).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from core.errors import SpecError

KiB, MiB = 1024, 1024 * 1024
#: c10/core/AllocatorConfig.h@cf30153c :17-25 (kLargeBuffer: 20 MiB, ``large_segment_size`` by default, :340)
MIN_BLOCK = 512
SMALL_SIZE = 1 * MiB
SMALL_BUFFER = 2 * MiB
LARGE_BUFFER = 20 * MiB
MIN_LARGE_ALLOC = 10 * MiB
ROUND_LARGE = 2 * MiB
#: roundup_power2_divisions: 16 intervals from 1 MiB (AllocatorConfig.cpp@0ac71663 :8-11)
INTERVALS = 16
#: the keys of PYTORCH_CUDA_ALLOC_CONF this simulation reads (others are named and refused: the plan would not say
#: what they do)
KEYS = ("max_split_size_mb", "max_non_split_rounding_mb", "roundup_power2_divisions", "garbage_collection_threshold",
        "expandable_segments", "per_process_memory_fraction")


@dataclass(frozen=True)
class AllocConf:
    """The allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``; defaults: PyTorch's).

    Attributes:
        max_split_size: bytes; blocks at least this large are never split (None: unlimited, the default).
        max_non_split_rounding: bytes; how much larger than a request of at least ``max_split_size`` a reused block
            may be (default 20 MiB).
        divisions: ``roundup_power2_divisions`` per power-of-two interval from 1 MiB (16 entries; 0 or 1: off).
        gc_threshold: ``garbage_collection_threshold`` in (0, 1); 0: off.
        expandable_segments: ``expandable_segments:True``.
        memory_fraction: the per-process memory fraction (``torch.cuda.set_per_process_memory_fraction``); garbage
            collection only runs under one (``.cpp:1400-1407``). 1.0: none.
    """

    max_split_size: int | None = None
    max_non_split_rounding: int = LARGE_BUFFER
    divisions: tuple[int, ...] = (0,) * INTERVALS
    gc_threshold: float = 0.0
    expandable_segments: bool = False
    memory_fraction: float = 1.0

    @classmethod
    def parse(cls, text: str) -> AllocConf:
        """The settings of a ``PYTORCH_CUDA_ALLOC_CONF`` value (``"max_split_size_mb:128,expandable_segments:True"``;
        ``roundup_power2_divisions`` as one number or ``[256:1,512:2,>:4]``), parsed as ``AllocatorConfig.cpp`` does.

        Raises:
            SpecError: (``alloc_conf``) an unknown key, or a value PyTorch refuses (``max_split_size_mb`` below 20, a
                threshold outside (0, 1), divisions that are not powers of two)."""
        values: dict[str, object] = {}
        for key, value in _pairs(text):
            if key not in KEYS:
                raise SpecError("alloc_conf", f"{key}: not an allocator setting gpuaccept simulates ({', '.join(KEYS)})")
            if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
                mb = _number(key, value, int)
                if mb < LARGE_BUFFER // MiB:  # AllocatorConfig.cpp@0ac71663 :58-75
                    raise SpecError("alloc_conf", f"{key}:{mb}: PyTorch requires at least {LARGE_BUFFER // MiB}")
                values["max_split_size" if key == "max_split_size_mb" else "max_non_split_rounding"] = mb * MiB
            elif key == "garbage_collection_threshold":
                t = _number(key, value, float)
                if not 0.0 < t < 1.0:  # :96-107
                    raise SpecError("alloc_conf", f"{key}:{value}: give a fraction in (0, 1)")
                values["gc_threshold"] = t
            elif key == "per_process_memory_fraction":
                f = _number(key, value, float)
                if not 0.0 < f <= 1.0:
                    raise SpecError("alloc_conf", f"{key}:{value}: give a fraction in (0, 1]")
                values["memory_fraction"] = f
            elif key == "expandable_segments":
                if value not in ("True", "False"):
                    raise SpecError("alloc_conf", f"{key}:{value}: give True or False")
                values["expandable_segments"] = value == "True"
            else:
                values["divisions"] = _divisions(value)
        return cls(**values)  # type: ignore[arg-type]

    def divisions_of(self, size: int) -> int:
        """The divisions of ``size``'s power-of-two interval (AllocatorConfig.cpp@0ac71663 :40-56)."""
        log_size = size.bit_length() - 1
        index = max(log_size - 20, 0)
        return self.divisions[min(index, INTERVALS - 1)]


def _pairs(text: str) -> list[tuple[str, str]]:
    """``key:value`` pairs split on commas outside brackets."""
    out, depth, part = [], 0, ""
    for ch in text.strip() + ",":
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            if part.strip():
                key, colon, value = part.strip().partition(":")
                if not colon:
                    raise SpecError("alloc_conf", f"{part.strip()!r}: give key:value")
                out.append((key.strip(), value.strip()))
            part = ""
        else:
            part += ch
    return out


def _number(key: str, value: str, kind: type) -> float:
    try:
        return kind(value)  # type: ignore[no-any-return]
    except ValueError:
        raise SpecError("alloc_conf", f"{key}:{value}: not a number") from None


def _power_of_two_or_zero(key: str, n: int) -> int:
    if n != 0 and n & (n - 1):
        raise SpecError("alloc_conf", f"{key}: {n} is not 0 or a power of two")  # AllocatorConfig.cpp :119-121
    return n


def _divisions(value: str) -> tuple[int, ...]:
    """``roundup_power2_divisions``: one value for every interval, or ``[MB:n, ..., >:n]`` (AllocatorConfig.cpp
    :109-175: an entry's interval is log2 of its MB boundary; the first entry fills the intervals below it too; ``>``
    fills every interval after the last)."""
    key = "roundup_power2_divisions"
    if not value.startswith("["):
        return (_power_of_two_or_zero(key, int(_number(key, value, int))),) * INTERVALS
    out = [0] * INTERVALS
    last = -1
    for entry in value.strip("[]").split(","):
        bound, _, n = entry.partition(":")
        n_int = _power_of_two_or_zero(key, int(_number(key, n.strip(), int)))
        if bound.strip() == ">":
            for i in range(last + 1, INTERVALS):
                out[i] = n_int
            continue
        mb = int(_number(key, bound.strip(), int))
        if mb <= 0 or mb & (mb - 1):
            raise SpecError("alloc_conf", f"{key}: the boundary {mb} (MB) is not a power of two")
        index = min(mb.bit_length() - 1, INTERVALS - 1)
        for i in range(0 if last < 0 else index, index + 1):
            out[i] = n_int
        last = index
    return tuple(out)


# ------------------------------------------------------------------------------------------- the sizing rules
def round_size(size: int, conf: AllocConf = AllocConf()) -> int:
    """The block size a request of ``size`` bytes takes (``round_size``, ``.cpp:2493-2505``)."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    divisions = conf.divisions_of(size)
    if divisions > 1 and size > MIN_BLOCK * divisions:
        return _next_division(size, divisions)
    return MIN_BLOCK * -(-size // MIN_BLOCK)


def _next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division`` (``.cpp:2473-2491``): 1200 B in 4 divisions -> 1280 B."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    low = size & ~(step - 1)
    return size if low == size else low + step


def segment_size(rounded: int) -> int:
    """The ``cudaMalloc`` a pool miss of ``rounded`` bytes makes (``get_allocation_size``, ``.cpp:2997-3005``)."""
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-rounded // ROUND_LARGE)


# ------------------------------------------------------------------------------------------- the simulation
@dataclass(eq=False)
class Block:
    """A range of a segment: ``size`` bytes at ``address``, allocated or cached free; ``mapped`` False only for an
    expandable segment's unmapped tail. ``prev`` / ``next``: its neighbours in the same segment."""

    address: int
    size: int
    small: bool
    segment: int
    allocated: bool = False
    mapped: bool = True
    expandable: bool = False
    requested: int = 0
    gc_base: int = 0
    prev: Block | None = None
    next: Block | None = None


@dataclass
class Pool:
    """A pool's cached free blocks, ordered as ``BlockComparatorSize`` orders them (size, then address)."""

    small: bool
    keys: list[tuple[int, int]] = field(default_factory=list)
    blocks: dict[tuple[int, int], Block] = field(default_factory=dict)
    searches: int = 0  # get_free_blocks_call_count (counted while garbage collection is active)
    tail: Block | None = None  # the unmapped end of this pool's expandable segment

    def insert(self, block: Block) -> None:
        key = (block.size, block.address)
        bisect.insort(self.keys, key)
        self.blocks[key] = block
        block.gc_base = self.searches

    def remove(self, block: Block) -> None:
        key = (block.size, block.address)
        self.keys.pop(bisect.bisect_left(self.keys, key))
        del self.blocks[key]


class OutOfMemory(Exception):
    """The replay needed more than the device's memory even after releasing every cached segment."""


class CachingAllocator:
    """The allocator of one device and one stream.

    Args:
        conf: its settings.
        capacity: the device's memory in bytes (None: unbounded): a ``cudaMalloc`` beyond it runs the OOM path, then
            raises :class:`OutOfMemory`.

    ``allocated`` / ``reserved`` / ``requested`` are ``torch.cuda.memory_stats()``'s ``allocated_bytes``,
    ``reserved_bytes`` and ``requested_bytes`` (``.cpp`` stats table: allocated counts whole blocks, requested the
    sizes asked for), with their peaks; ``segments`` counts ``cudaMalloc`` calls alive."""

    def __init__(self, conf: AllocConf = AllocConf(), capacity: int | None = None) -> None:
        self.conf, self.capacity = conf, capacity
        self.small, self.large = Pool(True), Pool(False)
        self.allocated = self.reserved = self.requested = 0
        self.peak_allocated = self.peak_reserved = 0
        self.reserved_at_peak_allocated = 0
        self.segments = 0
        self.retries = 0
        self._next_address = 0
        self._segment_ids = itertools.count()
        self._live: dict[int, Block] = {}
        self._handles = itertools.count()

    @property
    def allowed(self) -> int | None:
        """The per-process limit (``allowed_memory_maximum``): the fraction of the capacity, when one is set."""
        if self.capacity is None or self.conf.memory_fraction >= 1.0:
            return None
        return int(self.conf.memory_fraction * self.capacity)

    # --------------------------------------------------------------------------- malloc
    def malloc(self, size: int) -> int:
        """Allocate ``size`` bytes; a handle for :meth:`free`.

        Raises:
            OutOfMemory: as PyTorch's ``OutOfMemoryError`` would (the device's or the fraction's limit)."""
        rounded = round_size(size, self.conf)
        pool = self.small if rounded <= SMALL_SIZE else self.large
        block = self._free_block(pool, rounded)
        if block is None:
            self._garbage_collect(pool)
            block = self._new_block(pool, rounded)
        if self._should_split(block, rounded):
            rest = Block(block.address + rounded, block.size - rounded, block.small, block.segment,
                         mapped=True, expandable=block.expandable, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, rounded
            pool.insert(rest)
        block.allocated, block.requested = True, size
        self.allocated += block.size
        self.requested += size
        if self.allocated > self.peak_allocated:
            self.peak_allocated, self.reserved_at_peak_allocated = self.allocated, self.reserved
        handle = next(self._handles)
        self._live[handle] = block
        return handle

    def _free_block(self, pool: Pool, size: int) -> Block | None:
        """``get_free_block`` (``.cpp:3007-3065``): best fit under the max_split_size rules, or None."""
        if self.allowed is not None and self.conf.gc_threshold > 0:
            pool.searches += 1
        i = bisect.bisect_left(pool.keys, (size, -1))
        if i == len(pool.keys):
            return None
        block = pool.blocks[pool.keys[i]]
        if block.expandable and self.conf.expandable_segments:  # .cpp:3020-3036: the size it can grow to
            def grows_to(b: Block) -> int:
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

            while block.expandable and i + 1 < len(pool.keys) and \
                    grows_to(pool.blocks[pool.keys[i + 1]]) < grows_to(block):
                i += 1
                block = pool.blocks[pool.keys[i]]
        split = self.conf.max_split_size
        if split is not None:
            if size < split <= block.size:
                return None
            if size >= split and block.size >= size + self.conf.max_non_split_rounding:
                return None
        pool.remove(block)
        return block

    def _should_split(self, block: Block, size: int) -> bool:
        """``should_split`` (``.cpp:2987-2995``)."""
        remaining = block.size - size
        if block.small or self.conf.expandable_segments:
            return remaining >= MIN_BLOCK
        split = self.conf.max_split_size
        return (split is None or size < split) and remaining > SMALL_SIZE

    def _new_block(self, pool: Pool, size: int) -> Block:
        """``alloc_block`` with its OOM retries (``.cpp:1413-1421``, ``3140-3304``)."""
        if self.conf.expandable_segments:
            return self._expand(pool, size)
        alloc = segment_size(size)
        if not self._fits(alloc):
            self.retries += 1
            if not (self.conf.max_split_size is not None and self._release_oversize(size) and self._fits(alloc)):
                self.release_cached()
                if not self._fits(alloc):
                    raise OutOfMemory(f"{size} B requested with {self.reserved} B reserved, {self.allocated} B "
                                      f"allocated, of {self._limit()} B")
        block = Block(self._next_address, alloc, pool.small, next(self._segment_ids))
        self._next_address += alloc
        self._reserve(alloc)
        self.segments += 1
        return block

    def _limit(self) -> int | None:
        return self.allowed if self.allowed is not None else self.capacity

    def _fits(self, alloc: int) -> bool:
        limit = self._limit()
        return limit is None or self.reserved + alloc <= limit

    def _reserve(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _expand(self, pool: Pool, size: int) -> Block:
        """An expandable segment's block: the free mapped block before the unmapped tail (if any) grown by whole pages
        until it holds ``size`` (``find_expandable_block`` / ``map_block``, ``.cpp:2695-2840``; pages 2 MiB in the small
        pool, 20 MiB in the large, ``.cpp:2728``)."""
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        if pool.tail is None:
            pool.tail = Block(self._next_address, 1 << 62, pool.small, next(self._segment_ids), mapped=False,
                              expandable=True)
            self._next_address += 1 << 40
            self.segments += 1
        tail = pool.tail
        before = tail.prev if tail.prev is not None and not tail.prev.allocated else None
        have = before.size if before is not None else 0
        grow = page * -(-(size - have) // page)
        limit = self._limit()
        if limit is not None and self.reserved + grow > limit:
            raise OutOfMemory(f"{size} B requested with {self.reserved} B reserved (expandable segments)")
        self._reserve(grow)
        if before is not None:
            pool.remove(before)
            before.size += grow
            block = before
        else:
            block = Block(tail.address, grow, pool.small, tail.segment, expandable=True, prev=tail.prev, next=tail)
            if tail.prev is not None:
                tail.prev.next = block
            tail.prev = block
        tail.address += grow
        tail.size -= grow
        return block

    # --------------------------------------------------------------------------- free
    def free(self, handle: int) -> None:
        """Free the block of ``handle``: back to its pool, merged with its free neighbours (``free_block``)."""
        block = self._live.pop(handle)
        self.allocated -= block.size
        self.requested -= block.requested
        block.allocated = False
        pool = self.small if block.small else self.large
        for other in (block.prev, block.next):
            if other is not None and not other.allocated and other.mapped == block.mapped and other is not pool.tail:
                pool.remove(other)
                self._merge(block, other)
        pool.insert(block)

    @staticmethod
    def _merge(dst: Block, src: Block) -> None:
        """``try_merge_blocks`` (``.cpp:2921-2952``): ``src`` (a neighbour) folded into ``dst``."""
        if src is dst.prev:
            dst.address, dst.prev = src.address, src.prev
            if src.prev is not None:
                src.prev.next = dst
        else:
            dst.next = src.next
            if src.next is not None:
                src.next.prev = dst
        dst.size += src.size

    # --------------------------------------------------------------------------- releasing cached memory
    def release_cached(self) -> int:
        """``release_cached_blocks`` (``empty_cache``, the last OOM retry): every fully free non-expandable segment
        goes back to the driver; the bytes released."""
        freed = 0
        for pool in (self.large, self.small):
            for key in list(pool.keys):
                block = pool.blocks[key]
                if block.prev is None and block.next is None and not block.expandable:
                    freed += self._release(pool, block)
        return freed

    def _release(self, pool: Pool, block: Block) -> int:
        pool.remove(block)
        self.reserved -= block.size
        self.segments -= 1
        return block.size

    def _release_oversize(self, size: int) -> bool:
        """``release_available_cached_blocks`` (``.cpp:3258-3304``): one whole free block of at least max(size,
        max_split_size), else oversize blocks from the largest down until that many bytes are freed."""
        assert self.conf.max_split_size is not None
        want = max(size, self.conf.max_split_size)
        pool = self.large
        whole = [pool.blocks[k] for k in pool.keys if k[0] >= want]
        whole = [b for b in whole if b.prev is None and b.next is None and not b.expandable]
        if whole:
            self._release(pool, whole[0])
            return True
        freed = 0
        for key in reversed(list(pool.keys)):
            block = pool.blocks[key]
            if block.size < self.conf.max_split_size or freed >= want:
                break
            if block.prev is None and block.next is None and not block.expandable:
                freed += self._release(pool, block)
        return freed >= want

    def _garbage_collect(self, pool: Pool) -> None:
        """``garbage_collect_cached_blocks`` (``.cpp:3076-3133``): under a memory fraction, with reserved above the
        threshold, release fully free large blocks at least as old as the mean, pass after pass, until under it."""
        allowed = self.allowed
        if allowed is None or self.conf.gc_threshold <= 0:
            return
        limit = self.conf.gc_threshold * allowed
        if self.reserved <= limit:
            return
        target, reclaimed = self.reserved - limit, 0
        large = self.large

        def freeable() -> list[Block]:
            return [large.blocks[k] for k in large.keys
                    if large.blocks[k].prev is None and large.blocks[k].next is None
                    and not large.blocks[k].expandable]

        while reclaimed < target:
            candidates = freeable()
            if not candidates:
                return
            ages = [large.searches - b.gc_base for b in candidates]
            mean = sum(ages) / len(ages)
            released = [b for b, age in zip(candidates, ages) if age >= mean]
            if not released:
                return
            for block in released:
                reclaimed += self._release(large, block)


# ------------------------------------------------------------------------------------------- a replay
@dataclass(frozen=True)
class Replay:
    """What a sequence of allocations and frees did to the allocator.

    Attributes:
        peak_allocated: bytes (``max_memory_allocated``: whole blocks, rounding and unsplit remainders included).
        peak_reserved: bytes (``max_memory_reserved``).
        peak_requested: bytes the tensors asked for at the most (their sizes as requested).
        reserved_at_peak_allocated: what was reserved when allocated peaked.
        slack_at_peak: ``peak_reserved`` minus the allocated bytes at that moment: cached, unused, reserved.
        segments: ``cudaMalloc`` segments (or expandable segments) alive at the end.
        retries: pool misses that needed the OOM path (``num_alloc_retries``-like).
    """

    peak_allocated: int
    peak_reserved: int
    peak_requested: int
    reserved_at_peak_allocated: int
    slack_at_peak: int
    segments: int
    retries: int

    @property
    def fragmentation(self) -> float:
        """The share of the peak reserved that no block held at that moment."""
        return self.slack_at_peak / self.peak_reserved if self.peak_reserved else 0.0


def replay(events: Iterable[tuple[str, int, int]], conf: AllocConf = AllocConf(), capacity: int | None = None,
           allocator: CachingAllocator | None = None) -> Replay:
    """Replay ``events``: ``("alloc", key, nbytes)`` and ``("free", key, 0)`` in order (a key names one allocation).

    Raises:
        OutOfMemory: the sequence does not fit ``capacity`` under the allocator's rules.
        KeyError: a free of a key that is not allocated."""
    a = allocator if allocator is not None else CachingAllocator(conf, capacity)
    handles: dict[int, int] = {}
    peak_requested = a.requested
    slack, at_peak = a.reserved - a.allocated, a.peak_reserved
    for kind, key, nbytes in events:
        if kind == "alloc":
            if nbytes == 0:
                continue  # NativeCachingAllocator::allocate skips size 0 (.cpp:4133-4135)
            handles[key] = a.malloc(nbytes)
            peak_requested = max(peak_requested, a.requested)
            if a.reserved == a.peak_reserved:  # at the peak: the least slack while there (the fullest moment)
                unused = a.reserved - a.allocated
                slack = unused if a.peak_reserved != at_peak else min(slack, unused)
                at_peak = a.peak_reserved
        else:
            a.free(handles.pop(key))
    return Replay(a.peak_allocated, a.peak_reserved, peak_requested, a.reserved_at_peak_allocated, slack,
                  a.segments, a.retries)
