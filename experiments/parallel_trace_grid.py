"""Per-rank peaks of the model-parallel layouts: real CPU run vs trace tier vs analytic tier.

Each layout's every rank that differs (all pipeline ranks; rank 0 of tp / ep) is run three
ways: torch's / transformers' parallel code on real CPU tensors under the fake process group
(live storage bytes), the same code on fake tensors (the trace tier), and the analytic
per-rank tier. Real and trace are unrounded live bytes; "trace (alloc.)" and "analytic" are
CUDA-rounded allocated bytes (512 B blocks), which is what the tiers answer.

    python experiments/parallel_trace_grid.py      # prints the markdown table (~90 s)
"""

from __future__ import annotations

import json

from hybridmem.categories import TENSOR_CATEGORIES
from hybridmem.job.parallel import ParallelSpec
from hybridmem.job.spec import TrainingSpec
from hybridmem.models.loader import load_config_dict, materialize_config
from hybridmem.parallel.ranks import price_ranks
from hybridmem.parallel.trace_ranks import trace_rank


def _llama(layers: int = 2) -> str:
    if layers == 2:
        return "tiny-llama"
    return materialize_config(json.dumps(dict(load_config_dict("tiny-llama")[1],
                                              num_hidden_layers=layers)))


def layouts() -> list[tuple[str, TrainingSpec]]:
    def spec(model, ps, precision="fp32", attn="eager"):
        return TrainingSpec(model=model, micro_batch=2, seq_len=32, precision=precision,
                            attn=attn, parallel=ps)

    return [
        ("tiny-llama tp 2", spec("tiny-llama", ParallelSpec(world_size=2, tp=2))),
        ("tiny-llama tp 2 + sp", spec("tiny-llama", ParallelSpec(
            world_size=2, tp=2, sequence_parallel=True), attn="sdpa")),
        ("tiny-llama pp 2 1f1b, 4 micro-batches", spec("tiny-llama", ParallelSpec(
            world_size=2, pp=2, pp_microbatches=4))),
        ("tiny-llama pp 2 gpipe, 4 micro-batches", spec("tiny-llama", ParallelSpec(
            world_size=2, pp=2, pp_microbatches=4, pp_schedule="gpipe"))),
        ("3-layer tiny-llama pp 2 1f1b (uneven: 2 + 1 layers)", spec(_llama(3), ParallelSpec(
            world_size=2, pp=2, pp_microbatches=4))),
        ("4-layer tiny-llama pp 2 interleaved-1f1b, 2 stages/rank", spec(_llama(4), ParallelSpec(
            world_size=2, pp=2, pp_microbatches=4, pp_schedule="interleaved-1f1b",
            pp_virtual_stages=2))),
        ("4-layer tiny-llama pp 2 zero-bubble, 2 stages/rank", spec(_llama(4), ParallelSpec(
            world_size=2, pp=2, pp_microbatches=4, pp_schedule="zero-bubble",
            pp_virtual_stages=2))),
        ("tiny-mixtral FSDP 2 x ep 2 (bf16)", spec("tiny-mixtral", ParallelSpec(
            world_size=2, ep=2, strategy="fsdp"), precision="bf16")),
        ("tiny-llama FSDP 2 x tp 2", spec("tiny-llama", ParallelSpec(
            world_size=4, tp=2, strategy="fsdp"))),
    ]


def main() -> None:
    print("| layout | rank | real run (live B) | trace (live B) | trace (alloc. B) | analytic "
          "(alloc. B) | analytic / trace |")
    print("|---|---|---|---|---|---|---|")
    for name, spec in layouts():
        _, answers = price_ranks(spec)
        for a in answers:
            fake = trace_rank(spec, a.rank)
            real = trace_rank(spec, a.rank, backend="real")
            analytic = sum(a.breakdown[c] for c in TENSOR_CATEGORIES)
            alloc = fake.peak()[0]
            print(f"| {name} | {a.rank} | {real.peak(rounded=False)[0]:,} | "
                  f"{fake.peak(rounded=False)[0]:,} | {alloc:,} | {analytic:,} | "
                  f"{analytic / alloc - 1:+.1%} |")


if __name__ == "__main__":
    main()
