"""The issue-31 table: TRL's real trainers on CPU against the trace and analytic tiers.

For each objective x reference x precision: the real step's peak (two Trainer-loop steps on
CPU, `tests/test_trl_oracle.real_peak`, tiny Llama built from a config, in-memory datasets of
varied lengths through the trainer's own collator, checkpointing on as TRL's configs default),
the trace tier on TRL's torch fold (what the CPU run executes), its difference to the real
peak, the trace tier's GPU (Triton) path and the analytic tier (what a GPU user is told).
Bytes of tensors (no cuBLAS workspace). Prints one JSON line per row.

    PYTHONPATH=. python experiments/trl_table.py            # SFT, DPO, GRPO, KTO, RM, ORPO
    PYTHONPATH=. python experiments/trl_table.py --grpo     # GRPO only
    PYTHONPATH=. python experiments/trl_table.py --sft      # GRPO, SFT's data paths
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import test_trl_oracle as T  # noqa: E402
from hybridmem import trace  # noqa: E402
from hybridmem.analytic import estimate as analytic  # noqa: E402
from hybridmem.job.spec import TrainingSpec  # noqa: E402
from hybridmem.objectives import steps  # noqa: E402


def tensors(p) -> int:
    return p.peak.allocated_bytes - p.breakdown["workspace"]


def row(objective: str, ref: str, precision: str, real: int, spec: TrainingSpec) -> None:
    with steps.head_path("torch"):
        cpu = tensors(trace.estimate(spec))
    gpu, an = tensors(trace.estimate(spec)), tensors(analytic(spec))
    print(json.dumps(dict(objective=objective, ref=ref, precision=precision, real=real,
                          trace_cpu=cpu, trace_minus_real=cpu - real, trace_gpu=gpu,
                          analytic=an, analytic_vs_trace_gpu_pct=round(100 * (an - gpu) / gpu,
                                                                       2))), flush=True)


def spec(config: str, seq: int, precision: str, **kw) -> TrainingSpec:
    return TrainingSpec(model=config, micro_batch=T.BATCH, seq_len=seq, precision=precision,
                        optimizer="sgd", attn="sdpa", grad_ckpt=True, **kw)


def others(which: str, config: str, dtype):
    """KTO, the reward model and ORPO (trl.experimental)."""
    if which == "kto":
        return T.kto_trainer(config, dtype), {"objective": "kto", "ref_model": "separate"}
    return T.pair_trainer(which, config, dtype), {"objective": which}


def main() -> None:
    warnings.simplefilter("ignore")
    root = pathlib.Path(tempfile.mkdtemp())
    (root / "sft").mkdir()
    (root / "small").mkdir()
    big, small = T.tiny_config(root / "sft"), T.tiny_config(root / "small", T.DPO_VOCAB)
    for precision in ("fp32", "bf16"):
        for ni in (1, 2):
            # GRPOConfig's bf16=True default under GRPOTrainer's own autocast: fp32 weights
            # run bf16-mixed (tests/test_trl_oracle.py)
            real, _ = T.real_peak(T.grpo_trainer(small, ni, T.PRECISION[precision]))
            row(f"grpo (num_iterations {ni})", "-", precision, real,
                T.grpo_spec(small, ni, "bf16-mixed" if precision == "fp32" else precision))
    if "--grpo" in sys.argv:
        return
    for variant in ("packing", "padding_free", "completion_only"):
        real, seq = T.real_peak(T.sft_variant(small, variant))
        packed = variant != "completion_only"
        row(f"sft (SFTTrainer, {variant})", "-", "fp32", real,
            spec(small, seq // 2 if packed else seq, "fp32", trainer="trl", packing=packed))
    if "--sft" in sys.argv:
        return
    for precision in ("fp32", "bf16"):
        real, seq = T.real_peak(T.sft_trainer(big, [T.SEQ, T.SEQ // 2],
                                              T.PRECISION[precision]))
        row("sft (SFTTrainer)", "-", precision, real, spec(big, seq, precision, trainer="trl"))
    for precision in ("fp32", "bf16"):
        for ref in ("separate", "precomputed", "adapter"):
            real, seq = T.real_peak(T.dpo_trainer(small, T.PRECISION[precision], ref))
            row("dpo", ref, precision, real,
                spec(small, seq, precision, objective="dpo", ref_model=ref,
                     train="lora" if ref == "adapter" else "full"))
    for which in ("kto", "rm", "orpo"):
        for precision in ("fp32", "bf16"):
            trainer, kw = others(which, small, T.PRECISION[precision])
            seq = T.padded_length(trainer)
            real, _ = T.real_peak(trainer)
            row(which, kw.get("ref_model", "-"), precision, real, spec(small, seq, precision,
                                                                        **kw))


if __name__ == "__main__":
    main()
