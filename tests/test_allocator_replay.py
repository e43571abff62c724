"""`replay` of alloc/free streams and `replay_snapshot` of `torch.cuda.memory._snapshot()` traces.

The snapshot fixtures are written by hand in the format `_snapshot()` returns (torch/cuda/memory.py
docstring: `segments` and `device_traces`, entries with action/addr/size/stream); the "real"
numbers in them are what the real allocator would log for the same calls, derived by hand.
"""

from __future__ import annotations

import pytest

from hybridmem.errors import SpecError
from hybridmem.allocator import AllocatorConfig, ReplayResult, replay, replay_snapshot

KiB, MiB = 1 << 10, 1 << 20
A, B, C = 0x7F0000000000, 0x7F0002000000, 0x7F0004000000  # segment addresses (any values)


def _entry(action: str, addr: int, size: int, stream: int = 0) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": stream, "frames": []}


def _segment(addr: int, total: int, blocks: list[tuple[int, str]]) -> dict:
    return {"device": 0, "address": addr, "total_size": total, "stream": 0,
            "segment_type": "large" if total > 2 * MiB else "small",
            "blocks": [{"size": s, "requested_size": s, "state": st} for s, st in blocks]}


def _fixture_snapshot() -> dict:
    """5 + 12 MiB in one 20 MiB segment, then 600 KiB in a 2 MiB one (real reserved 22 MiB)."""
    trace = [
        _entry("segment_alloc", A, 20 * MiB),
        _entry("alloc", A, 5 * MiB),
        _entry("alloc", A + 5 * MiB, 12 * MiB),
        _entry("free_requested", A, 5 * MiB),
        _entry("free_completed", A, 5 * MiB),
        _entry("segment_alloc", B, 2 * MiB),
        _entry("alloc", B, 600 * KiB),
        _entry("snapshot", 0, 0),
    ]
    segments = [
        _segment(A, 20 * MiB, [(5 * MiB, "inactive"), (12 * MiB, "active_allocated"),
                               (3 * MiB, "inactive")]),
        _segment(B, 2 * MiB, [(600 * KiB, "active_allocated"), (1448 * KiB, "inactive")]),
    ]
    return {"segments": segments, "device_traces": [trace]}


def test_replay_stream_peaks_and_timeline():
    events = [("alloc", "x", 5 * MiB), ("alloc", "y", 12 * MiB), ("free", "x", 0),
              ("alloc", "z", 600 * KiB), ("free", "y", 0), ("empty_cache", 0, 0)]
    result = replay(events)
    assert isinstance(result, ReplayResult)
    # 5 + 12 MiB share a 20 MiB segment; 600 KiB gets a 2 MiB small segment.
    assert (result.peak_allocated, result.peak_reserved) == (17 * MiB, 22 * MiB)
    assert result.peak_requested == 17 * MiB
    assert result.timeline[1] == (1, 17 * MiB, 20 * MiB)
    assert result.timeline[-1] == (5, 600 * KiB, 2 * MiB)  # empty_cache gave back the 20 MiB
    assert len(result.timeline) == len(events)


def test_replay_uses_the_config_and_streams():
    events = [("alloc", 0, 11 * MiB), ("free", 0, 0), ("alloc", 1, 11 * MiB, 3)]
    assert replay(events).peak_reserved == 24 * MiB  # other stream: a second 12 MiB segment
    assert replay(events, AllocatorConfig(expandable_segments=True)).peak_allocated == 11 * MiB


def test_replay_counts_frees_it_never_saw_allocated():
    result = replay([("free", "ghost", 0), ("alloc", "x", 512), ("free", "x", 0)])
    assert result.unmatched_frees == 1
    assert result.timeline[-1] == (2, 0, 2 * MiB)


def test_replay_rejects_unknown_actions():
    with pytest.raises(SpecError, match="event='malloc'"):
        replay([("malloc", 0, 1)])


def test_replay_snapshot_matches_the_real_reserved_curve():
    result = replay_snapshot(_fixture_snapshot())
    assert result.real_peak_reserved == 22 * MiB
    assert result.peak_reserved == 22 * MiB  # the simulator takes the same decisions
    assert result.reserved_error == 0.0
    assert result.real_peak_requested == 17 * MiB
    assert result.peak_allocated == 17 * MiB
    assert (result.num_device_alloc, result.real_num_device_alloc) == (2, 2)
    assert result.unmatched_frees == 0
    # one timeline point per alloc / free_completed / segment entry; snapshot and
    # free_requested entries do not move memory
    assert [i for i, _, _ in result.real_timeline] == [0, 1, 2, 4, 5, 6]
    assert result.real_timeline[-1] == (6, 12 * MiB + 600 * KiB, 22 * MiB)


def test_replay_snapshot_with_history_started_late():
    snap = _fixture_snapshot()
    # a 2 MiB segment at C existed before recording began, holding a 1 MiB allocation that is
    # freed during the trace: the real curve starts at 2 MiB reserved, 1 MiB requested.
    snap["segments"].append(_segment(C, 2 * MiB, [(2 * MiB, "inactive")]))
    snap["device_traces"][0].insert(0, _entry("free_completed", C, 1 * MiB))
    result = replay_snapshot(snap)
    assert result.unmatched_frees == 1
    assert result.real_peak_reserved == 24 * MiB
    assert result.real_timeline[0] == (0, 0, 2 * MiB)
    assert result.peak_reserved == 22 * MiB  # the simulator only sees what the trace allocated


def test_replay_snapshot_follows_empty_cache():
    snap = _fixture_snapshot()
    trace = snap["device_traces"][0]
    trace.insert(-1, _entry("free_completed", A + 5 * MiB, 12 * MiB))
    trace.insert(-1, _entry("segment_free", A, 20 * MiB))  # torch.cuda.empty_cache()
    snap["segments"] = [snap["segments"][1]]
    result = replay_snapshot(snap)
    assert result.real_timeline[-1][2] == 2 * MiB
    assert result.timeline[-1][2] == 2 * MiB  # the simulator emptied its cache too
    assert result.peak_reserved == result.real_peak_reserved == 22 * MiB


def test_replay_snapshot_infers_expandable_segments():
    # With expandable segments the real allocator logs segment_map of whole 20 MiB pages:
    # 5 MiB maps one page, 30 MiB more needs one more page (15 MiB free + 15 MiB new).
    trace = [
        _entry("segment_map", A, 20 * MiB),
        _entry("alloc", A, 5 * MiB),
        _entry("segment_map", A + 20 * MiB, 20 * MiB),
        _entry("alloc", A + 5 * MiB, 30 * MiB),
    ]
    result = replay_snapshot({"device_traces": [trace]})
    assert result.real_peak_reserved == result.peak_reserved == 40 * MiB
    assert result.peak_allocated == 35 * MiB
    # forcing the default config shows the difference expandable segments make: 20 + 30 MiB
    assert replay_snapshot({"device_traces": [trace]}, config=AllocatorConfig()).peak_reserved \
        == 50 * MiB


def test_replay_snapshot_rejects_missing_device_and_unknown_actions():
    with pytest.raises(SpecError, match="device=1"):
        replay_snapshot(_fixture_snapshot(), device=1)
    with pytest.raises(SpecError, match="_record_memory_history"):
        replay_snapshot({"segments": []})
    with pytest.raises(SpecError, match="action='teleport'"):
        replay_snapshot({"device_traces": [[_entry("teleport", 0, 0)]]})
