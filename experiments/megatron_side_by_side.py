"""Megatron-LM's theoretical memory formula next to hybridmem's analytic per-rank peak.

Megatron's closed form, transcribed from `megatron/training/theoretical_memory_usage.py`
(NVIDIA/Megatron-LM, `compute_weight_and_optimizer_memory`, `compute_activation_memory`: the
sequence-parallel + selective-recompute branch, Korthikanti et al. 2022 Table 2), for the most
loaded rank (the first pipeline stage). Run: `python experiments/megatron_side_by_side.py`;
the table is docs/parallel.md's "Side by side with Megatron-LM".
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MegatronArgs:
    """The Megatron arguments the formula reads (names as in megatron/training/arguments.py)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    padded_vocab_size: int
    seq_length: int
    micro_batch_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    swiglu: bool
    untie_embeddings_and_output_weights: bool
    use_distributed_optimizer: bool
    num_microbatches: int
    virtual_pipeline_model_parallel_size: int | None = None
    norm_size: int = 1  # RMSNorm: 1 weight vector; LayerNorm: 2 (weight and bias)


def weight_and_optimizer_bytes(a: MegatronArgs) -> tuple[float, float]:
    """(parameters on the most loaded shard, their bytes): `compute_weight_and_optimizer_memory`."""
    h, gated = a.hidden_size, 1.5 if a.swiglu else 1.0
    attn = 2 * h * h * (1 + a.num_query_groups / a.num_attention_heads)  # kv_channels = h / heads
    layer = 2 * h * (a.ffn_hidden_size * gated + a.norm_size) + attn
    block = layer * a.num_layers + a.norm_size * h
    embedding = h * a.padded_vocab_size
    shard = (block / a.pipeline_model_parallel_size + embedding) / a.tensor_model_parallel_size
    if a.untie_embeddings_and_output_weights and a.pipeline_model_parallel_size == 1:
        shard += embedding / a.tensor_model_parallel_size
    per_param = 6 + 12 / a.data_parallel_size if a.use_distributed_optimizer else 18
    return shard, shard * per_param


def activation_bytes(a: MegatronArgs) -> float:
    """`compute_activation_memory` (sequence parallel, selective recompute): first stage."""
    s, b, h, p = a.seq_length, a.micro_batch_size, a.hidden_size, a.pipeline_model_parallel_size
    act = s * b * h * (18 + 4 * a.ffn_hidden_size / h) * a.num_layers
    act += 8 * s * b * p + s * b * h * p  # embedding input and its dropout, p in flight
    if a.virtual_pipeline_model_parallel_size is not None:
        act *= 1 + (p - 1) / (p * a.virtual_pipeline_model_parallel_size)
    elif p > 1:
        act *= min(1, a.num_microbatches / p)
    if p == 1:
        act += s * b * h * 4 * (1 + a.padded_vocab_size / h)
    return act / a.tensor_model_parallel_size


# Megatron's own examples: GPT-3 175B (Korthikanti et al. 2022, Table 3: t=8, p=8, s=2048,
# micro-batch 1, 96 layers, h=12288, 96 heads; vocab 51200 padded) and Llama-2-70B
# (examples/llama: 80 layers, h=8192, ffn 28672, GQA 8 groups, vocab 32000, s=4096; t=8, p=4).
EXAMPLES: dict[str, MegatronArgs] = {
    "gpt3-175b t8 p8": MegatronArgs(
        num_layers=96, hidden_size=12288, ffn_hidden_size=4 * 12288, num_attention_heads=96,
        num_query_groups=96, padded_vocab_size=51200, seq_length=2048, micro_batch_size=1,
        tensor_model_parallel_size=8, pipeline_model_parallel_size=8, data_parallel_size=8,
        swiglu=False, untie_embeddings_and_output_weights=False, use_distributed_optimizer=True,
        num_microbatches=64, norm_size=2),
    "llama-2-70b t8 p4": MegatronArgs(
        num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
        num_query_groups=8, padded_vocab_size=32000, seq_length=4096, micro_batch_size=1,
        tensor_model_parallel_size=8, pipeline_model_parallel_size=4, data_parallel_size=2,
        swiglu=True, untie_embeddings_and_output_weights=True, use_distributed_optimizer=True,
        num_microbatches=8),
    "llama-2-70b t8 p4 v5": MegatronArgs(
        num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
        num_query_groups=8, padded_vocab_size=32000, seq_length=4096, micro_batch_size=1,
        tensor_model_parallel_size=8, pipeline_model_parallel_size=4, data_parallel_size=2,
        swiglu=True, untie_embeddings_and_output_weights=True, use_distributed_optimizer=True,
        num_microbatches=8, virtual_pipeline_model_parallel_size=5),
}


def megatron(a: MegatronArgs) -> dict[str, float]:
    params, states = weight_and_optimizer_bytes(a)
    return {"params": params, "weights_optimizer": states, "activation": activation_bytes(a)}



GPT3_STANDIN = {
    "_source": "GPT-3 175B dims (Brown et al. 2020 Table 2.1) in Llama form: SwiGLU with ffn "
               "8h/3 = 32768 has the 4h GELU MLP's parameter count; tied embeddings",
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 12288, "intermediate_size": 32768, "num_attention_heads": 96,
    "num_key_value_heads": 96, "num_hidden_layers": 96, "vocab_size": 51200,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
}
"""GPT-3 175B as a family hybridmem prices (GPT-3 is not one): same widths and depth."""


def ours(name: str, model: str):
    """hybridmem's analytic per-rank answer for the example's layout (bf16 weights with fp32
    master weights sharded over dp: `--precision bf16-master --zero-stage 1`, Megatron's
    distributed optimizer; flash attention, which saves what selective recompute keeps)."""
    from hybridmem.job.parallel import ParallelSpec
    from hybridmem.job.spec import TrainingSpec
    from hybridmem.parallel.ranks import price_ranks

    a = EXAMPLES[name]
    t, p, d = a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.data_parallel_size
    v = a.virtual_pipeline_model_parallel_size
    ps = ParallelSpec(world_size=t * p * d, strategy="zero1", tp=t, sequence_parallel=True,
                      pp=p, pp_microbatches=a.num_microbatches,
                      pp_schedule="interleaved-1f1b" if v else "1f1b", pp_virtual_stages=v or 1)
    spec = TrainingSpec(model=model, micro_batch=a.micro_batch_size, seq_len=a.seq_length,
                        precision="bf16-master", attn="flash_attention_2", parallel=ps)
    return price_ranks(spec)


def table() -> list[tuple]:
    import json
    import tempfile
    from pathlib import Path

    gpt3 = Path(tempfile.mkdtemp()) / "gpt3-175b.json"
    gpt3.write_text(json.dumps(GPT3_STANDIN))
    models = {"gpt3-175b t8 p8": str(gpt3)}
    rows = []
    for name in EXAMPLES:
        m = megatron(EXAMPLES[name])
        pred, ranks = ours(name, models.get(name, "llama-2-70b"))
        b = pred.breakdown
        rank0 = ranks[0].breakdown
        rows.append((name, m["params"], m["weights_optimizer"], m["activation"],
                     rank0["param"] / 2, rank0["param"] + rank0["grad"] + rank0["optimizer"],
                     rank0["activation"], pred.extras["highest_rank"],
                     sum(b.values())))
    return rows


if __name__ == "__main__":  # pragma: no cover - prints the docs table
    G = 2**30
    print("| example | Megatron params/rank | Megatron weights+optimizer | Megatron activations |"
          " ours params/rank (rank 0) | ours weights+grads+optimizer | ours activations | "
          "difference (ours - Megatron, w+o / act) | ours highest rank, device peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in table():
        print(f"| {r[0]} | {r[1] / 1e9:.3f} B | {r[2] / G:.2f} GiB | {r[3] / G:.2f} GiB | "
              f"{r[4] / 1e9:.3f} B | {r[5] / G:.2f} GiB | {r[6] / G:.2f} GiB | "
              f"{(r[5] - r[2]) / G:+.2f} / {(r[6] - r[3]) / G:+.2f} GiB | rank {r[7]}, "
              f"{r[8] / G:.2f} GiB |")
