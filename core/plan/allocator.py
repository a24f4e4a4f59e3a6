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

from core.allocconf import (
    DEFAULT_CONF,
    LARGE_BUFFER,
    MIN_BLOCK,
    MIN_LARGE_ALLOC,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_SIZE,
    AllocConf,
)


# ------------------------------------------------------------------------------------------- the sizing rules
def round_size(size: int, conf: AllocConf = DEFAULT_CONF) -> int:
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

    def __init__(self, conf: AllocConf = DEFAULT_CONF, capacity: int | None = None) -> None:
        self.conf, self.capacity = conf, capacity
        self.small, self.large = Pool(True), Pool(False)
        self.allocated = self.reserved = self.requested = 0
        #: per pool (True: small): reserved and allocated bytes, segments
        self.pool_reserved = {True: 0, False: 0}
        self.pool_allocated = {True: 0, False: 0}
        self.pool_segments = {True: 0, False: 0}
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
        self.pool_allocated[block.small] += block.size
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
        self._reserve(alloc, pool.small)
        self.segments += 1
        self.pool_segments[pool.small] += 1
        return block

    def _limit(self) -> int | None:
        return self.allowed if self.allowed is not None else self.capacity

    def _fits(self, alloc: int) -> bool:
        limit = self._limit()
        return limit is None or self.reserved + alloc <= limit

    def _reserve(self, nbytes: int, small: bool) -> None:
        self.reserved += nbytes
        self.pool_reserved[small] += nbytes
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
            self.pool_segments[pool.small] += 1
        tail = pool.tail
        before = tail.prev if tail.prev is not None and not tail.prev.allocated else None
        have = before.size if before is not None else 0
        grow = page * -(-(size - have) // page)
        limit = self._limit()
        if limit is not None and self.reserved + grow > limit:
            raise OutOfMemory(f"{size} B requested with {self.reserved} B reserved (expandable segments)")
        self._reserve(grow, pool.small)
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
        self.pool_allocated[block.small] -= block.size
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
        self.pool_reserved[block.small] -= block.size
        self.segments -= 1
        self.pool_segments[block.small] -= 1
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
class PoolState:
    """The allocator at one moment, per pool (bytes): what each pool reserved, what its blocks held, in how many
    segments, and what the live tensors asked for (``allocated - requested``: rounding and unsplit remainders)."""

    small_reserved: int
    small_allocated: int
    small_segments: int
    large_reserved: int
    large_allocated: int
    large_segments: int
    requested: int

    @classmethod
    def of(cls, a: CachingAllocator) -> PoolState:
        return cls(a.pool_reserved[True], a.pool_allocated[True], a.pool_segments[True], a.pool_reserved[False],
                   a.pool_allocated[False], a.pool_segments[False], a.requested)

    def slack_lines(self, expandable: bool = False) -> list[tuple[str, int]]:
        """Why reserved exceeds what tensors asked for, line by line (bytes): each pool's cached free blocks (split
        remainders and freed blocks kept for reuse), then the rounding inside the allocated blocks."""
        small_unit = "2 MiB pages" if expandable else "2 MiB segments"
        out = [(f"small pool (tensors <= 1 MiB): {self.small_segments} segment(s) in {small_unit}, free blocks cached",
                self.small_reserved - self.small_allocated),
               (f"large pool: {self.large_segments} segment(s)"
                + (" in 20 MiB pages" if expandable else " (20 MiB below 10 MiB requests, else rounded to 2 MiB)")
                + ", free blocks cached", self.large_reserved - self.large_allocated),
               ("rounding inside allocated blocks (512 B multiples; large blocks handed out whole when <= 1 MiB "
                "would remain)", self.small_allocated + self.large_allocated - self.requested)]
        return out


@dataclass(frozen=True)
class Window:
    """The allocator over one stretch of a replay (a step, between two marks).

    Attributes:
        name: the mark that ended it (``"step 1"``).
        peak_allocated: bytes allocated at most in it (whole blocks: ``max_memory_allocated`` after a reset).
        peak_reserved: bytes reserved at most in it.
        slack_at_peak: reserved that no block held at the fullest moment of its reserved peak (bytes).
        peak_requested: bytes the live tensors asked for at most in it (their sizes as requested).
    """

    name: str
    peak_allocated: int
    peak_reserved: int
    slack_at_peak: int
    peak_requested: int
    at_peak: PoolState | None = None

    @property
    def fragmentation(self) -> float:
        """The share of the peak reserved that no block held then."""
        return self.slack_at_peak / self.peak_reserved if self.peak_reserved else 0.0


@dataclass(frozen=True)
class Replay:
    """What a sequence of allocations and frees did to the allocator: the whole replay's peaks, and each window's.

    Attributes:
        peak_allocated / peak_reserved / peak_requested / slack_at_peak: as :class:`Window`, over the whole replay.
        reserved_at_peak_allocated: what was reserved when allocated peaked.
        segments: ``cudaMalloc`` segments (or expandable segments) alive at the end.
        retries: pool misses that needed the OOM path.
        windows: one per ``("mark", name, 0)`` event, in order.
    """

    peak_allocated: int
    peak_reserved: int
    peak_requested: int
    reserved_at_peak_allocated: int
    slack_at_peak: int
    segments: int
    retries: int
    windows: tuple[Window, ...] = ()

    @property
    def fragmentation(self) -> float:
        """The share of the peak reserved that no block held at that moment."""
        return self.slack_at_peak / self.peak_reserved if self.peak_reserved else 0.0


class _Peaks:
    """Peaks over a stretch of a replay (the fullest moment at the reserved peak: the least slack there)."""

    def __init__(self, a: CachingAllocator) -> None:
        self.allocated, self.reserved, self.requested = a.allocated, a.reserved, a.requested
        self.slack = a.reserved - a.allocated
        self.state = PoolState.of(a)

    def after_malloc(self, a: CachingAllocator) -> None:
        self.allocated = max(self.allocated, a.allocated)
        self.requested = max(self.requested, a.requested)
        unused = a.reserved - a.allocated
        if a.reserved > self.reserved or (a.reserved == self.reserved and unused < self.slack):
            self.reserved, self.slack, self.state = a.reserved, unused, PoolState.of(a)


def replay(events: Iterable[tuple[str, int | str, int]], conf: AllocConf = DEFAULT_CONF, capacity: int | None = None,
           allocator: CachingAllocator | None = None) -> Replay:
    """Replay ``events`` in order: ``("alloc", key, nbytes)``, ``("free", key, 0)`` (a key names one allocation) and
    ``("mark", name, 0)``, which ends a window (a step) and starts the next.

    Raises:
        OutOfMemory: the sequence does not fit ``capacity`` under the allocator's rules.
        KeyError: a free of a key that is not allocated."""
    a = allocator if allocator is not None else CachingAllocator(conf, capacity)
    handles: dict[int | str, int] = {}
    whole, window = _Peaks(a), _Peaks(a)
    windows: list[Window] = []
    empty: set[int | str] = set()
    for kind, key, nbytes in events:
        if kind == "alloc":
            if nbytes == 0:  # NativeCachingAllocator::allocate skips size 0 (.cpp:4133-4135)
                empty.add(key)
                continue
            handles[key] = a.malloc(nbytes)
            whole.after_malloc(a)
            window.after_malloc(a)
        elif kind == "free":
            if key in empty:
                empty.discard(key)
            else:
                a.free(handles.pop(key))
        else:
            windows.append(Window(str(key), window.allocated, window.reserved, window.slack, window.requested,
                                  window.state))
            window = _Peaks(a)
    return Replay(a.peak_allocated, a.peak_reserved, whole.requested, a.reserved_at_peak_allocated, whole.slack,
                  a.segments, a.retries, tuple(windows))
