"""Constants and options of PyTorch's CUDA caching allocator, as the simulator needs them.

Constants and parsing follow `c10/core/AllocatorConfig.{h,cpp}` (where they moved from the top
of `c10/cuda/CUDACachingAllocator.cpp`); names in comments are the C++ ones.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridmem.errors import SpecError

MiB = 1 << 20
# Constants of c10/core/AllocatorConfig.h (older releases: the top of CUDACachingAllocator.cpp).
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1 * MiB  # kSmallSize: largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2 * MiB  # kSmallBuffer: "small" allocations are packed in 2 MiB blocks
K_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: 1-10 MiB allocations may use kLargeBuffer
K_ROUND_LARGE = 2 * MiB  # kRoundLarge: round up large allocations to 2 MiB
K_LARGE_BUFFER = 20 * MiB  # kLargeBuffer: "large" allocations may be packed in 20 MiB blocks
# AllocatorConfig.cpp: roundup_power2_divisions has 16 intervals, from 1 MiB (2^20) to 64 GiB.
ROUNDUP_INTERVALS = 16
ROUNDUP_START_LOG2 = 20
# AllocatorConfig.cpp parseMaxSplitSize / parseMaxNonSplitRoundingSize: must be >= kLargeBuffer/kMB.
MIN_SPLIT_MB = K_LARGE_BUFFER // MiB
# Keys that PYTORCH_CUDA_ALLOC_CONF accepts but that change nothing about device memory sizes.
IGNORED_KEYS = frozenset({
    "release_lock_on_cudamalloc", "release_lock_on_device_malloc", "pinned_use_cuda_host_register",
    "pinned_use_device_host_register", "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb", "pinned_free_catch_all", "graph_capture_record_stream_reuse",
})
MODELLED_KEYS = ("max_split_size_mb", "max_non_split_rounding_mb", "large_segment_size_mb",
                 "roundup_power2_divisions", "expandable_segments", "garbage_collection_threshold",
                 "backend")


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def division_table(value: int | dict | None) -> tuple[int, ...]:
    """Divisions per power-of-2 interval, as `parseRoundUpPower2Divisions` fills them.

    An int applies to every interval; a dict maps interval starts in MiB (powers of 2) or ">"
    (everything above the last one) to divisions. Bad values raise `SpecError`.
    """
    field = "roundup_power2_divisions"
    table = [0] * ROUNDUP_INTERVALS
    if value is None:
        return tuple(table)
    if isinstance(value, bool) or not isinstance(value, (int, dict)):
        raise SpecError(field, value, reason="must be a power of 2 or a {MiB: divisions} mapping")
    if isinstance(value, int):
        if not _is_pow2(value):
            raise SpecError(field, value, reason="the divisions have to be a power of 2")
        return (value,) * ROUNDUP_INTERVALS
    first, last = True, 0
    for key, divs in value.items():
        if isinstance(divs, bool) or not isinstance(divs, int) or not (divs == 0 or _is_pow2(divs)):
            raise SpecError(field, value, reason=f"divisions {divs!r} must be 0 or a power of 2")
        if key == ">":
            table[last + 1:] = [divs] * (ROUNDUP_INTERVALS - last - 1)
            continue
        if isinstance(key, bool) or not isinstance(key, int) or not _is_pow2(key):
            raise SpecError(field, value,
                            reason=f"interval {key!r} must be a power of 2 (MiB) or '>'")
        index = min(key.bit_length() - 1, ROUNDUP_INTERVALS - 1)
        if first:
            table[:index] = [divs] * index
            first = False
        table[index] = divs
        last = index
    return tuple(table)


# Environment variables PyTorch reads its allocator options from, in its order: the newer
# PYTORCH_ALLOC_CONF first, else PYTORCH_CUDA_ALLOC_CONF (`AcceleratorAllocatorConfig::instance`).
ALLOC_CONF_VARS: tuple[str, ...] = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def alloc_conf_string(environ: Mapping[str, str] | None = None) -> str:
    """The raw allocator option string this process's PyTorch would use ("" = defaults)."""
    env = os.environ if environ is None else environ
    return next((env[name] for name in ALLOC_CONF_VARS if name in env), "")


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocatorConfig:
    """The allocator options that change memory (PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF)."""

    max_split_size_mb: float | None = None
    """Blocks this large or larger are never split (None: unlimited, PyTorch's default)."""
    roundup_power2_divisions: int | dict | None = None
    """Round requests up to one of N divisions between powers of 2 (int, or {MiB: N, '>': N})."""
    expandable_segments: bool = False
    """One growing segment per stream and pool, mapped in 2 MiB / 20 MiB pages."""
    garbage_collection_threshold: float | None = None
    """Only active under a memory fraction; modelled when the simulator is given a `capacity`."""
    max_non_split_rounding_mb: float | None = None
    """An oversize block serves requests up to this much smaller (None: kLargeBuffer, 20 MiB)."""
    large_segment_size_mb: float | None = None
    """Segment for 1-10 MiB requests and large expandable page (newer PyTorch; None: 20 MiB)."""

    def __post_init__(self) -> None:
        for name in ("max_split_size_mb", "max_non_split_rounding_mb"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or value < MIN_SPLIT_MB):
                raise SpecError(name, value, reason=f"must be a number >= {MIN_SPLIT_MB} (MiB)")
        lss = self.large_segment_size_mb
        if lss is not None and (isinstance(lss, bool) or not isinstance(lss, (int, float))
                                or lss * MiB % K_ROUND_LARGE or lss <= 0):
            raise SpecError("large_segment_size_mb", lss, reason="must be a positive multiple of 2")
        gct = self.garbage_collection_threshold
        if gct is not None and (isinstance(gct, bool) or not isinstance(gct, (int, float))
                                or not 0.0 < gct < 1.0):
            raise SpecError("garbage_collection_threshold", gct, reason="must be in (0.0, 1.0)")
        if not isinstance(self.expandable_segments, bool):
            raise SpecError("expandable_segments", self.expandable_segments, (True, False))
        division_table(self.roundup_power2_divisions)

    @classmethod
    def from_env(cls, value: str | None) -> AllocatorConfig:
        """Parse PYTORCH_CUDA_ALLOC_CONF syntax, e.g. ``"max_split_size_mb:128"``."""
        return cls(**_parse_env(value or ""))

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> AllocatorConfig:
        """The config this process's PyTorch would use (`alloc_conf_string`)."""
        return cls.from_env(alloc_conf_string(environ))

    def max_split_size(self) -> int:
        """Bytes; "unlimited" is infinity so that every comparison reads as in the source."""
        return int(self.max_split_size_mb * MiB) if self.max_split_size_mb is not None else 1 << 62

    def max_non_split_rounding_size(self) -> int:
        mb = self.max_non_split_rounding_mb
        return int(mb * MiB) if mb is not None else K_LARGE_BUFFER

    def large_segment_size(self) -> int:
        mb = self.large_segment_size_mb
        return int(mb * MiB) if mb is not None else K_LARGE_BUFFER


def _tokens(env: str) -> list[str]:
    """`ConfigTokenizer`: split on , : [ ] (kept as tokens), drop whitespace."""
    out, buf = [], ""
    for ch in env:
        if ch in ",:[]":
            if buf:
                out.append(buf)
                buf = ""
            out.append(ch)
        elif not ch.isspace():
            buf += ch
    if buf:
        out.append(buf)
    return out


def _parse_env(env: str) -> dict[str, Any]:
    """Key/value pairs of an allocator config string, keyed by `AllocatorConfig` field names."""
    field = "PYTORCH_CUDA_ALLOC_CONF"
    toks, i, kwargs = _tokens(env), 0, {}

    def expect(j: int, tok: str) -> None:
        if j >= len(toks) or toks[j] != tok:
            raise SpecError(field, env, reason=f"expected {tok!r} at token {j}")

    def number(j: int, kind=float):
        try:
            return kind(toks[j])
        except (IndexError, ValueError):
            raise SpecError(field, env, reason=f"expected a number at token {j}") from None

    while i < len(toks):
        key = toks[i]
        expect(i + 1, ":")
        i += 2
        if key == "roundup_power2_divisions" and i < len(toks) and toks[i] == "[":
            mapping, i = {}, i + 1
            while i < len(toks) and toks[i] != "]":
                bound = toks[i] if toks[i] == ">" else number(i, int)
                expect(i + 1, ":")
                mapping[bound] = number(i + 2, int)
                i += 3
                if i < len(toks) and toks[i] == ",":
                    i += 1
            expect(i, "]")
            kwargs["roundup_power2_divisions"] = mapping
        elif key == "roundup_power2_divisions":
            kwargs[key] = number(i, int)
        elif key in ("max_split_size_mb", "max_non_split_rounding_mb", "large_segment_size_mb"):
            kwargs[key] = number(i, int)  # parsed with toSizeT in AllocatorConfig.cpp
        elif key == "garbage_collection_threshold":
            kwargs[key] = number(i)
        elif key == "expandable_segments":
            if i >= len(toks) or toks[i] not in ("True", "False"):
                raise SpecError(key, toks[i] if i < len(toks) else None, ("True", "False"))
            kwargs[key] = toks[i] == "True"
        elif key == "backend":
            if i >= len(toks) or toks[i] != "native":
                raise SpecError("backend", toks[i] if i < len(toks) else None, ("native",),
                                reason="only the native caching allocator is simulated")
        elif key in IGNORED_KEYS:
            if i < len(toks) and toks[i] == "[":
                while i < len(toks) and toks[i] != "]":
                    i += 1
        else:
            raise SpecError(field, key, sorted(MODELLED_KEYS + tuple(IGNORED_KEYS)),
                            reason="unknown allocator option")
        i += 1
        if i < len(toks):
            expect(i, ",")
            i += 1
    return kwargs

