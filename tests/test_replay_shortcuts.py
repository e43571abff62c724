"""`allocator.reserved`'s capped replays answered without replaying (live tensors above the
capacity; an unlimited peak within it) give what replaying within the capacity gives."""

from __future__ import annotations

import pytest

from hybridmem import TrainingSpec
from hybridmem.allocator import reserved
from hybridmem.allocator.config import AllocatorConfig, alloc_conf_string
from hybridmem.allocator.replay import peak_requested, replay
from hybridmem.allocator.sim import SimulatedOOM
from hybridmem.analytic.estimate import _measure

SPEC = TrainingSpec(model="tiny-llama", micro_batch=4, seq_len=256, precision="bf16-mixed",
                    attn="sdpa")


def _replayed_within(events, config: AllocatorConfig, capacity: int | None):
    """What `_replayed` answers, by replaying within the capacity (`capped_replay`)."""
    try:
        result, oom = replay(events, config, capacity=capacity), False
    except SimulatedOOM:
        result, oom = replay(events, config), True
    return (result.peak_reserved - result.peak_allocated, result.num_alloc_retries, oom,
            result.peak_reserved)


@pytest.mark.parametrize("conf", ["", "expandable_segments:True",
                                  "garbage_collection_threshold:0.6", "max_split_size_mb:64"])
def test_capped_answers_equal_the_capped_replay(conf, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    env = alloc_conf_string()
    config = reserved._config(env)
    allocated, events = _measure(SPEC)
    free = replay(events, config)
    requested = peak_requested(events)
    assert requested == free.peak_requested  # the scan counts what the simulator counts
    # above the unlimited peak, between the live tensors and it, below the live tensors
    capacities = [free.peak_reserved + (1 << 20), free.peak_reserved,
                  (requested + free.peak_reserved) // 2, requested, requested - 1,
                  requested // 2]
    outcomes = {_replayed_within(events, config, c)[2] for c in capacities}
    assert outcomes == {True, False}  # both regimes are exercised
    for order in ("unlimited first", "capped first"):
        reserved._REPLAYS.clear()
        if order == "unlimited first":
            reserved._replayed(SPEC, _measure, env, None)
        for capacity in capacities:
            got = reserved._replayed(SPEC, _measure, env, capacity)
            assert got == (allocated, *_replayed_within(events, config, capacity)), (
                order, capacity)
    reserved._REPLAYS.clear()


def test_a_config_edited_between_two_answers_is_priced_afresh(tmp_path):
    """The per-process caches of the analytic tier are keyed by the model's config too."""
    import json

    from hybridmem import predict
    from hybridmem.models.loader import load_config_dict

    path = tmp_path / "config.json"
    data = load_config_dict("tiny-llama")[1]
    path.write_text(json.dumps(data))
    spec = SPEC.with_(model=str(path))
    first = predict(spec, method="analytic")
    data["intermediate_size"] *= 2  # a wider MLP: more parameters, more activation bytes
    path.write_text(json.dumps(data))
    second = predict(spec, method="analytic")
    assert second.params_total > first.params_total
    assert second.peak.allocated_bytes > first.peak.allocated_bytes
