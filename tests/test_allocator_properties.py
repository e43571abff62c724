"""Random alloc/free streams: invariants of the simulator, and agreement with a naive model.

The naive model re-derives the default allocator (no options) from the same rules with plain
lists and linear scans (no sorted pools, no linked blocks), so bookkeeping bugs in the fast
simulator show up as a different address or byte count on the same stream.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmem.allocator import (
    AllocatorConfig, CachingAllocatorSim, get_allocation_size, round_size,
)

MiB = 1 << 20
BASE = 1 << 44  # the simulator's first segment address (hybridmem.allocator.sim._BASE_ADDRESS)

sizes = st.one_of(st.integers(1, 1 * MiB), st.integers(1 * MiB, 40 * MiB),
                  st.sampled_from([0, 512, 20 * MiB]))
ops = st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "free", "empty"]), sizes,
                         st.integers(0, 1), st.integers(0, 10**6)), max_size=120)
configs = st.sampled_from([
    AllocatorConfig(), AllocatorConfig(max_split_size_mb=24),
    AllocatorConfig(roundup_power2_divisions=4), AllocatorConfig(expandable_segments=True),
    AllocatorConfig.from_env("expandable_segments:True,roundup_power2_divisions:[1:2,>:8]"),
])


class NaiveAllocator:
    """The allocator's rules without expandable segments (round_size, get_allocation_size, best
    fit, the max_split_size checks, should_split, merge, release of unsplit segments) over
    explicit segment lists."""

    def __init__(self, config: AllocatorConfig) -> None:
        self.config = config
        self.max_split = config.max_split_size()
        self.segments: list[dict] = []  # {"ptr", "small", "stream", "blocks": [[ptr, size, used]]}
        self.next = BASE
        self.zero = 0

    def malloc(self, size: int, stream: int) -> int:
        if size == 0:  # size-0 requests never reach malloc: a unique null-like handle
            self.zero -= 1
            return self.zero
        rounded = round_size(size, self.config)
        small = rounded <= MiB
        fits = [(b[1], b[0], seg, i) for seg in self.segments if seg["small"] == small
                and seg["stream"] == stream for i, b in enumerate(seg["blocks"])
                if not b[2] and b[1] >= rounded]
        best = min(fits, key=lambda f: (f[0], f[1])) if fits else None
        if best and (rounded < self.max_split <= best[0]  # oversize block, request below
                     or rounded >= self.max_split and best[0] >= rounded + 20 * MiB):
            best = None  # get_free_block gives up; it does not look further
        if best:
            _, _, seg, i = best
        else:
            total = get_allocation_size(rounded)
            seg = {"ptr": self.next, "small": small, "stream": stream,
                   "blocks": [[self.next, total, False]]}
            self.next += total
            self.segments.append(seg)
            i = 0
        block = seg["blocks"][i]
        rest = block[1] - rounded
        if rest >= 512 if small else (rounded < self.max_split and rest > MiB):
            seg["blocks"].insert(i + 1, [block[0] + rounded, rest, False])
            block[1] = rounded
        block[2] = True
        return block[0]

    def free(self, ptr: int) -> None:
        if ptr < 0:
            return
        for seg in self.segments:
            blocks = seg["blocks"]
            for i, b in enumerate(blocks):
                if b[0] == ptr and b[2]:
                    b[2] = False
                    if i + 1 < len(blocks) and not blocks[i + 1][2]:
                        b[1] += blocks.pop(i + 1)[1]
                    if i > 0 and not blocks[i - 1][2]:
                        blocks[i - 1][1] += blocks.pop(i)[1]
                    return
        raise KeyError(ptr)

    def empty_cache(self) -> None:
        self.segments = [s for s in self.segments if len(s["blocks"]) > 1 or s["blocks"][0][2]]

    @property
    def reserved(self) -> int:
        return sum(b[1] for s in self.segments for b in s["blocks"])

    @property
    def allocated(self) -> int:
        return sum(b[1] for s in self.segments for b in s["blocks"] if b[2])


def _run(sim, stream_ops, check):
    live = []
    for action, size, stream, pick in stream_ops:
        if action == "alloc":
            live.append(sim.malloc(size, stream))
        elif action == "free" and live:
            sim.free(live.pop(pick % len(live)))
        elif action == "empty":
            sim.empty_cache()
        check(sim, live)
    return live


naive_configs = st.sampled_from([
    AllocatorConfig(), AllocatorConfig(max_split_size_mb=24),
    AllocatorConfig(roundup_power2_divisions=4),
    AllocatorConfig(max_split_size_mb=20, roundup_power2_divisions={1: 2, 8: 8, ">": 4}),
])


@settings(max_examples=150, deadline=None)
@given(stream_ops=ops, config=naive_configs)
def test_simulator_agrees_with_the_naive_model(stream_ops, config):
    naive, sim = NaiveAllocator(config), CachingAllocatorSim(config)
    live_naive = _run(naive, stream_ops, lambda s, live: None)
    live_sim = _run(sim, stream_ops, lambda s, live: None)
    assert live_sim == live_naive  # same addresses for every live allocation
    assert (sim.allocated, sim.reserved) == (naive.allocated, naive.reserved)


@settings(max_examples=150, deadline=None)
@given(stream_ops=ops, config=configs)
def test_invariants_hold_and_everything_returns_after_free_and_empty_cache(stream_ops, config):
    sim = CachingAllocatorSim(config)

    def check(s, live):
        s.check_invariants()
        assert s.peak_allocated <= s.peak_reserved

    live = _run(sim, stream_ops, check)
    for addr in live:
        sim.free(addr)
    sim.check_invariants()
    assert (sim.allocated, sim.inactive_split_bytes) == (0, 0)
    sim.empty_cache()
    sim.check_invariants()
    assert sim.reserved == 0
