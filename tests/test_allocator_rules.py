"""One test per rule of PyTorch's CUDA caching allocator, as `CachingAllocatorSim` models it.

Each test names the function of `c10/cuda/CUDACachingAllocator.cpp` (pytorch/pytorch 001074d2;
the same code sits in `c10/core/CachingDeviceAllocator.h` in newer releases) whose rule it checks.
Expected numbers are derived by hand in the comments from the constants of
`c10/core/AllocatorConfig.h`: kMinBlockSize 512 B, kSmallSize 1 MiB, kSmallBuffer 2 MiB,
kMinLargeAlloc 10 MiB, kRoundLarge 2 MiB, kLargeBuffer 20 MiB.
"""

from __future__ import annotations

import pytest

from hybridmem.allocator import (
    AllocatorConfig, CachingAllocatorSim, SimulatedOOM, get_allocation_size, round_size,
)

KiB, MiB = 1 << 10, 1 << 20


# ---- round_size ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("request_bytes", "expected"), [
    (1, 512),  # round_size: size < kMinBlockSize -> kMinBlockSize
    (512, 512),
    (513, 1024),  # else: kMinBlockSize * ceil(size / 512)
    (600 * KiB, 600 * KiB),  # 614400 is a multiple of 512
    (1000 * 1000, 1000448),  # ceil(1e6 / 512) = 1954 -> 1954 * 512
])
def test_round_size_rounds_to_512(request_bytes, expected):
    assert round_size(request_bytes) == expected
    sim = CachingAllocatorSim()
    addr = sim.malloc(request_bytes)
    assert sim.block_size(addr) == expected == sim.allocated


def test_zero_byte_request_takes_no_memory():
    # NativeCachingAllocator::allocate only calls malloc `if (size != 0)`.
    sim = CachingAllocatorSim()
    handle = sim.malloc(0)
    assert (sim.allocated, sim.reserved) == (0, 0)
    sim.free(handle)
    assert (sim.allocated, sim.reserved) == (0, 0)


# ---- get_pool / get_allocation_size -------------------------------------------------------------

@pytest.mark.parametrize(("rounded", "segment"), [
    (512, 2 * MiB),  # <= kSmallSize: kSmallBuffer
    (1 * MiB, 2 * MiB),  # exactly kSmallSize is still small
    (1 * MiB + 512, 20 * MiB),  # < kMinLargeAlloc: kLargeBuffer
    (10 * MiB - 512, 20 * MiB),
    (10 * MiB, 10 * MiB),  # >= kMinLargeAlloc: kRoundLarge multiple
    (11 * MiB, 12 * MiB),
    (1000 * MiB + 1, 1002 * MiB),
])
def test_get_allocation_size(rounded, segment):
    assert get_allocation_size(rounded) == segment


def test_small_requests_share_a_2mib_segment():
    # get_pool: <= 1 MiB -> small pool; alloc_block cudaMallocs kSmallBuffer; should_split keeps
    # the rest (>= 512 B) for the next small request: 3 x 600 KiB = 1800 KiB <= 2048 KiB.
    sim = CachingAllocatorSim()
    for _ in range(3):
        sim.malloc(600 * KiB)
        assert sim.reserved == 2 * MiB
    sim.malloc(600 * KiB)  # 248 KiB left is too little: a second 2 MiB segment
    assert sim.reserved == 4 * MiB
    assert sim.allocated == 4 * 600 * KiB


def test_small_pool_splits_down_to_512_bytes():
    # should_split: small pool splits when the remainder is >= kMinBlockSize.
    sim = CachingAllocatorSim()
    sim.malloc(1 * MiB)  # remainder 1 MiB
    sim.malloc(1 * MiB - 512)  # remainder 512 B >= 512: split
    sim.malloc(512)  # fits the last 512 B of the same segment
    assert sim.reserved == 2 * MiB
    assert sim.allocated == 2 * MiB


def test_small_and_large_pools_do_not_mix():
    # get_pool: a freed large block never serves a small request (separate BlockPools).
    sim = CachingAllocatorSim()
    sim.free(sim.malloc(5 * MiB))  # 20 MiB large segment, now free
    sim.malloc(4 * KiB)
    assert sim.reserved == 20 * MiB + 2 * MiB


def test_mid_size_request_gets_20mib_segment_and_remainder_is_reused():
    # get_allocation_size: 1-10 MiB -> kLargeBuffer (20 MiB); should_split: 15 MiB > 1 MiB left.
    sim = CachingAllocatorSim()
    sim.malloc(5 * MiB)
    assert sim.reserved == 20 * MiB
    sim.malloc(12 * MiB)  # get_free_block finds the 15 MiB remainder: no new segment
    assert sim.reserved == 20 * MiB
    assert sim.allocated == 17 * MiB


def test_large_pool_keeps_a_remainder_of_1mib_or_less_inside_the_block():
    # should_split (large pool): split only if remainder > kSmallSize.
    sim = CachingAllocatorSim()
    a = sim.malloc(11 * MiB)  # segment 12 MiB, remainder exactly 1 MiB: not split
    assert (sim.block_size(a), sim.allocated, sim.reserved) == (12 * MiB, 12 * MiB, 12 * MiB)
    sim2 = CachingAllocatorSim()
    b = sim2.malloc(11 * MiB - 512)  # segment 12 MiB, remainder 1 MiB + 512 B: split
    assert sim2.block_size(b) == 11 * MiB - 512


# ---- get_free_block: best fit, stream, address order --------------------------------------------

def test_best_fit_picks_the_smallest_free_block_that_fits():
    # get_free_block: pool.blocks.lower_bound on (stream, size, ptr) = smallest block >= size.
    sim = CachingAllocatorSim()
    a, b = sim.malloc(24 * MiB), sim.malloc(30 * MiB)  # two segments: 24 and 30 MiB
    sim.free(b)
    sim.free(a)
    assert sim.malloc(22 * MiB) == a  # 24 MiB block, not the 30 MiB one
    assert sim.malloc(29 * MiB) == b
    assert sim.reserved == 54 * MiB


def test_equal_sizes_tie_break_on_lower_address():
    # BlockComparatorSize: equal stream and size compare by ptr.
    sim = CachingAllocatorSim()
    a, b = sim.malloc(12 * MiB), sim.malloc(12 * MiB)
    sim.free(b)
    sim.free(a)
    assert sim.malloc(12 * MiB) == min(a, b)


def test_blocks_are_reused_only_on_their_own_stream():
    # get_free_block: `(*it)->stream != p.stream()` -> no block; alloc_block makes a new segment.
    sim = CachingAllocatorSim()
    sim.free(sim.malloc(12 * MiB, stream=0))
    sim.malloc(12 * MiB, stream=7)
    assert sim.reserved == 24 * MiB
    sim.malloc(12 * MiB, stream=0)  # the stream-0 block is still there
    assert sim.reserved == 24 * MiB


# ---- free_block / try_merge_blocks --------------------------------------------------------------

def test_free_merges_neighbours_and_tracks_inactive_split_bytes():
    # alloc_found_block / free_block / try_merge_blocks, and the inactive_split_bytes stat.
    sim = CachingAllocatorSim()
    a = sim.malloc(5 * MiB)  # 20 MiB segment: [a 5][free 15]
    assert sim.inactive_split_bytes == 15 * MiB
    b = sim.malloc(5 * MiB)  # [a 5][b 5][free 10]: the split block shrinks by 5
    assert sim.inactive_split_bytes == 10 * MiB
    sim.free(a)  # [free 5][b 5][free 10]: a is split, +5
    assert sim.inactive_split_bytes == 15 * MiB
    sim.free(b)  # merges both sides into one unsplit 20 MiB block
    assert sim.inactive_split_bytes == 0
    assert sim.malloc(18 * MiB) == a  # the merged block serves 18 MiB: no new segment
    assert sim.reserved == 20 * MiB


def test_blocks_never_merge_across_segments():
    # try_merge_blocks only follows prev/next, which never cross a cudaMalloc boundary.
    sim = CachingAllocatorSim()
    a, b = sim.malloc(12 * MiB), sim.malloc(12 * MiB)  # adjacent 12 MiB segments
    sim.free(a)
    sim.free(b)
    sim.malloc(24 * MiB)  # 24 MiB free in total, but no single block: new segment
    assert sim.reserved == 48 * MiB


# ---- max_split_size_mb / max_non_split_rounding_mb ----------------------------------------------

def test_oversize_block_is_not_used_for_a_request_below_max_split_size():
    # get_free_block: "Do not return an oversized block for a large request".
    sim = CachingAllocatorSim(AllocatorConfig(max_split_size_mb=40))
    sim.free(sim.malloc(50 * MiB))
    sim.malloc(20 * MiB)  # 20 < 40 and the 50 MiB block is >= 40: new 20 MiB segment
    assert sim.reserved == 70 * MiB


def test_oversize_block_serves_requests_within_20mib_and_is_not_split():
    # get_free_block: block.size < size + max_non_split_rounding_size (default kLargeBuffer);
    # should_split: size >= max_split_size -> never split.
    sim = CachingAllocatorSim(AllocatorConfig(max_split_size_mb=40))
    sim.free(sim.malloc(50 * MiB))
    a = sim.malloc(45 * MiB)  # 50 < 45 + 20: reused whole
    assert (sim.reserved, sim.block_size(a)) == (50 * MiB, 50 * MiB)
    sim.free(a)
    sim.malloc(30 * MiB + 1)  # below max_split: refused; 30 MiB + 512 B -> a 32 MiB segment
    assert sim.reserved == 50 * MiB + 32 * MiB


def test_oversize_block_is_refused_beyond_the_rounding_limit():
    sim = CachingAllocatorSim(AllocatorConfig(max_split_size_mb=40))
    sim.free(sim.malloc(84 * MiB))  # (84 is a multiple of kRoundLarge: segment = request)
    sim.malloc(60 * MiB)  # 84 >= 60 + 20: refused, new 60 MiB segment
    assert sim.reserved == 144 * MiB
    edge = CachingAllocatorSim(AllocatorConfig(max_split_size_mb=40))
    edge.free(edge.malloc(60 * MiB))
    edge.malloc(40 * MiB)  # 60 >= 40 + 20 exactly: refused (the check is >=)
    assert edge.reserved == 100 * MiB
    wide = CachingAllocatorSim(AllocatorConfig(max_split_size_mb=40, max_non_split_rounding_mb=30))
    wide.free(wide.malloc(84 * MiB))
    wide.malloc(60 * MiB)  # 84 < 60 + 30: reused
    assert wide.reserved == 84 * MiB


def test_blocks_below_max_split_size_still_split():
    # should_split: size < max_split_size and remainder > 1 MiB.
    sim = CachingAllocatorSim(AllocatorConfig(max_split_size_mb=40))
    sim.free(sim.malloc(30 * MiB))
    a = sim.malloc(12 * MiB)
    assert sim.block_size(a) == 12 * MiB
    sim.malloc(18 * MiB)  # the 18 MiB remainder
    assert sim.reserved == 30 * MiB


# ---- roundup_power2_divisions -------------------------------------------------------------------

@pytest.mark.parametrize(("request_bytes", "expected"), [
    (1200 * KiB, 1280 * KiB),  # the source's own example: 1024, 1280, 1536, 1792 KiB
    (600 * KiB, 640 * KiB),  # below 1 MiB uses interval 0 too: 512, 640, 768, 896 KiB
    (1 * MiB, 1 * MiB),  # powers of 2 are kept
    (1000, 1024),  # size <= 512 * divisions: plain 512 rounding
    (3 * MiB + 1, 3 * MiB + 512 * KiB),  # [2, 4) MiB in 4 divisions: steps of 512 KiB
])
def test_roundup_power2_divisions(request_bytes, expected):
    # round_size -> roundup_power2_next_division(size, 4).
    config = AllocatorConfig(roundup_power2_divisions=4)
    assert round_size(request_bytes, config) == expected
    sim = CachingAllocatorSim(config)
    sim.malloc(request_bytes)
    assert sim.allocated == expected


@pytest.mark.parametrize(("request_bytes", "expected"), [
    (1200 * KiB, 1200 * KiB),  # intervals below 256 MiB take the first value (1): no roundup
    (300 * MiB + 1, 300 * MiB + 512),  # [256, 512) MiB: 1 division
    (600 * MiB + 1, 768 * MiB),  # [512, 1024) MiB: 2 divisions of 256 MiB
    (1536 * MiB + 1, 1792 * MiB),  # [1, 2) GiB: 4 divisions of 256 MiB
    (3072 * MiB + 1, 3328 * MiB),  # above: ">" -> 8 divisions of 256 MiB in [2, 4) GiB
])
def test_roundup_power2_divisions_per_interval(request_bytes, expected):
    # parseRoundUpPower2Divisions list form and roundup_power2_divisions(size) interval lookup.
    config = AllocatorConfig.from_env("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    assert round_size(request_bytes, config) == expected


# ---- expandable_segments ------------------------------------------------------------------------

def test_expandable_segments_grow_by_pages():
    # try_allocate_expandable_block / map_block: 2 MiB pages (small), 20 MiB pages (large).
    sim = CachingAllocatorSim(AllocatorConfig(expandable_segments=True))
    sim.malloc(600 * KiB)
    assert sim.reserved == 2 * MiB  # one small page
    sim.malloc(5 * MiB)
    assert sim.reserved == 22 * MiB  # one large page; 15 MiB of it left free
    sim.malloc(30 * MiB)  # free 15 MiB + map 15 MiB more -> one more 20 MiB page
    assert sim.reserved == 42 * MiB  # (without expandable segments: 2 + 20 + 30 = 52 MiB)
    assert sim.allocated == 600 * KiB + 35 * MiB


def test_expandable_segments_split_any_remainder_of_512_bytes():
    # should_split: with expandable segments the large pool also splits at >= kMinBlockSize.
    exp = CachingAllocatorSim(AllocatorConfig(expandable_segments=True))
    exp.malloc(11 * MiB)
    assert (exp.allocated, exp.reserved) == (11 * MiB, 20 * MiB)
    plain = CachingAllocatorSim()
    plain.malloc(11 * MiB)  # 12 MiB segment, 1 MiB remainder not split
    assert (plain.allocated, plain.reserved) == (12 * MiB, 12 * MiB)


def test_expandable_empty_cache_unmaps_only_whole_free_pages():
    # release_blocks -> unmap_block: pages fully inside a free block are unmapped.
    sim = CachingAllocatorSim(AllocatorConfig(expandable_segments=True))
    a = sim.malloc(10 * MiB)  # [0, 10) in page 0
    b = sim.malloc(30 * MiB)  # [10, 40): maps page 1
    c = sim.malloc(10 * MiB)  # [40, 50): maps page 2; [50, 60) free
    assert sim.reserved == 60 * MiB
    sim.free(b)
    sim.empty_cache()  # free [10, 40): only page 1 = [20, 40) is whole; [50, 60) is no whole page
    assert (sim.reserved, sim.allocated) == (40 * MiB, 20 * MiB)
    assert sim.malloc(30 * MiB) == b  # lowest address with room: free [10, 20) + unmapped page 1
    assert sim.reserved == 60 * MiB
    for addr in (a, b, c):
        sim.free(addr)
    sim.empty_cache()  # release_expandable_segment: everything unmapped
    assert (sim.reserved, sim.allocated) == (0, 0)


# ---- empty_cache / OOM retry / garbage collection -----------------------------------------------

def test_empty_cache_releases_only_fully_free_segments():
    # release_blocks: `!block->prev && !block->next` -> release_block (cudaFree).
    sim = CachingAllocatorSim()
    sim.malloc(5 * MiB)  # 20 MiB segment, partly used (its free 15 MiB is split): kept
    sim.free(sim.malloc(16 * MiB))  # > 15 MiB: a 16 MiB segment, then fully free
    sim.free(sim.malloc(4 * KiB))  # a 2 MiB small segment, fully free
    assert sim.reserved == 20 * MiB + 16 * MiB + 2 * MiB
    sim.empty_cache()
    assert sim.reserved == 20 * MiB


def test_oom_retry_frees_cached_segments_and_counts_a_retry():
    # malloc: alloc_block fails -> release_cached_blocks -> alloc_block(isRetry=true), which
    # counts num_alloc_retries.
    sim = CachingAllocatorSim(capacity=40 * MiB)
    sim.free(sim.malloc(12 * MiB))
    sim.malloc(30 * MiB)  # 12 + 30 > 40: free the cached 12 MiB segment, retry
    assert (sim.reserved, sim.num_alloc_retries, sim.num_ooms) == (30 * MiB, 1, 0)


def test_oom_when_nothing_can_be_freed():
    sim = CachingAllocatorSim(capacity=40 * MiB)
    sim.malloc(30 * MiB)
    with pytest.raises(SimulatedOOM, match="tried to allocate"):
        sim.malloc(12 * MiB)
    assert sim.num_ooms == 1


def test_release_available_cached_blocks_frees_just_enough_oversize_blocks():
    # malloc -> release_available_cached_blocks (only with max_split_size): frees the largest
    # oversize blocks until the request is covered, with no retry counted.
    sim = CachingAllocatorSim(AllocatorConfig(max_split_size_mb=40), capacity=130 * MiB)
    a, b = sim.malloc(50 * MiB), sim.malloc(45 * MiB)
    sim.free(a)
    sim.free(b)
    sim.malloc(70 * MiB)  # 95 + 70 > 130; 50 + 45 >= 70 released, then the alloc fits
    assert (sim.reserved, sim.num_alloc_retries) == (70 * MiB, 0)


def test_garbage_collection_threshold_frees_old_blocks_before_cudamalloc():
    # malloc -> garbage_collect_cached_blocks when reserved > threshold * allowed memory.
    config = AllocatorConfig(garbage_collection_threshold=0.5)
    sim = CachingAllocatorSim(config, capacity=100 * MiB)
    sim.free(sim.malloc(30 * MiB))
    sim.malloc(40 * MiB)  # 30 MiB block too small: new segment, reserved 70 > 50
    sim.malloc(34 * MiB)  # GC releases the unused 30 MiB block first: 40 + 34
    assert (sim.reserved, sim.num_alloc_retries) == (74 * MiB, 0)
    no_gc = CachingAllocatorSim(capacity=100 * MiB)
    no_gc.free(no_gc.malloc(30 * MiB))
    no_gc.malloc(40 * MiB)
    no_gc.malloc(34 * MiB)  # 104 > 100: only the OOM retry path frees it
    assert (no_gc.reserved, no_gc.num_alloc_retries) == (74 * MiB, 1)


# ---- statistics ---------------------------------------------------------------------------------

def test_peaks_and_reset_peak():
    # increase_stat keeps peak = max(current, peak); resetPeakStats sets peak = current.
    sim = CachingAllocatorSim()
    a = sim.malloc(30 * MiB)
    sim.free(a)
    assert (sim.peak_allocated, sim.peak_reserved, sim.allocated) == (30 * MiB, 30 * MiB, 0)
    sim.reset_peak()
    assert (sim.peak_allocated, sim.peak_reserved) == (0, 30 * MiB)
    sim.malloc(2 * MiB)  # fits the cached 30 MiB block
    assert (sim.peak_allocated, sim.peak_reserved) == (2 * MiB, 30 * MiB)


def test_negative_sizes_are_an_error():
    with pytest.raises(ValueError, match="negative allocation size -1"):
        CachingAllocatorSim().malloc(-1)


def test_freeing_an_unknown_address_is_an_error():
    with pytest.raises(KeyError, match="did not hand out"):
        CachingAllocatorSim().free(12345)
