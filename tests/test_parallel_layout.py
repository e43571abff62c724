"""Model-parallel layouts: the schema's checks, the per-rank rules, Megatron-LM's closed form.

Sources: Megatron-LM `megatron/training/theoretical_memory_usage.py` (transcribed in
experiments/megatron_side_by_side.py), torch `distributed/pipelining/schedules.py` (the warm-up
counts), Korthikanti et al. 2022 Table 2 (activations / tp under sequence parallelism).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from hybridmem.errors import SpecError
from hybridmem.job.parallel import ParallelSpec
from hybridmem.job.spec import TrainingSpec
from hybridmem.parallel.layout import in_flight, stage_layers
from hybridmem.parallel.ranks import price_ranks

ROOT = Path(__file__).resolve().parents[1]


def _megatron():
    spec = importlib.util.spec_from_file_location(
        "megatron_side_by_side", ROOT / "experiments" / "megatron_side_by_side.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while being made
    spec.loader.exec_module(mod)
    return mod


def _spec(model="tiny-llama", **par) -> TrainingSpec:
    return TrainingSpec(model=model, micro_batch=2, seq_len=128, precision="bf16",
                        attn="sdpa", parallel=ParallelSpec(**par))


BAD = [  # (spec keyword arguments, the field the one-line error names)
    (dict(world_size=6, tp=4), "parallel.world_size"),
    (dict(world_size=8, tp=2, dp_shard=3, strategy="fsdp"), "parallel.dp_shard"),
    (dict(world_size=2, tp=1, sequence_parallel=True, strategy="ddp"), "parallel.sequence_parallel"),
    (dict(world_size=4, pp=4, pp_microbatches=2), "parallel.pp_microbatches"),
    (dict(world_size=2, pp=2, pp_schedule="interleaved-1f1b"), "parallel.pp_virtual_stages"),
    (dict(world_size=2, pp=2, pp_schedule="interleaved-1f1b", pp_virtual_stages=2,
          pp_microbatches=3), "parallel.pp_microbatches"),
    (dict(world_size=8, tp=2, strategy="none"), "parallel.strategy"),
    (dict(world_size=4, tp=2, ep=4, strategy="fsdp"), "parallel.ep"),
    (dict(world_size=4, dp_replicate=2, strategy="zero3"), "parallel.dp_replicate"),
    (dict(world_size=2, pp=2, pp_schedule="nope"), "parallel.pp_schedule"),
]


@pytest.mark.parametrize("kw, field", BAD)
def test_inconsistent_layouts_are_one_line_errors(kw, field):
    with pytest.raises(SpecError) as err:
        ParallelSpec(**kw)
    assert str(err.value).startswith(field + "=") and "\n" not in str(err.value)


MODEL_BAD = [  # tiny-llama: 4 heads, 2 KV heads, ffn 128, 2 layers; tiny-mixtral: 4 experts
    ("tiny-llama", dict(world_size=4, tp=4), "parallel.tp", "2 KV heads"),
    ("tiny-llama", dict(world_size=3, tp=3), "parallel.tp", "4 attention heads"),
    ("tiny-llama", dict(world_size=4, pp=4, pp_microbatches=4), "parallel.pp", "2 layers"),
    ("tiny-llama", dict(world_size=2, ep=2, strategy="fsdp"), "parallel.ep", "no experts"),
    ("tiny-mixtral", dict(world_size=8, ep=8, strategy="fsdp"), "parallel.ep", "4 experts"),
    ("tiny-llama", dict(world_size=2, cp=2), "seq_len", "2 x cp"),
]


@pytest.mark.parametrize("model, kw, field, what", MODEL_BAD)
def test_layouts_the_model_does_not_divide(model, kw, field, what):
    spec = _spec(model, **kw)
    if model == "tiny-llama" and kw.get("cp"):
        spec = spec.with_(seq_len=126)
    if model == "tiny-mixtral":
        spec = spec.with_(precision="bf16")
    with pytest.raises(SpecError, match=what) as err:
        price_ranks(spec)
    assert str(err.value).startswith(field + "=")


def test_in_flight_follows_the_torch_schedules():
    # Schedule1F1B: warm-up min(m, pp - rank); GPipe: m; interleaved (v=2, m=8, pp=4):
    # ((v-1)*pp + 2*(pp-1-rank) + 1) / v chunk forwards -> rank 0: (4 + 6 + 1) / 2
    one = ParallelSpec(world_size=4, pp=4, pp_microbatches=8)
    assert [in_flight(one, r) for r in range(4)] == [4, 3, 2, 1]
    gpipe = dataclasses.replace(one, pp_schedule="gpipe")
    assert in_flight(gpipe, 3) == 8
    inter = dataclasses.replace(one, pp_schedule="interleaved-1f1b", pp_virtual_stages=2)
    assert in_flight(inter, 0) == 5.5 and in_flight(inter, 3) == 2.5
    # Megatron's interleaving penalty on rank 0: pp * (1 + (pp-1)/(pp*v)) = 4 * (1 + 3/8)
    assert in_flight(inter, 0) == 4 * (1 + 3 / 8)
    # zero bubble (hand count of torch's `_get_1f1b_rank_ops(enable_zero_bubble=True)`): rank
    # r's (v-1)*m/rounds + (pp-1-r) warm-up forwards, r more forward/input-gradient pairs
    # before its first W (`num_1f1b_microbatches = rank`), then one more forward: (v-1)*pp + pp
    # chunks alive on every rank, / v -> (4 + 4) / 2
    zb = dataclasses.replace(inter, pp_schedule="zero-bubble")
    assert [in_flight(zb, r) for r in range(4)] == [4, 4, 4, 4]


def test_stage_layers_loop_style():
    ps = ParallelSpec(world_size=2, pp=2, pp_schedule="interleaved-1f1b", pp_virtual_stages=2,
                      pp_microbatches=2)
    assert stage_layers(ps, 8, 0) == [0, 1, 4, 5] and stage_layers(ps, 8, 1) == [2, 3, 6, 7]


def test_tp_shards_every_linear_and_keeps_the_norms():
    """Rank params under tp=2 = (all linears + vocab) / 2 + whole norms (hand count of
    tiny-llama: h=64, q 64x64, k/v 32x64, o 64x64, gate/up/down 128x64, vocab 128)."""
    pred, _ = price_ranks(_spec(world_size=2, tp=2))
    h, ffn, vocab = 64, 128, 128
    linears = 2 * (64 * h + 2 * 32 * h + 64 * h + 3 * ffn * h) + 2 * vocab * h
    norms = 2 * 2 * h + h
    assert pred.breakdown["param"] == 2 * (linears // 2 + norms)  # bf16


def test_sequence_parallel_divides_a_layers_activations_by_tp():
    """Korthikanti et al. Table 2: with sp every activation of a layer is / tp; without, the
    norms and the residual stream stay whole, so sp holds less."""
    sp, _ = price_ranks(_spec(world_size=2, tp=2, sequence_parallel=True))
    nosp, _ = price_ranks(_spec(world_size=2, tp=2))
    single, _ = price_ranks(_spec(world_size=1))  # the same code path at tp=1
    assert sp.breakdown["activation"] < nosp.breakdown["activation"] < single.breakdown["activation"]


def test_1f1b_first_stage_is_highest_and_says_why():
    pred, ranks = price_ranks(_spec(world_size=2, pp=2, pp_microbatches=4))
    assert pred.extras["highest_rank"] == 0
    assert ranks[0].in_flight == 2 and ranks[1].in_flight == 1
    assert any("pipeline rank 0" in n and "in flight" in n for n in pred.notes)
    assert ranks[1].holds == ("lm_head + loss",)


def test_megatron_params_on_the_most_loaded_shard():
    """Megatron's `num_parameters_on_most_loaded_model_shard` (theoretical_memory_usage.py)
    for its Llama-2-70B example (t=8, p=4) equals the first rank's parameter count here
    up to the norm weights, which tp replicates and Megatron's formula divides by t."""
    meg = _megatron()
    a = meg.EXAMPLES["llama-2-70b t8 p4"]
    params, states = meg.weight_and_optimizer_bytes(a)
    # the closed form by hand: layer = 3 h f + 2 h h (1 + g/a) + 2 h; (80 layers / 4 + 8192 x
    # 32000 embedding + the final norm / 4) / 8
    layer = 3 * 8192 * 28672 + 2 * 8192 * 8192 * (1 + 8 / 64) + 2 * 8192
    assert params == pytest.approx((layer * 80 / 4 + 8192 / 4 + 8192 * 32000) / 8)
    assert states == pytest.approx(params * (6 + 12 / 2))  # distributed optimizer, d = 2
    pred, ranks = meg.ours("llama-2-70b t8 p4", "llama-2-70b")
    ours = ranks[0].breakdown["param"] / 2  # bf16
    # Megatron divides every weight by t; the two RMSNorm weights of each of the 20 layers are
    # replicated on the tp ranks (their (1 - 1/8) share more here), and the final norm's
    # share (h / (p t)) lives on the last stage, not the first
    assert ours == params + 20 * 2 * 8192 * (1 - 1 / 8) - 8192 / (4 * 8)
    # activations: the same first-stage count of in-flight micro-batches (min(m, p) = 4)
    assert ranks[0].in_flight == min(a.num_microbatches, a.pipeline_model_parallel_size)


def test_layout_advice_sorts_by_headroom_and_finds_the_smallest_count():
    """tiny-llama on a made-up 0.75 GiB GPU (the CUDA context alone is 0.5 GiB here,
    `overheads.CUDA_CONTEXT_DEFAULT`, NCCL's nominal 128 MiB on top on more than one GPU)."""
    from hybridmem.gpus import GPU
    from hybridmem.parallel.layouts import advise

    gpu = GPU(name="tiny", memory_bytes=int(0.75 * 2**30), arch="hopper", source="test")
    spec = _spec(world_size=4, strategy="fsdp")
    found = advise(spec, 4, gpu, all_layouts=True)
    rows = found["rows"]
    assert {(r["tp"], r["pp"], r["cp"]) for r in rows} >= {(1, 1, 1), (2, 1, 1), (2, 2, 1)}
    heads = [r["headroom_bytes"] for r in rows]
    assert heads == sorted(heads, reverse=True)
    assert all(r["dp"] * r["tp"] * r["pp"] * r["cp"] == 4 for r in rows)
    assert found["smallest_gpus"] == 1  # one GPU fits tiny-llama
    none = advise(spec, 4, GPU(name="none", memory_bytes=int(0.55 * 2**30), arch="hopper", source="test"))
    assert none["smallest_gpus"] is None
