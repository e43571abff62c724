"""Expert parallelism in the trace tier against a real CPU run, and the analytic tier.

tiny Mixtral (4 experts, top-2, 2 layers), bf16 (the experts' grouped matmul runs bf16 only
under fake tensors), ep = 2 over dp_shard = 2 with FSDP2, torchtitan's MoE layout: the experts
split by transformers' own expert-parallel plan (`MixtralConfig.base_model_ep_plan`,
`AllToAllEP`), rank 0 under torch's fake process group (`parallel.trace_experts`). The oracle
is the same code on real CPU tensors (the split sizes then read from the router's real
choices), live storage bytes counted by the same tracker.
"""

from __future__ import annotations

import pytest

from hybridmem.job.parallel import ParallelSpec
from hybridmem.job.spec import TrainingSpec

SPEC = TrainingSpec(model="tiny-mixtral", micro_batch=2, seq_len=32, precision="bf16",
                    attn="eager", parallel=ParallelSpec(world_size=2, ep=2, strategy="fsdp"))


@pytest.fixture(scope="module")
def traced():
    from hybridmem.parallel.trace_ranks import trace_rank

    return trace_rank(SPEC), trace_rank(SPEC, backend="real")


def test_fake_expert_parallel_rank_equals_the_real_run(traced):
    fake, real = traced
    assert fake.peak(rounded=False) == real.peak(rounded=False)
    assert (fake.param, fake.grad, fake.optimizer, fake.layer_saved) == (
        real.param, real.grad, real.optimizer, real.layer_saved)


def test_the_rank_holds_half_the_experts(traced):
    """Expert weights per layer: 4 experts x (2 x 96 x 64 + 64 x 96) bf16 in all; the rank's
    FSDP shard (dp_shard 2) of the dense weights and its 2 experts (dp_shard / ep = 1: whole)."""
    fake, _ = traced
    experts_all = 2 * 4 * (2 * 96 * 64 + 64 * 96) * 2  # 2 layers, bf16 (hand count)
    # dense: embedding + lm_head 2 x 128 x 64, per layer q,o 64x64, k,v 32x64, router 4x64,
    # 2 norms x 64; final norm 64 -- halved by FSDP2 over 2 ranks (even rows here)
    dense = (2 * 128 * 64 + 2 * (2 * 64 * 64 + 2 * 32 * 64 + 4 * 64 + 2 * 64) + 64) * 2 // 2
    assert fake.param == experts_all // 2 + dense


def test_analytic_against_the_traced_rank(traced):
    """The analytic rank within 3 % of the traced one, its activations too: the saved tensors
    transformers' `AllToAllEP` adds to the local experts' (`ranks._expert_parallel_saved`)
    and FSDP2's gathers per point with each layer's experts a unit of their own over
    `dp_shard / ep` (`fsdp_points.with_inner`: here a mesh of one rank, no flat buffer)."""
    from hybridmem.parallel.ranks import price_ranks
    from hybridmem.trace.tracker import round_size

    fake, _ = traced
    pred, _ = price_ranks(SPEC)
    allocated, at = fake.peak()
    acts = sum(round_size(s.nbytes) for s in fake.tracker.live_at(at)
               if s.category == "activation")
    assert abs(pred.breakdown["activation"] / acts - 1) < 0.03
    assert abs(pred.peak.allocated_bytes / allocated - 1) < 0.03


def test_fp32_experts_are_a_one_line_refusal():
    from hybridmem.errors import SpecError
    from hybridmem.parallel.trace_ranks import trace_rank

    with pytest.raises(SpecError, match="precision") as err:
        trace_rank(SPEC.with_(precision="fp32"))
    assert "\n" not in str(err.value)
