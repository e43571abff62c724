"""Context parallelism in the trace tier: torch's own `context_parallel` ring attention, one rank
under torch's fake process group, on fake tensors against the same code on real CPU tensors.

The oracle: tiny Llama (4 heads, 2 KV heads, hidden 64, 2 layers), fp32, SDPA, cp = 2, 2 x 256
tokens (so the peak is in the backward, where the ring's buffers live, not at the optimizer
step), torch's default head-tail load balancing and `allgather` rotate method. The real run
computes on real CPU tensors with the CPU flash kernel per ring chunk
(`hybridmem.parallel.ring_cpu`); its live storage bytes are counted by the same tracker.
"""

from __future__ import annotations

from collections import Counter

import pytest

from hybridmem.errors import SpecError
from hybridmem.job.parallel import ParallelSpec
from hybridmem.job.spec import TrainingSpec

LAYERS = 2  # tiny-llama's num_hidden_layers (hybridmem/shipped_models)


def _spec(ps: ParallelSpec, seq: int = 256, attn: str = "sdpa") -> TrainingSpec:
    return TrainingSpec(model="tiny-llama", micro_batch=2, seq_len=seq, precision="fp32",
                        attn=attn, parallel=ps)


CP = ParallelSpec(world_size=2, cp=2)
FSDP_CP = ParallelSpec(world_size=4, cp=2, strategy="fsdp")


@pytest.fixture(scope="module")
def cp_traces():
    from hybridmem.parallel.trace_ranks import trace_rank

    return trace_rank(_spec(CP)), trace_rank(_spec(CP), backend="real")


def test_cp_rank_runs_torch_ring_attention(monkeypatch):
    """torch's `_templated_ring_attention` loop ran: the CPU flash kernel once per ring step
    (rank 0 with head-tail load balancing: its whole query against its own K/V, then the
    second half of its query against the other rank's, `partial=True`), on a
    (batch, heads, seq / cp, head_dim) query; the K/V went through `_AllGatherRotater`; the
    backward ran the kernel's backward as often."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    from hybridmem.parallel.trace_ranks import ITERATIONS, trace_rank

    calls = Counter()
    queries = []

    def counting(name, op):
        def run(*args, **kwargs):
            calls[name] += 1
            if name == "forward":
                queries.append(tuple(kwargs.get("query", args[0] if args else None).shape))
            return op(*args, **kwargs)
        return run

    for name, ring in (("forward", "_templated_ring_attention"),
                       ("backward", "_templated_ring_attention_backward")):
        real = getattr(_attention, ring)
        monkeypatch.setattr(_attention, ring, lambda group, dim, op, *a, _real=real, _n=name,
                            **k: _real(group, dim, counting(_n, op), *a, **k))
    gather = _attention._AllGatherRotater.exchange_buffers
    monkeypatch.setattr(_attention._AllGatherRotater, "exchange_buffers",
                        lambda self, buf: (calls.update(["all_gather"]), gather(self, buf))[1])
    trace_rank(_spec(CP, seq=64))
    steps = LAYERS * CP.cp * ITERATIONS
    assert calls["forward"] == calls["backward"] == steps
    assert calls["all_gather"] == 2 * LAYERS * ITERATIONS  # forward and backward K/V
    # tiny-llama: 4 heads of 16; 64 tokens / cp = 32 on this rank, then its second half
    assert queries[:2] == [(2, 4, 32, 16), (2, 4, 16, 16)]


def test_cp_fake_rank_equals_the_real_cpu_run(cp_traces):
    """Fake tensors and real CPU tensors, the same torch code: the same live bytes at every
    event, hence the same peak (unrounded); the states are the whole model's (cp alone
    replicates the params: torch's `context_parallel` shards only the sequence)."""
    from hybridmem.parallel.states import model_tensors

    fake, real = cp_traces
    assert fake.peak(rounded=False) == real.peak(rounded=False)
    assert (fake.param, fake.grad, fake.optimizer, fake.layer_saved) == (
        real.param, real.grad, real.optimizer, real.layer_saved)
    n = model_tensors(_spec(ParallelSpec())).params
    assert (fake.param, fake.grad, fake.optimizer) == (4 * n, 4 * n, 8 * n)


def test_cp_analytic_within_3_percent_of_trace():
    """The analytic per-rank tier (seq / cp tokens + the ring's K/V buffers, `ranks._comm`)
    against the traced rank, allocated peak, both in the backward."""
    from hybridmem.parallel.ranks import price_ranks
    from hybridmem.tiers import estimator

    spec = _spec(CP)
    traced = estimator("trace")(spec)
    analytic = price_ranks(spec)[0]
    assert traced.peak.phase == analytic.peak.phase == "backward"
    ratio = analytic.peak.allocated_bytes / traced.peak.allocated_bytes
    assert abs(ratio - 1) < 0.03, ratio
    assert traced.method == "trace+layout" and "context_parallel" in " ".join(traced.notes)


def test_fsdp_times_cp_rank():
    """FSDP2 over the flattened dp x cp mesh (torchtitan's `dp_shard_cp`): the rank's shards
    are the analytic tier's (`ranks._states` over dp_shard x cp ranks), fake peak = real."""
    from hybridmem.analytic.estimate import setup
    from hybridmem.parallel import ranks
    from hybridmem.parallel.trace_ranks import trace_rank

    spec = _spec(FSDP_CP, seq=32)
    fake = trace_rank(spec)
    layers = [(p.module, p.layer) for p in setup(spec.with_(parallel=ParallelSpec()))[1]]
    states = ranks._states(spec, layers)
    assert (fake.param, fake.grad, fake.optimizer) == (states.param, states.grad,
                                                       states.optimizer)
    assert fake.peak(rounded=False) == trace_rank(spec, backend="real").peak(rounded=False)


def test_cp_refusals_are_one_line():
    from hybridmem.parallel.trace_ranks import refusal

    eager = refusal(_spec(CP, attn="eager"))
    assert isinstance(eager, SpecError) and "sdpa" in str(eager) and "\n" not in str(eager)
    both = refusal(_spec(ParallelSpec(world_size=4, cp=2, tp=2)))
    assert isinstance(both, SpecError) and "tp" in str(both)
    assert refusal(_spec(CP)) is None


def test_rank_fragmentation_is_the_rank_replay():
    """Reserved per model-parallel rank is the allocator simulator's replay of the rank's own
    stream, not allocated + a margin: the trace tier replays the traced storages (whose
    simulated allocated peak is the tracker's 512 B-rounded peak, two independent countings),
    the analytic tier the narrow model's stream with the rank's states (`ranks.rank_events`);
    sequence parallelism, whose stream is not the narrow model's, keeps reserved = allocated
    and says so."""
    from hybridmem.parallel.ranks import price_ranks
    from hybridmem.parallel.trace_ranks import replayed, trace_rank
    from hybridmem.tiers import estimator

    spec = _spec(CP)
    traced = estimator("trace")(spec)
    sim, oom = replayed(trace_rank(spec).tracker, None)
    assert not oom and sim.peak_allocated == traced.peak.allocated_bytes
    assert traced.peak.reserved_bytes == sim.peak_reserved > traced.peak.allocated_bytes
    analytic = price_ranks(spec)[0]
    assert analytic.peak.reserved_bytes - analytic.peak.allocated_bytes == \
        analytic.breakdown["fragmentation"] > 0
    sp = price_ranks(_spec(ParallelSpec(world_size=2, tp=2, sequence_parallel=True)))[0]
    assert sp.peak.reserved_bytes == sp.peak.allocated_bytes
    assert any("not replayed for sequence-parallel" in n for n in sp.notes)
