"""Pipeline parallelism in the trace tier against a real CPU run, and the analytic tier.

The trace tier runs torch's own `torch.distributed.pipelining` (`PipelineStage`,
`Schedule1F1B`, `ScheduleGPipe`) for one pipeline rank at a time under torch's fake process
group (`parallel.trace_pipeline`). The oracle is the same code on real CPU tensors, still under
the fake process group, its live storage bytes counted by the same tracker (as
tests/test_parallel_tp_trace.py does for tp): tiny Llama (2 layers, fp32, eager), pp = 2,
4 micro-batches of 2 x 32 tokens.
"""

from __future__ import annotations

import json

import pytest

from hybridmem.categories import TENSOR_CATEGORIES
from hybridmem.job.parallel import ParallelSpec
from hybridmem.job.spec import TrainingSpec


def _spec(schedule: str, model: str = "tiny-llama") -> TrainingSpec:
    return TrainingSpec(model=model, micro_batch=2, seq_len=32, precision="fp32", attn="eager",
                        parallel=ParallelSpec(world_size=2, pp=2, pp_microbatches=4,
                                              pp_schedule=schedule))


@pytest.fixture(scope="module")
def traced():
    from hybridmem.parallel.trace_ranks import trace_rank

    return {(s, r): (trace_rank(_spec(s), r), trace_rank(_spec(s), r, backend="real"))
            for s in ("1f1b", "gpipe") for r in (0, 1)}


def test_fake_pipeline_rank_equals_the_real_run(traced):
    """Every pipeline rank's peak live bytes on fake tensors equal the same stages and schedule
    on real CPU tensors, to the byte (unrounded), and so do its params, grads and AdamW state."""
    for (schedule, rank), (fake, real) in traced.items():
        assert fake.peak(rounded=False) == real.peak(rounded=False), (schedule, rank)
        assert (fake.param, fake.grad, fake.optimizer) == (real.param, real.grad,
                                                           real.optimizer)


def test_which_pipeline_rank_peaks(traced):
    """1F1B: the first stage holds min(m, pp) = 2 micro-batches in flight against the last
    stage's 1 (Schedule1F1B's warm-up), so rank 0 peaks; GPipe: every stage holds all 4, and
    the last adds the lm_head's logits and the loss, so rank 1 peaks."""
    peak = {k: fake.peak()[0] for k, (fake, _) in traced.items()}
    assert peak["1f1b", 0] > peak["1f1b", 1]
    assert peak["gpipe", 1] > peak["gpipe", 0]
    assert peak["gpipe", 0] > peak["1f1b", 0]


def test_analytic_pipeline_ranks_within_3_percent_of_the_trace(traced):
    """The analytic per-rank tier (`parallel.ranks`) against each traced rank's allocated peak
    (512 B-rounded); the stage's parameters exactly."""
    from hybridmem.parallel.ranks import price_ranks

    for schedule in ("1f1b", "gpipe"):
        _, answers = price_ranks(_spec(schedule))
        for a in answers:
            fake = traced[schedule, a.rank][0]
            analytic = sum(a.breakdown[c] for c in TENSOR_CATEGORIES)
            assert abs(analytic / fake.peak()[0] - 1) < 0.03, (schedule, a.rank, analytic)
            assert a.breakdown["param"] == fake.param


def test_trace_tier_answers_the_highest_pipeline_rank():
    from hybridmem.tiers import estimator

    answer = estimator("trace")(_spec("1f1b"))
    assert answer.extras["highest_rank"] == 0 and len(answer.extras["ranks"]) == 2
    assert "pipeline rank 0" in answer.notes[1] and "2 micro-batches in flight" in answer.notes[1]


def test_uneven_split_follows_torchtitan(tmp_path):
    """3 layers over pp = 2: torchtitan's `generate_llm_fqn_per_model_part` (first/last stage
    weights 0) gives the extra layer to the first stage: [2, 1]. The analytic tier prices
    each rank's own layers, the trace tier runs that split, and the two agree within 3 %."""
    from hybridmem.models.loader import load_config_dict, materialize_config
    from hybridmem.parallel.layout import stage_sizes
    from hybridmem.parallel.ranks import price_ranks
    from hybridmem.parallel.trace_ranks import trace_rank

    assert stage_sizes(3, 2) == [2, 1] and stage_sizes(7, 4) == [2, 2, 2, 1]
    assert stage_sizes(8, 4) == [2, 2, 2, 2]
    data = dict(load_config_dict("tiny-llama")[1], num_hidden_layers=3)
    model = materialize_config(json.dumps(data))
    spec = _spec("1f1b", model=model)
    _, answers = price_ranks(spec)
    assert [a.layers for a in answers] == [(0, 1), (2, 2)]
    for a in answers:
        fake = trace_rank(spec, a.rank)
        assert fake.peak(rounded=False) == trace_rank(spec, a.rank, backend="real").peak(
            rounded=False)
        analytic = sum(a.breakdown[c] for c in TENSOR_CATEGORIES)
        assert abs(analytic / fake.peak()[0] - 1) < 0.03, (a.rank, analytic, fake.peak())
        assert a.breakdown["param"] == fake.param


def test_pipeline_with_another_axis_is_a_one_line_refusal():
    from hybridmem.errors import SpecError
    from hybridmem.parallel.trace_ranks import trace_rank

    spec = TrainingSpec(model="tiny-llama", micro_batch=2, seq_len=32, precision="fp32",
                        parallel=ParallelSpec(world_size=4, pp=2, tp=2, pp_microbatches=4))
    with pytest.raises(SpecError, match="one model-parallel axis") as err:
        trace_rank(spec)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_interleaved_schedules_trace_alone():
    """ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble, 2 stages per rank (4-layer
    tiny Llama, pp 2, 4 micro-batches): fake = real per rank; the analytic tier within 3 % on
    both (zero bubble priced action by action, `ranks._zero_bubble_points`) (~40 s)."""
    from hybridmem.models.loader import load_config_dict, materialize_config
    from hybridmem.parallel.ranks import price_ranks
    from hybridmem.parallel.trace_ranks import trace_rank

    model = materialize_config(json.dumps(dict(load_config_dict("tiny-llama")[1],
                                               num_hidden_layers=4)))
    for schedule in ("interleaved-1f1b", "zero-bubble"):
        spec = TrainingSpec(model=model, micro_batch=2, seq_len=32, precision="fp32",
                            attn="eager", parallel=ParallelSpec(
                                world_size=2, pp=2, pp_microbatches=4, pp_schedule=schedule,
                                pp_virtual_stages=2))
        _, answers = price_ranks(spec)
        for a in answers:
            fake = trace_rank(spec, a.rank)
            assert fake.peak(rounded=False) == trace_rank(spec, a.rank, backend="real").peak(
                rounded=False)
            analytic = sum(a.breakdown[c] for c in TENSOR_CATEGORIES)
            assert abs(analytic / fake.peak()[0] - 1) < 0.03, (schedule, a.rank, analytic)


@pytest.mark.parametrize(("pp", "v", "m"), [(2, 2, 4), (2, 2, 8), (4, 2, 8), (2, 3, 4),
                                            (3, 2, 6), (4, 2, 4), (8, 2, 16)])
def test_zero_bubble_order_is_torchs(pp, v, m):
    """The analytic tier's zero-bubble action order (`layout.zero_bubble_order`, torch-free)
    is the one torch's schedule computes for every rank
    (`ScheduleInterleavedZeroBubble._calculate_single_rank_operations`, its no-op slots
    dropped)."""
    import types

    from torch.distributed.pipelining import schedules

    from hybridmem.parallel.layout import in_flight, zero_bubble_order

    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    ps = ParallelSpec(world_size=pp, pp=pp, pp_microbatches=m, pp_schedule="zero-bubble",
                      pp_virtual_stages=v)
    for rank in range(pp):
        # the attributes `__init__` sets before it calls the method
        schedule = types.SimpleNamespace(n_local_stages=v, pp_group_size=pp, _n_microbatches=m,
                                         microbatches_per_round=m // max(1, m // pp))
        ops = schedules.ScheduleInterleavedZeroBubble._calculate_single_rank_operations(
            schedule, rank)
        torch_order = [(kinds[o.computation_type.name], (o.stage_index - rank) // pp,
                        o.microbatch_index) for o in ops if o is not None]
        assert zero_bubble_order(ps, rank) == torch_order, rank
        # the in-flight count: most chunks between their F and their W in torch's order
        alive, most = set(), 0
        for kind, chunk, micro in torch_order:
            if kind == "F":
                alive.add((chunk, micro))
            elif kind == "W":
                alive.discard((chunk, micro))
            most = max(most, len(alive))
        assert in_flight(ps, rank) * v == most, rank


def test_trace_hook_keeps_no_graph_alive_across_steps():
    """(~5 s) The trace tier's saved-tensor hook makes no autograd cycle: under zero bubble (whose
    input-gradient step retains the graph) a third step peaks no higher than the second
    (with the hook returning the tensor itself, rank 1 grew 5.74 -> 7.16 MB)."""
    from hybridmem.models.loader import load_config_dict, materialize_config
    from hybridmem.parallel import trace_ranks

    model = materialize_config(json.dumps(dict(load_config_dict("tiny-llama")[1],
                                               num_hidden_layers=4)))
    spec = TrainingSpec(model=model, micro_batch=2, seq_len=32, precision="fp32",
                        attn="eager", parallel=ParallelSpec(
                            world_size=2, pp=2, pp_microbatches=4, pp_schedule="zero-bubble",
                            pp_virtual_stages=2))
    two = trace_ranks.trace_rank(spec, 1).peak()[0]
    old = trace_ranks.ITERATIONS
    trace_ranks.ITERATIONS = 3
    try:
        three = trace_ranks.trace_rank(spec, 1).peak()[0]
    finally:
        trace_ranks.ITERATIONS = old
    assert three == two
