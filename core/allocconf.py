"""``PYTORCH_CUDA_ALLOC_CONF`` as PyTorch parses it: the settings of its CUDA caching allocator that gpuaccept simulates
(:mod:`core.plan.allocator`), validated with the spec (``alloc_conf``). Standard library only: the spec imports it.

Sources (pytorch/pytorch): the constants and defaults of ``c10/core/AllocatorConfig.h`` at cf30153c4c13 (torch 2.13.0's
headers), the parsing of ``c10/core/AllocatorConfig.cpp`` at 0ac716637f32 (line numbers below); docs/allocator.md.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        return float(kind(value))
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

#: PyTorch's defaults (no PYTORCH_CUDA_ALLOC_CONF)
DEFAULT_CONF = AllocConf()
