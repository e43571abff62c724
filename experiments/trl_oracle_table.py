"""The issue-31 table: the real training libraries on CPU against the trace and analytic tiers.

For each objective x reference x precision (TRL's SFT, DPO, ORPO, KTO, RM, GRPO at
`num_iterations` 1 and 2, SFT's packing / padding-free / completion-only paths) and for
transformers' `Trainer` with its collators (`DataCollatorForLanguageModeling`,
`DataCollatorForSeq2Seq(pad_to_multiple_of=64)`, `DataCollatorWithFlattening`), on one batch
and over one epoch of a variable-length dataset under the random and the `group_by_length`
samplers: the real step's peak (live bytes counted by storage with CUDA's 512-byte rounding,
`tests/test_trl_oracle.real_peak`: tiny Llama built from a config, in-memory datasets through
the trainer's own collator, TRL's checkpointing default on), the trace tier on the path the
CPU run executes (TRL's torch fold of its fused head), its difference to the real peak, and
both tiers on the path a GPU runs (the Triton fold) with the analytic tier's difference to the
trace's. The epoch rows price the dataset's lengths (`--lengths`, the same sampler and
`pad_to_multiple_of`): the tiers' allocated peak is the largest batch's. Bytes of tensors (no
cuBLAS workspace). One JSON line per row as it is measured, then the Markdown table.

    PYTHONPATH=. python experiments/trl_oracle_table.py            # every row (~5 min, 2 cores)
    PYTHONPATH=. python experiments/trl_oracle_table.py --trainer  # transformers' Trainer only
    PYTHONPATH=. python experiments/trl_oracle_table.py --3b       # the issue's 3B case, scaled
    PYTHONPATH=. python experiments/trl_oracle_table.py --kto      # KTO's rows only
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import test_trl_oracle as T  # noqa: E402
from test_trace import DataPtrCounter  # noqa: E402
from hybridmem import trace  # noqa: E402
from hybridmem.analytic import estimate as analytic  # noqa: E402
from hybridmem.job.spec import TrainingSpec  # noqa: E402
from hybridmem.objectives import steps  # noqa: E402

ROWS: list[dict] = []


def tensors(p) -> int:
    return p.peak.allocated_bytes - p.breakdown["workspace"]


def row(objective: str, ref: str, precision: str, real: int, spec: TrainingSpec,
        price=None) -> None:
    """One row: `price(spec, method)` answers a tier (a lengths job goes through `predict`)."""
    price = price or (lambda s, m: (trace.estimate(s) if m == "trace" else analytic(s)))
    with steps.head_path("torch"):
        cpu = tensors(price(spec, "trace"))
    gpu, an = tensors(price(spec, "trace")), tensors(price(spec, "analytic"))
    out = dict(objective=objective, ref=ref, precision=precision, real=real, trace_cpu=cpu,
               trace_minus_real=cpu - real, trace_gpu=gpu, analytic=an,
               analytic_minus_trace_gpu=an - gpu,
               analytic_vs_trace_gpu_pct=round(100 * (an - gpu) / gpu, 2))
    ROWS.append(out)
    print(json.dumps(out), flush=True)


def spec(config: str, seq: int, precision: str, **kw) -> TrainingSpec:
    return TrainingSpec(model=config, micro_batch=T.BATCH, seq_len=seq, precision=precision,
                        optimizer="sgd", attn="sdpa", grad_ckpt=True, **kw)


def pair_rows(small: str) -> None:
    """The reward model and ORPO (trl.experimental)."""
    for which in ("rm", "orpo"):
        for precision in ("fp32", "bf16"):
            trainer = T.pair_trainer(which, small, T.PRECISION[precision])
            seq = T.padded_length(trainer)
            real, _ = T.real_peak(trainer)
            row(which.upper(), "-", precision, real, spec(small, seq, precision, objective=which))


def kto_rows(small: str) -> None:
    """KTOTrainer with each reference (`tests/test_trl_oracle.kto_trainer`)."""
    for precision in ("fp32", "bf16"):
        for ref in ("separate", "precomputed", "adapter"):
            real, seq = T.real_peak(T.kto_trainer(small, T.PRECISION[precision], ref))
            row("KTO", ref, precision, real,
                spec(small, seq, precision, objective="kto", ref_model=ref,
                     train="lora" if ref == "adapter" else "full"))


# ---------------------------------------------------------------- transformers' Trainer

# one epoch of 8 samples of varied lengths, 2 per batch, capped at 128 tokens (`seq_len`)
EPOCH = [40, 128, 64, 100, 90, 30, 128, 70]
CAP = 128


def collators():
    from transformers import (DataCollatorForLanguageModeling, DataCollatorForSeq2Seq,
                              DataCollatorWithFlattening)

    tok = T.tokenizer(T.DPO_VOCAB)
    # the LM collator makes the labels from the ids; the others take the dataset's
    return {"lm": (DataCollatorForLanguageModeling(tok, mlm=False), {}),
            "seq2seq-64": (DataCollatorForSeq2Seq(tok, pad_to_multiple_of=64),
                           {"pad_multiple": 64}),
            "flattening": (DataCollatorWithFlattening(), {"packing": True})}


def trainer_for(config: str, collator, lengths: list[int], sampler: str = "random"):
    """transformers' Trainer on rows of `lengths` tokens; a `labels` column unless the
    collator makes its own (`DataCollatorForLanguageModeling`)."""
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    ids = T.token_rows(lengths, T.DPO_VOCAB)
    data = {"input_ids": ids} if isinstance(collator, DataCollatorForLanguageModeling) \
        else {"input_ids": ids, "labels": ids}
    return Trainer(model=T.model_from(config, torch.float32),
                   args=TrainingArguments(**T.TRAINER_ARGS, train_sampling_strategy=sampler),
                   train_dataset=Dataset.from_dict(data), data_collator=collator)


def epoch_peak(config: str, collator, lengths: list[int], sampler: str) -> int:
    """Peak live bytes of one epoch of transformers' Trainer loop (`_inner_training_loop`'s
    pieces per batch: `get_batch_samples`, `training_step`, `optimizer.step()`,
    `zero_grad()`), each batch counted from when the loader hands it over."""
    trainer = trainer_for(config, collator, lengths, sampler)
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1
    model = trainer.model
    counter = DataPtrCounter([*model.parameters(), *model.buffers()])
    loader = iter(trainer.get_train_dataloader())
    for _ in range(len(lengths) // T.BATCH):
        batches, num_items = trainer.get_batch_samples(loader, 1, trainer.args.device)
        batch = batches[0]
        for v in [*batch.values(), num_items]:
            if isinstance(v, torch.Tensor):
                counter._add(v.untyped_storage())
        with counter:
            trainer.training_step(model, dict(batch), num_items)
            trainer.optimizer.step()
            model.zero_grad()
        del batches, batch, num_items
    return counter.peak


def lengths_price(path: str):
    """A tier's answer over the lengths file (`predict`: the largest batch's allocated peak)."""
    from hybridmem.predict import predict

    def price(s: TrainingSpec, method: str):
        return predict(s.with_(lengths=path), method=method)
    return price


def trainer_rows(root: pathlib.Path, config: str) -> None:
    # one batch of 100 + 60 tokens (the tests' case), then one epoch of `EPOCH`
    for name, (collator, kw) in collators().items():
        real, seq = T.real_peak(trainer_for(config, collator, [100, 60]))
        packed = bool(kw.get("packing"))  # the collators pad 100 + 60 unless they flatten
        s = TrainingSpec(model=config, micro_batch=T.BATCH, seq_len=80 if packed else seq,
                         precision="fp32", optimizer="sgd", attn="sdpa", packing=packed,
                         padded=not packed)
        row(f"Trainer + {name}, one batch (100 + 60)", "-", "fp32", real, s)
    path = root / "lengths.txt"
    path.write_text("\n".join(map(str, EPOCH)) + "\n")
    for sampler in ("random", "group_by_length"):
        for name, (collator, kw) in collators().items():
            real = epoch_peak(config, collator, EPOCH, sampler)
            s = TrainingSpec(model=config, micro_batch=T.BATCH, seq_len=CAP,
                             precision="fp32", optimizer="sgd", attn="sdpa", sampler=sampler,
                             seed=T.TRAINER_ARGS["seed"], **kw)
            row(f"Trainer + {name}, epoch {EPOCH} ({sampler})", "-", "fp32", real, s,
                lengths_price(str(path)))


# ---------------------------------------------------------------- the 3B case, scaled

LLAMA3_VOCAB = 128256  # Llama-3.2-3B's vocabulary (its config.json `vocab_size`)


def sft_lora_trainer(config: str, seq: int, dtype):
    """transformers' Trainer (full logits into ForCausalLMLoss) on a LoRA model (hybridmem's
    default targets), checkpointing on (non-reentrant, as TRL's configs set it), two rows of
    `seq` tokens: the issue's SFT job, scaled."""
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    lora = LoraConfig(r=8, lora_alpha=16, target_modules=list(T.LORA_TARGETS),
                      lora_dropout=0.0)
    model = get_peft_model(T.model_from(config, dtype), lora)
    args = TrainingArguments(**T.TRAINER_ARGS, gradient_checkpointing=True,
                             gradient_checkpointing_kwargs={"use_reentrant": False})
    return Trainer(model=model, args=args,
                   train_dataset=Dataset.from_dict({"input_ids": T.token_rows([seq, seq],
                                                                              T.DPO_VOCAB)}),
                   data_collator=DataCollatorForLanguageModeling(T.tokenizer(T.DPO_VOCAB),
                                                                 mlm=False))


def scaled_3b_rows(root: pathlib.Path) -> None:
    """Llama-3.2-3B LoRA, micro-batch 2, bf16, checkpointing: SFT (transformers' Trainer) and
    DPO with the adapter-disabled reference, on the tiny Llama with Llama 3's vocabulary (the
    head's share of the step, what decides the case), DPO's padded pairs (110 tokens) and SFT
    at the same length."""
    (root / "v128k").mkdir()
    config = T.tiny_config(root / "v128k", LLAMA3_VOCAB)
    dpo = T.dpo_trainer(config, torch.bfloat16, "adapter")
    seq = T.padded_length(dpo)
    real, _ = T.real_peak(dpo)
    row("3B case scaled: DPO", "adapter", "bf16", real,
        spec(config, seq, "bf16", objective="dpo", ref_model="adapter", train="lora"))
    real, seq_sft = T.real_peak(sft_lora_trainer(config, seq, torch.bfloat16))
    row("3B case scaled: SFT (Trainer)", "-", "bf16", real,
        spec(config, seq_sft, "bf16", train="lora"))


def main() -> None:
    warnings.simplefilter("ignore")
    root = pathlib.Path(tempfile.mkdtemp())
    (root / "sft").mkdir()
    (root / "small").mkdir()
    big, small = T.tiny_config(root / "sft"), T.tiny_config(root / "small", T.DPO_VOCAB)
    if "--3b" in sys.argv:
        scaled_3b_rows(root)
        return table()
    if "--kto" in sys.argv:
        kto_rows(small)
        return table()
    trainer_rows(root, small)
    if "--trainer" in sys.argv:
        return table()
    scaled_3b_rows(root)
    for precision in ("fp32", "bf16"):
        real, seq = T.real_peak(T.sft_trainer(big, [T.SEQ, T.SEQ // 2],
                                              T.PRECISION[precision]))
        row("SFT (SFTTrainer)", "-", precision, real, spec(big, seq, precision, trainer="trl"))
    for variant in ("packing", "padding_free", "completion_only"):
        real, seq = T.real_peak(T.sft_variant(small, variant))
        packed = variant != "completion_only"
        row(f"SFT (SFTTrainer, {variant})", "-", "fp32", real,
            spec(small, seq // 2 if packed else seq, "fp32", trainer="trl", packing=packed))
    for precision in ("fp32", "bf16"):
        for ref in ("separate", "precomputed", "adapter"):
            real, seq = T.real_peak(T.dpo_trainer(small, T.PRECISION[precision], ref))
            row("DPO", ref, precision, real,
                spec(small, seq, precision, objective="dpo", ref_model=ref,
                     train="lora" if ref == "adapter" else "full"))
    kto_rows(small)
    pair_rows(small)
    for precision in ("fp32", "bf16"):
        for ni in (1, 2):
            # GRPOConfig's bf16=True default under GRPOTrainer's own autocast: fp32 weights
            # run bf16-mixed (tests/test_trl_oracle.py)
            real, _ = T.real_peak(T.grpo_trainer(small, ni, T.PRECISION[precision]))
            row(f"GRPO (num_iterations {ni})", "-",
                "fp32 (bf16 autocast)" if precision == "fp32" else precision, real,
                T.grpo_spec(small, ni, "bf16-mixed" if precision == "fp32" else precision))
    table()


def table() -> None:
    head = ("objective", "ref", "precision", "real", "trace (CPU)", "trace - real",
            "trace (GPU)", "analytic (GPU)", "analytic - trace (GPU)")
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in ROWS:
        cells = (r["objective"], r["ref"], r["precision"], r["real"], r["trace_cpu"],
                 r["trace_minus_real"], r["trace_gpu"], r["analytic"],
                 f'{r["analytic_minus_trace_gpu"]} ({r["analytic_vs_trace_gpu_pct"]:+.2f} %)')
        print("| " + " | ".join(f"{c:,}".replace(",", " ") if isinstance(c, int) else str(c)
                                for c in cells) + " |")


if __name__ == "__main__":
    main()
