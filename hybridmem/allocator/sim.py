"""`CachingAllocatorSim`: PyTorch's `DeviceCachingAllocator` for one device, without memory.

Each method names the C++ function it mirrors (`c10/cuda/CUDACachingAllocator.cpp`, commit
001074d2; the same logic sits in `c10/core/CachingDeviceAllocator.h` in newer releases). Free
blocks live in one sorted list per pool, keyed like `BlockComparatorSize` (stream, size,
address), so best fit is a `bisect`. Addresses are simulated: segments are laid out one after
another; only their order matters (it breaks ties between equal-sized blocks).

Not modelled: CUDA-graph private pools, `record_stream` events, IPC, `release_lock_on_cudamalloc`.
The simulator never runs out of memory unless given a `capacity` (bytes the allocator may
reserve); then the free-cached-blocks-and-retry path of `malloc` is followed and
`garbage_collection_threshold` acts as it does under `set_per_process_memory_fraction`.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from hybridmem.allocator.config import (
    K_MIN_BLOCK_SIZE, K_MIN_LARGE_ALLOC, K_ROUND_LARGE, K_SMALL_BUFFER, K_SMALL_SIZE,
    ROUNDUP_INTERVALS, ROUNDUP_START_LOG2, AllocatorConfig, division_table,
)

# Virtual address space of one expandable segment when no capacity is given: in
# `ExpandableSegment`, 1 1/8 of the GPU's memory; any size far above a real GPU behaves the same.
DEFAULT_ADDRESS_SPACE = 1 << 40
_BASE_ADDRESS = 1 << 44  # where simulated segments start (any positive, 2 MiB-aligned value)


class SimulatedOOM(RuntimeError):
    """The simulated allocator could not reserve memory within `capacity` (num_ooms += 1)."""


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """`roundup_power2_next_division`: 1200 KiB with 4 divisions -> 1280 KiB."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)  # llvm::PowerOf2Floor
    step = floor >> (divisions.bit_length() - 1)  # floor >> log2(divisions)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


def _round(size: int, table: tuple[int, ...]) -> int:
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    # AllocatorConfig.cpp roundup_power2_divisions(size): interval index log2(size) - 20, clamped
    log = size.bit_length() - 1
    index = min(log - ROUNDUP_START_LOG2, ROUNDUP_INTERVALS - 1) if log > ROUNDUP_START_LOG2 else 0
    divisions = table[index]
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        return roundup_power2_next_division(size, divisions)
    return -(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def round_size(size: int, config: AllocatorConfig = AllocatorConfig()) -> int:
    """`round_size`: what a request of `size` bytes occupies (block size before splitting)."""
    return _round(size, division_table(config.roundup_power2_divisions))


def get_allocation_size(size: int, config: AllocatorConfig = AllocatorConfig()) -> int:
    """`get_allocation_size`: the cudaMalloc'd segment for a rounded request with no cached fit."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return config.large_segment_size()
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


class _Pool:
    """`BlockPool`: free mapped blocks (`blocks`) and unmapped expandable ranges (`unmapped`)."""

    __slots__ = ("is_small", "blocks", "unmapped", "gc_calls")

    def __init__(self, is_small: bool) -> None:
        self.is_small = is_small
        self.blocks: list[tuple[int, int, int]] = []  # BlockComparatorSize: (stream, size, ptr)
        self.unmapped: list[tuple[int, int]] = []  # BlockComparatorAddress: (stream, ptr)
        self.gc_calls = 0  # get_free_blocks_call_count


class _Segment:
    """`ExpandableSegment`: a reserved address range mapped page by page."""

    __slots__ = ("ptr", "page", "size")

    def __init__(self, ptr: int, page: int, address_space: int) -> None:
        self.ptr, self.page = ptr, page
        self.size = -(-address_space // page) * page  # max_handles_ * segment_size_


class _Block:
    """`Block`: a piece of a segment, free or allocated, linked to its neighbours."""

    __slots__ = ("ptr", "size", "stream", "pool", "allocated", "mapped", "prev", "next", "seg",
                 "requested", "gc_base")

    def __init__(self, ptr, size, stream, pool, seg=None, mapped=True):
        self.ptr, self.size, self.stream, self.pool, self.seg, self.mapped = (
            ptr, size, stream, pool, seg, mapped)
        self.allocated = False
        self.prev = self.next = None
        self.requested = 0
        self.gc_base = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def splice(self, before, after) -> None:
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after


class CachingAllocatorSim:
    """One device's caching allocator. `malloc` takes REQUESTED bytes and returns an address."""

    def __init__(self, config: AllocatorConfig = AllocatorConfig(), *, capacity: int | None = None):
        self.config = config
        self.capacity = capacity
        self._table = division_table(config.roundup_power2_divisions)
        self._max_split = config.max_split_size()
        self._non_split_rounding = config.max_non_split_rounding_size()
        self._expandable = config.expandable_segments
        self._gc = bool(config.garbage_collection_threshold) and capacity is not None
        self._small, self._large = _Pool(True), _Pool(False)
        self._free: dict[int, _Block] = {}  # ptr -> free mapped block (in some pool's `blocks`)
        self._unmapped: dict[int, _Block] = {}  # ptr -> unmapped expandable block
        self._active: dict[int, _Block] = {}  # ptr -> allocated block (`active_blocks`)
        self._next_addr = _BASE_ADDRESS
        self._zero = 0  # handles for size-0 requests, which never reach malloc
        self.allocated = self.reserved = self.requested = 0
        self.peak_allocated = self.peak_reserved = self.peak_requested = 0
        self.inactive_split_bytes = self.peak_inactive_split_bytes = 0
        self.num_alloc_retries = self.num_ooms = self.num_device_alloc = self.num_device_free = 0
        self.segments = 0

    # ---- public API ---------------------------------------------------------------------------

    def malloc(self, size: int, stream: int = 0) -> int:
        """`DeviceCachingAllocator::malloc`; size 0 gets a null-like handle (never malloc'd)."""
        if size <= 0:
            if size < 0:
                raise ValueError(f"negative allocation size {size}")
            self._zero -= 1
            return self._zero
        rounded = _round(size, self._table)
        pool = self._small if rounded <= K_SMALL_SIZE else self._large  # get_pool
        block = self._get_free_block(pool, rounded, stream)
        if block is None:
            alloc_size = get_allocation_size(rounded, self.config)
            if self._gc:
                self._garbage_collect_cached_blocks()
            block = (self._alloc_block(pool, rounded, alloc_size, stream)
                     or (self._release_available_cached_blocks(pool, rounded, stream)
                         and self._alloc_block(pool, rounded, alloc_size, stream))
                     or self._retry_after_release(pool, rounded, alloc_size, stream))
            if not block:
                self.num_ooms += 1
                raise SimulatedOOM(f"tried to allocate {alloc_size} bytes with {self.reserved} of "
                                   f"{self.capacity} reserved ({self.allocated} allocated)")
        return self._alloc_found_block(block, pool, rounded, size, stream)

    def free(self, addr: int) -> None:
        """`DeviceCachingAllocator::free` (no stream uses, so straight to `free_block`)."""
        if addr < 0:
            return
        block = self._active.pop(addr, None)
        if block is None:
            raise KeyError(f"free of an address the simulator did not hand out: {addr:#x}")
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        self._free_block(block)

    def empty_cache(self) -> None:
        """`emptyCache` -> `release_cached_blocks`: return every fully free segment / page."""
        self._release_blocks(self._large)
        self._release_blocks(self._small)

    def reset_peak(self) -> None:
        """`resetPeakStats`: peaks restart from the current values."""
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved
        self.peak_requested = self.requested
        self.peak_inactive_split_bytes = self.inactive_split_bytes

    def block_size(self, addr: int) -> int:
        """Bytes the live allocation at `addr` holds (rounded, plus any unsplit remainder)."""
        return self._active[addr].size if addr >= 0 else 0

    # ---- finding and splitting blocks ---------------------------------------------------------

    def _insert(self, pool: _Pool, b: _Block) -> None:  # BlockPool::insert_into_blocks
        insort(pool.blocks, (b.stream, b.size, b.ptr))
        self._free[b.ptr] = b
        b.gc_base = pool.gc_calls

    def _remove(self, pool: _Pool, b: _Block) -> None:
        blocks = pool.blocks
        del blocks[bisect_left(blocks, (b.stream, b.size, b.ptr))]
        del self._free[b.ptr]

    def _get_free_block(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        """`get_free_block`: best fit in the pool on this stream, with the max_split_size rules."""
        if self._gc:
            pool.gc_calls += 1
        keys = pool.blocks
        i = bisect_left(keys, (stream, size, 0))
        if i == len(keys) or keys[i][0] != stream:
            return None
        block = self._free[keys[i][2]]
        if block.seg is not None:
            if self._expandable:  # best fit by the size the block can grow to
                grow = _expandable_size
                while block.seg is not None and i + 1 < len(keys) and keys[i + 1][0] == stream:
                    nxt = self._free[keys[i + 1][2]]
                    if grow(nxt) >= grow(block):
                        break
                    i, block = i + 1, nxt
            else:  # expandable segments turned off since: skip their blocks
                i += 1
                while (i < len(keys) and keys[i][0] == stream
                       and self._free[keys[i][2]].seg is not None):
                    i += 1
                if i == len(keys) or keys[i][0] != stream:
                    return None
                block = self._free[keys[i][2]]
        # "Do not return an oversized block for a large request"
        if size < self._max_split and block.size >= self._max_split:
            return None
        # "Allow oversized block size to be rounded up but within a limit"
        if size >= self._max_split and block.size >= size + self._non_split_rounding:
            return None
        self._remove(pool, block)
        return block

    def _should_split(self, block: _Block, size: int) -> bool:
        """`should_split`: small pool / expandable keep >= 512 B; large pool only > 1 MiB."""
        remaining = block.size - size
        if block.pool.is_small or self._expandable:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self._max_split and remaining > K_SMALL_SIZE

    def _alloc_found_block(self, block, pool, size, orig_size, stream) -> int:
        """`alloc_found_block`: split off the remainder if `should_split`, mark allocated."""
        already_split = block.is_split()
        if self._should_split(block, size):
            remaining = block
            block = _Block(remaining.ptr, size, stream, pool, remaining.seg)
            block.prev = remaining.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = remaining
            remaining.prev = block
            remaining.ptr += size
            remaining.size -= size
            self._insert(pool, remaining)
            if remaining.seg is None:
                self._inactive_split(-size if already_split else remaining.size)
        elif already_split and block.seg is None:
            self._inactive_split(-block.size)
        block.allocated = True
        block.requested = orig_size
        self._active[block.ptr] = block
        self.allocated += block.size
        self.requested += orig_size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        if self.requested > self.peak_requested:
            self.peak_requested = self.requested
        return block.ptr

    def _inactive_split(self, delta: int) -> None:
        self.inactive_split_bytes += delta
        if self.inactive_split_bytes > self.peak_inactive_split_bytes:
            self.peak_inactive_split_bytes = self.inactive_split_bytes

    # ---- freeing and merging ------------------------------------------------------------------

    def _free_block(self, block: _Block) -> None:
        """`free_block`: merge with free neighbours of the same segment, return to the pool."""
        pool = block.pool
        net = 0
        for candidate in (block.prev, block.next):
            net -= self._try_merge(block, candidate)
        self._insert(pool, block)
        if block.is_split():
            net += block.size
        if block.seg is None and net:
            self._inactive_split(net)

    def _try_merge(self, dst: _Block, src: _Block | None) -> int:
        """`try_merge_blocks`: absorb a free neighbour (same mapped state); returns its size."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if dst.prev is src:  # [src dst]
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        if src.mapped:
            self._remove(src.pool, src)
        else:
            self._remove_unmapped(src)
        return src.size

    # ---- getting memory from the device -------------------------------------------------------

    def _fits(self, nbytes: int) -> bool:
        return self.capacity is None or self.reserved + nbytes <= self.capacity

    def _grow_reserved(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.num_device_alloc += 1
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved

    def _alloc_block(self, pool, size, alloc_size, stream) -> _Block | None:
        """`alloc_block`: cudaMalloc a `get_allocation_size` segment, or grow an expandable one."""
        if self._expandable:
            return self._try_allocate_expandable_block(pool, size, stream)
        if not self._fits(alloc_size):
            return None
        ptr = self._next_addr
        self._next_addr += alloc_size
        self.segments += 1
        self._grow_reserved(alloc_size)
        return _Block(ptr, alloc_size, stream, pool)

    def _retry_after_release(self, pool, size, alloc_size, stream) -> _Block | None:
        """`release_cached_blocks` then `alloc_block(isRetry=true)`, which counts a retry."""
        self.empty_cache()
        self.num_alloc_retries += 1
        return self._alloc_block(pool, size, alloc_size, stream)

    def _release_block(self, block: _Block) -> None:
        """`release_block`: cudaFree a whole free segment."""
        self._remove(block.pool, block)
        self.reserved -= block.size
        self.segments -= 1
        self.num_device_free += 1

    def _release_blocks(self, pool: _Pool) -> None:
        """`release_blocks`: free unsplit segments; unmap whole free pages of expandable ones."""
        to_unmap = []
        for _, _, ptr in list(pool.blocks):
            block = self._free[ptr]
            if block.seg is not None:
                to_unmap.append(block)
            elif not block.is_split():
                self._release_block(block)
        for block in to_unmap:
            self._unmap_block(block)
            if not block.is_split():  # release_expandable_segment: the whole range is unmapped
                self._remove_unmapped(block)

    def _release_available_cached_blocks(self, pool, size, stream) -> bool:
        """`release_available_cached_blocks`: free just enough oversize blocks (max_split_size)."""
        if self.config.max_split_size_mb is None:
            return False
        key = max(size, self._max_split)
        keys = pool.blocks
        i = bisect_left(keys, (stream, key, 0))
        if i < len(keys) and keys[i][0] == stream and self._free[keys[i][2]].seg is None:
            self._release_block(self._free[keys[i][2]])
            return True
        released, i = 0, i - 1  # no single block is large enough: free the largest ones
        while released < key and i >= 0 and keys[i][1] >= self._max_split and keys[i][0] == stream:
            block = self._free[keys[i][2]]
            if block.seg is None:
                released += block.size
                self._release_block(block)
            i -= 1
        return released >= key

    def _garbage_collect_cached_blocks(self) -> None:
        """`garbage_collect_cached_blocks`: above threshold*capacity, free old unsplit blocks."""
        threshold = int(self.config.garbage_collection_threshold * self.capacity)
        if self.reserved <= threshold:
            return
        target, reclaimed = self.reserved - threshold, 0
        pool = self._large

        def freeable():
            return [b for b in (self._free[k[2]] for k in pool.blocks)
                    if not b.is_split() and b.seg is None]

        blocks = freeable()
        total_age = sum(pool.gc_calls - b.gc_base for b in blocks)
        count, freed = len(blocks), True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for block in freeable():
                age = pool.gc_calls - block.gc_base
                if age >= age_threshold:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block)

    # ---- expandable segments ------------------------------------------------------------------

    def _insert_unmapped(self, b: _Block) -> None:
        insort(b.pool.unmapped, (b.stream, b.ptr))
        self._unmapped[b.ptr] = b

    def _remove_unmapped(self, b: _Block) -> None:
        unmapped = b.pool.unmapped
        del unmapped[bisect_left(unmapped, (b.stream, b.ptr))]
        del self._unmapped[b.ptr]

    def _find_expandable_block(self, pool, size, stream) -> _Block:
        """`find_expandable_block`: lowest address with room (free + unmapped), else a new one."""
        keys = pool.unmapped
        i = bisect_left(keys, (stream, 0))
        while i < len(keys) and keys[i][0] == stream:
            c = self._unmapped[keys[i][1]]
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            room, b = 0, c
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                return c
            i += 1
        # 2 MiB pages for the small pool, 20 MiB (kLargeBuffer / large_segment_size) for the large
        page = K_SMALL_BUFFER if pool.is_small else self.config.large_segment_size()
        # ExpandableSegment reserves address space for 1 1/8 of the device's memory
        space = self.capacity + self.capacity // 8 if self.capacity else DEFAULT_ADDRESS_SPACE
        seg = _Segment(self._next_addr, page, space)
        self._next_addr += seg.size
        candidate = _Block(seg.ptr, seg.size, stream, pool, seg, mapped=False)
        self._insert_unmapped(candidate)
        return candidate

    def _map_block(self, to_map: _Block, size: int) -> bool:
        """`map_block`: map whole pages covering `size` bytes at the start of an unmapped block."""
        seg = to_map.seg
        begin = (to_map.ptr - seg.ptr) // seg.page  # ExpandableSegment::map: segmentLeft/Right
        end = -(-(to_map.ptr + size - seg.ptr) // seg.page)
        mapped = (end - begin) * seg.page
        if not self._fits(mapped):
            return False
        self._remove_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            rest = _Block(to_map.ptr + mapped, to_map.size - mapped, to_map.stream, to_map.pool,
                          seg, mapped=False)
            rest.splice(to_map, to_map.next)
            self._insert_unmapped(rest)
            to_map.size = mapped
        self._try_merge(to_map, to_map.prev)
        self._try_merge(to_map, to_map.next)
        self._insert(to_map.pool, to_map)
        self._grow_reserved(mapped)
        return True

    def _try_allocate_expandable_block(self, pool, size, stream) -> _Block | None:
        """`try_allocate_expandable_block`: map pages until a free block of `size` exists."""
        candidate = self._find_expandable_block(pool, size, stream)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:  # invariant: free -> unmapped -> *
            nxt = candidate.next
            assert nxt is not None and not nxt.mapped, "expandable segment chain broken"
            if not self._map_block(nxt, min(size - candidate.size, nxt.size)):
                return None
            candidate = nxt
        self._remove(pool, candidate)
        return candidate

    def _unmap_block(self, block: _Block) -> None:
        """`unmap_block`: unmap the whole pages inside a free block; the edges stay mapped."""
        seg = block.seg
        begin = -(-(block.ptr - seg.ptr) // seg.page)  # ExpandableSegment::unmap: segmentRight
        end = (block.ptr + block.size - seg.ptr) // seg.page  # segmentLeft
        if begin >= end:
            return
        uptr, usize = seg.ptr + begin * seg.page, (end - begin) * seg.page
        pool = block.pool
        self._remove(pool, block)
        if uptr > block.ptr:
            before = _Block(block.ptr, uptr - block.ptr, block.stream, pool, seg)
            before.splice(block.prev, block)
            self._insert(pool, before)
        after_size = block.size - (uptr - block.ptr) - usize
        if after_size > 0:
            after = _Block(uptr + usize, after_size, block.stream, pool, seg)
            after.splice(block, block.next)
            self._insert(pool, after)
        block.ptr, block.size, block.mapped = uptr, usize, False
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        self._insert_unmapped(block)
        self.reserved -= usize
        self.num_device_free += 1

    # ---- checks -------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Blocks tile their segments, free neighbours are merged, counters match (for tests)."""
        blocks = [*self._active.values(), *self._free.values(), *self._unmapped.values()]
        heads = [b for b in blocks if b.prev is None]
        mapped_total = 0
        for head in heads:
            b, prev = head, None
            while b is not None:
                assert b.prev is prev and (prev is None or prev.ptr + prev.size == b.ptr)
                if prev is not None and not prev.allocated and not b.allocated:
                    assert prev.mapped != b.mapped, "adjacent free blocks left unmerged"
                mapped_total += b.size if b.mapped else 0
                prev, b = b, b.next
        assert mapped_total == self.reserved, (mapped_total, self.reserved)
        assert sum(b.size for b in self._active.values()) == self.allocated
        assert len(self._small.blocks) + len(self._large.blocks) == len(self._free)
        assert self.allocated <= self.reserved <= self.peak_reserved


def _expandable_size(b: _Block) -> int:
    """`get_free_block`'s expandable_size: a block's size plus the unmapped range after it."""
    nxt = b.next
    return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)
