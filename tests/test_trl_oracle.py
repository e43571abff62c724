"""TRL's own trainers as oracles: two real `training_step`s on CPU against both tiers.

Each test builds a tiny Llama from a config, an in-memory dataset of varied lengths
(`datasets.Dataset.from_dict`) and the trainer with its own collator, then runs the Trainer
loop's pieces twice: `get_batch_samples` (the loop's `num_items_in_batch`), `training_step`,
`optimizer.step()`, `model.zero_grad()` (transformers trainer.py `_inner_training_loop`). Live
bytes are counted by storage address with CUDA's 512-byte rounding (`DataPtrCounter`,
independent of the trace tier's tracker). The trace tier runs TRL's own code for the installed
TRL (`objectives.fused_head`); on CPU TRL folds the fused head's tiles in torch, so the trace is
asked for that path (`steps.head_path("torch")`); the GPU path it prices by default is
checked against the analytic tier.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from test_trace import DataPtrCounter  # noqa: E402

from hybridmem.job.spec import TrainingSpec  # noqa: E402
from hybridmem.models import load_config  # noqa: E402
from hybridmem.objectives import steps  # noqa: E402
from hybridmem.trace import runner  # noqa: E402

# the issue's case scaled to a 2-core test: vocab 32,000 (Llama 2's), fp32 full fine-tuning;
# 2 layers of hidden 64 keep the head the step's high point, as on the small Llama
VOCAB, HIDDEN, SEQ, BATCH = 32000, 64, 128, 2


def tiny_config(tmp_path, vocab: int = VOCAB) -> str:
    """A Llama config JSON (no hub): the trace tier's `--model` and the real model's config."""
    cfg = dict(model_type="llama", vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
               max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0,
               bos_token_id=1, eos_token_id=1, torch_dtype="float32")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def tokenizer(vocab: int):
    """A word-level tokenizer built in memory (`tokenizers`; no hub): TRL's collators read its
    pad and EOS ids."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<pad>")


def model_from(config: str, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(config)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(dtype)


def token_rows(lengths: list[int], vocab: int) -> list[list[int]]:
    """Token ids 2.. (0 pads, 1 ends), one row per length."""
    return [[2 + (7 * j + i) % (vocab - 2) for j in range(n)] for i, n in enumerate(lengths)]


TRAINER_ARGS = dict(output_dir="unused", per_device_train_batch_size=BATCH, report_to=[],
                    use_cpu=True, optim="sgd", learning_rate=1e-3, save_strategy="no",
                    logging_strategy="no", dataloader_num_workers=0, seed=0)


def real_peak(trainer) -> tuple[int, int]:
    """Peak live bytes of two steps of the Trainer loop on the trainer's first batch, and the
    batch's padded length (the job's `seq_len`). Checkpointing as `Trainer.train` turns it on
    (`activation_checkpointing`, TRL's configs' default: the jobs below say `grad_ckpt`)."""
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # set by `_inner_training_loop`
    args, model = trainer.args, trainer.model
    # as `Trainer.train` enables it (TRL's configs: on); transformers 4.x names it
    # `gradient_checkpointing` (TRL sets its `use_reentrant=False` there)
    if getattr(args, "activation_checkpointing", args.gradient_checkpointing):
        kwargs = (getattr(args, "activation_checkpointing_kwargs", None)
                  or args.gradient_checkpointing_kwargs or None)
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    batches, num_items = trainer.get_batch_samples(iter(trainer.get_train_dataloader()), 1,
                                                   trainer.args.device)
    batch = batches[0]
    ref = getattr(trainer, "ref_model", None)  # DPOTrainer's separate reference
    mapping = isinstance(batch, Mapping)  # a dict or a BatchEncoding; GRPO: a list of examples
    values = batch.values() if mapping else ()
    start = [*model.parameters(), *model.buffers(),
             *([*ref.parameters(), *ref.buffers()] if ref is not None else []),
             *(v for v in [*values, num_items] if isinstance(v, torch.Tensor))]
    counter = DataPtrCounter(start)
    with counter:
        for _ in range(2):
            trainer.training_step(model, dict(batch) if mapping else list(batch), num_items)
            trainer.optimizer.step()
            model.zero_grad()
    ids = batch.get("input_ids") if mapping else None
    return counter.peak, ids.shape[1] if ids is not None else 0


def sft_trainer(config: str, lengths: list[int], dtype=torch.float32, **sft_args):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SFTTrainer(model=model_from(config, dtype),
                          args=SFTConfig(**TRAINER_ARGS, max_length=None, **sft_args),
                          train_dataset=Dataset.from_dict({"input_ids": token_rows(lengths,
                                                                                   VOCAB)}),
                          processing_class=tokenizer(VOCAB))


def hf_trainer(config: str, lengths: list[int], dtype=torch.float32):
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    return Trainer(model=model_from(config, dtype), args=TrainingArguments(**TRAINER_ARGS),
                   train_dataset=Dataset.from_dict({"input_ids": token_rows(lengths, VOCAB)}),
                   data_collator=DataCollatorForLanguageModeling(tokenizer(VOCAB), mlm=False))


def trace_peak(spec: TrainingSpec, path: str = "torch") -> int:
    with steps.head_path(path):
        tracker, _ = runner.trace(spec, load_config(spec.model))
    return int(tracker.live_curve(device_only=False).max())  # host scalars are real on CPU


PRECISION = {"fp32": torch.float32, "bf16": torch.bfloat16}


# `compat` only where the compat stack (transformers 4.57.1) also agrees: there the fp32 SFT and
# DPO real steps peak 12.5 MB / 28.0 MB below the trace, a difference not yet explained
# (docs/objectives.md); bf16 agrees to the byte on both stacks
COMPAT = pytest.mark.compat


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=COMPAT)])
def test_sft_trainer_step_equals_the_trace_tier(tmp_path, precision):
    # a padded batch: the collator pads the shorter sample to the longer (TRL
    # DataCollatorForLanguageModeling, padding to the longest), labels -100 on the pad
    config = tiny_config(tmp_path)
    real, seq = real_peak(sft_trainer(config, [SEQ, SEQ // 2], PRECISION[precision]))
    spec = TrainingSpec(model=config, micro_batch=BATCH, seq_len=seq, precision=precision,
                        optimizer="sgd", attn="sdpa", trainer="trl", grad_ckpt=True)
    assert trace_peak(spec) == real


def test_sft_trainer_doubles_the_trainer_step_on_cpu_not_on_a_gpu(tmp_path):
    # the finding, on the real trainers: the torch fold of TRL's fused head peaks well
    # above transformers' full-logits step on CPU (the fold's (tokens x 32,768) fp32 tiles:
    # z, e, e * z, and in backward log_p, p, grad, the one-hot compare), while the Triton path
    # a GPU runs keeps one tile and the fp32 grad accumulators, below the full logits
    config = tiny_config(tmp_path)
    lengths = [SEQ, SEQ]
    (sft, _), (plain, _) = (real_peak(sft_trainer(config, lengths, gradient_checkpointing=False)),
                            real_peak(hf_trainer(config, lengths)))
    assert sft > 2 * plain
    spec = TrainingSpec(model=config, micro_batch=BATCH, seq_len=SEQ, precision="fp32",
                        optimizer="sgd", attn="sdpa")
    gpu_sft = trace_peak(spec.with_(trainer="trl"), "triton")
    assert gpu_sft < trace_peak(spec, "triton")


# ---------------------------------------------------------------- DPO

DPO_VOCAB = 4000  # the head still dominates at 4 x ~100 tokens; a faster test than 32,000


def words(n: int, offset: int) -> str:
    """n words of the in-memory tokenizer's vocabulary (DPOTrainer tokenizes text itself)."""
    return " ".join(f"w{2 + (offset + 7 * j) % (DPO_VOCAB - 2)}" for j in range(n))


def dpo_trainer(config: str, dtype=torch.float32, ref: str = "separate"):
    from datasets import Dataset
    from peft import LoraConfig
    from tokenizers import pre_tokenizers
    from trl import DPOConfig, DPOTrainer

    tok = tokenizer(DPO_VOCAB)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # prompts and completions of varied lengths: DataCollatorForPreference pads the four
    # sequences (chosen + rejected) to the longest (30 + 80 tokens)
    data = {"prompt": [words(20, 0), words(30, 1)], "chosen": [words(60, 2), words(40, 3)],
            "rejected": [words(50, 4), words(80, 5)]}
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=list(LORA_TARGETS), lora_dropout=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DPOTrainer(
            model=model_from(config, dtype),
            ref_model=model_from(config, dtype) if ref == "separate" else None,
            args=DPOConfig(**TRAINER_ARGS, max_length=None,
                           precompute_ref_log_probs=ref == "precomputed"),
            train_dataset=Dataset.from_dict(data), processing_class=tok,
            peft_config=lora if ref == "adapter" else None)


# hybridmem's default LoRA targets (`--lora-targets`): every decoder linear but lm_head
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("ref,precision", [("separate", "fp32"), ("precomputed", "fp32"),
                                           ("adapter", "fp32"),
                                           pytest.param("separate", "bf16", marks=COMPAT)])
def test_dpo_trainer_step_equals_the_trace_tier(tmp_path, ref, precision):
    config = tiny_config(tmp_path, DPO_VOCAB)
    real, seq = real_peak(dpo_trainer(config, PRECISION[precision], ref))
    spec = TrainingSpec(model=config, micro_batch=BATCH, seq_len=seq, precision=precision,
                        optimizer="sgd", attn="sdpa", objective="dpo", ref_model=ref,
                        train="lora" if ref == "adapter" else "full", grad_ckpt=True)
    assert trace_peak(spec) == real


# ---------------------------------------------------------------- the analytic tier

def _tensor_peak(p) -> int:
    return p.peak.allocated_bytes - p.breakdown["workspace"]


@pytest.mark.parametrize("kw", [
    dict(precision="fp32"), dict(precision="bf16"), dict(precision="bf16-mixed"),
    dict(precision="fp32", train="lora", grad_ckpt=True),
    dict(precision="fp32", micro_batch=4, seq_len=1100),  # two token tiles (N > 4096)
    dict(precision="fp32", packing=True, grad_ckpt=True),  # SFTTrainer's packing
    dict(precision="bf16", trainer="transformers", padded=True),  # Trainer, a padded batch
    dict(objective="dpo", precision="fp32", ref_model="separate"),
    dict(objective="dpo", precision="bf16", ref_model="separate", grad_ckpt=True),
    dict(objective="dpo", precision="fp32", ref_model="precomputed"),
    dict(objective="dpo", precision="fp32", train="lora", grad_ckpt=True),
    dict(objective="kto", precision="fp32", ref_model="separate", grad_ckpt=True),
    dict(objective="kto", precision="bf16", ref_model="separate"),
    dict(objective="kto", precision="fp32", ref_model="precomputed", grad_ckpt=True),
    dict(objective="kto", precision="bf16", ref_model="precomputed", grad_ckpt=True),
    dict(objective="kto", precision="fp32", ref_model="adapter", train="lora", grad_ckpt=True),
    dict(objective="kto", precision="bf16", ref_model="adapter", train="lora", grad_ckpt=True),
    dict(objective="grpo", precision="fp32", seq_len=32, num_generations=2,
         max_completion_length=8, grad_ckpt=True),
    dict(objective="grpo", precision="bf16", seq_len=32, num_generations=2,
         max_completion_length=8, num_iterations=2, grad_ckpt=True),
    dict(objective="grpo", precision="bf16-mixed", seq_len=32, num_generations=2,
         max_completion_length=8, num_iterations=2, beta=0.04, grad_ckpt=True),
], ids=lambda kw: "-".join(map(str, kw.values())))
def test_analytic_within_3pct_of_the_trace_tiers_gpu_path(tmp_path, kw):
    # the GPU (Triton) path both tiers price by default; the trace tier runs TRL's own code
    from hybridmem import trace

    spec = TrainingSpec(**{"model": tiny_config(tmp_path), "micro_batch": BATCH,
                           "seq_len": SEQ, "optimizer": "sgd", "attn": "sdpa",
                           "trainer": "trl", **kw})
    a, tr = analytic_peak_of(spec), trace.estimate(spec)
    assert abs(_tensor_peak(a) - _tensor_peak(tr)) <= 0.03 * _tensor_peak(tr)


def analytic_peak_of(spec: TrainingSpec):
    from hybridmem.analytic import estimate

    return estimate(spec)


# ---------------------------------------------------------------- transformers' Trainer

def _trainer_with(config: str, collator, lengths: list[int]):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    ids = token_rows(lengths, DPO_VOCAB)
    return Trainer(model=model_from(config, torch.float32), args=TrainingArguments(**TRAINER_ARGS),
                   train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids}),
                   data_collator=collator)


def _trainer_trace(spec: TrainingSpec) -> int:
    from hybridmem import trace

    return _tensor_peak(trace.estimate(spec))


LOOP_SCALARS = 2 * 512  # `num_items_in_batch` and accelerate's `loss / accumulation steps`:
#                         two 0-dim tensors of the real loop the trace tier's SFT step lacks


def test_trainer_with_flattening_equals_the_packed_trace_but_the_loops_scalars(tmp_path):
    # DataCollatorWithFlattening: the two samples in one row of 160 tokens with restarting
    # position_ids, no padding: the trace tier's `packing` (2 x 80 tokens in one row)
    from transformers import DataCollatorWithFlattening

    config = tiny_config(tmp_path, DPO_VOCAB)
    real, seq = real_peak(_trainer_with(config, DataCollatorWithFlattening(), [100, 60]))
    assert seq == 160
    spec = TrainingSpec(model=config, micro_batch=2, seq_len=80, packing=True, precision="fp32",
                        optimizer="sgd", attn="sdpa")
    assert real - _trainer_trace(spec) == LOOP_SCALARS


@pytest.mark.parametrize("padded", [False, True])
def test_trainer_with_seq2seq_padding_builds_the_masks_priced_when_padded(tmp_path, padded):
    # DataCollatorForSeq2Seq(pad_to_multiple_of=64): 100 and 60 tokens padded to 128, with an
    # attention mask; each layer's SDPA saves the mask converted to fp32 (b x s x s x 4): the
    # job's `padded` batch prices them and the int64 attention mask; an unpadded job is
    # short of exactly those, to the byte
    from transformers import DataCollatorForSeq2Seq

    config = tiny_config(tmp_path, DPO_VOCAB)
    collator = DataCollatorForSeq2Seq(tokenizer(DPO_VOCAB), pad_to_multiple_of=64)
    real, seq = real_peak(_trainer_with(config, collator, [100, 60]))
    assert seq == 128
    spec = TrainingSpec(model=config, micro_batch=2, seq_len=seq, precision="fp32",
                        optimizer="sgd", attn="sdpa", padded=padded)
    masks = 2 * (2 * seq * seq * 4) + 2 * seq * 8  # 2 layers' fp32 masks, the int64 mask
    gap = real - _trainer_trace(spec)
    assert gap == (0 if padded else masks) + LOOP_SCALARS


def test_an_sftconfig_json_means_trls_trainer(tmp_path):
    # SFTConfig's own dataset keys (trl/trainer/sft_config.py) name SFTTrainer's step; a plain
    # TrainingArguments file stays transformers' Trainer
    from hybridmem.intake.merge import spec_from_inputs

    sft = spec_from_inputs(training_args={"dataset_text_field": "text",
                                          "per_device_train_batch_size": 2},
                           overrides={"model": "tiny-llama"})
    plain = spec_from_inputs(training_args={"per_device_train_batch_size": 2},
                             overrides={"model": "tiny-llama"})
    assert (sft.trainer, plain.trainer) == ("trl", "transformers")


# ---------------------------------------------------------------- KTO

def kto_trainer(config: str, dtype=torch.float32, ref: str = "separate"):
    """KTOTrainer with a reference as `dpo_trainer` builds it (separate, precomputed, or the
    adapter-disabled LoRA model): one desirable and one undesirable completion of varied
    lengths; its collator builds the KL batch from mismatched pairs."""
    from datasets import Dataset
    from peft import LoraConfig
    from tokenizers import pre_tokenizers
    from trl import KTOConfig, KTOTrainer

    tok = tokenizer(DPO_VOCAB)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    data = {"prompt": [words(20, 0), words(30, 1)], "completion": [words(60, 2), words(80, 3)],
            "label": [True, False]}
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=list(LORA_TARGETS), lora_dropout=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return KTOTrainer(
            model=model_from(config, dtype),
            ref_model=model_from(config, dtype) if ref == "separate" else None,
            args=KTOConfig(**TRAINER_ARGS, max_length=None,
                           precompute_ref_log_probs=ref == "precomputed"),
            train_dataset=Dataset.from_dict(data), processing_class=tok,
            peft_config=lora if ref == "adapter" else None)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("ref", ["separate", "precomputed", "adapter"])
def test_kto_trainer_step_equals_the_trace_tier(tmp_path, ref, precision):
    # the KL batch (100 tokens here) runs under no_grad before the policy's graph exists: the
    # priced KL batch is as long as the completions' (the job's one seq_len), below the peak
    config = tiny_config(tmp_path, DPO_VOCAB)
    real, seq = real_peak(kto_trainer(config, PRECISION[precision], ref))
    spec = TrainingSpec(model=config, micro_batch=BATCH, seq_len=seq, precision=precision,
                        optimizer="sgd", attn="sdpa", objective="kto", ref_model=ref,
                        train="lora" if ref == "adapter" else "full", grad_ckpt=True)
    assert trace_peak(spec) == real


# ---------------------------------------------------------------- GRPO

def grpo_trainer(config: str, num_iterations: int, dtype=torch.float32):
    """GRPOTrainer without vLLM (its own `generate()`), beta 0 (no reference, TRL's default):
    two prompts of 24 tokens, groups of 2, 8 completion tokens."""
    from datasets import Dataset
    from tokenizers import pre_tokenizers
    from trl import GRPOConfig, GRPOTrainer

    tok = tokenizer(DPO_VOCAB)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GRPOTrainer(
            model=model_from(config, dtype),
            reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
            args=GRPOConfig(**TRAINER_ARGS, num_generations=2, max_completion_length=8,
                            use_vllm=False, beta=0.0, num_iterations=num_iterations),
            train_dataset=Dataset.from_dict({"prompt": [words(24, 0), words(24, 1)]}),
            processing_class=tok)


def grpo_spec(config: str, num_iterations: int, precision: str = "fp32") -> TrainingSpec:
    return TrainingSpec(model=config, micro_batch=BATCH, seq_len=24 + 8, precision=precision,
                        optimizer="sgd", attn="sdpa", objective="grpo", num_generations=2,
                        max_completion_length=8, num_iterations=num_iterations, grad_ckpt=True)


# GRPOConfig's `bf16=True` default (trl/trainer/grpo_config.py) and GRPOTrainer's own
# `with self.accelerator.autocast()` around the fused forward (grpo_trainer.py
# `_get_per_token_logps_and_entropies`): fp32 weights run the head under bf16 autocast, even
# on CPU: the job is `bf16-mixed`. The trace prices a completion that stops early (padded,
# `_grpo_fused_prepare`): its (b, 1, s, s) boolean attention mask, 2 x 32 x 32 bytes, which the
# real run, whose 8 sampled tokens never reach EOS, skips
GRPO_PADDED_MASK = BATCH * 32 * 32


def test_grpo_trainer_step_and_its_old_policy_logps_match_the_trace_tier(tmp_path):
    config = tiny_config(tmp_path, DPO_VOCAB)
    real = {ni: real_peak(grpo_trainer(config, ni))[0] for ni in (1, 2)}
    traced = {ni: trace_peak(grpo_spec(config, ni, "bf16-mixed")) for ni in (1, 2)}
    # num_iterations 2: `old_per_token_logps`, (2 sequences x 8 tokens) fp32, one 512-byte block
    assert real[2] - real[1] == traced[2] - traced[1] == 512
    # and besides that mask, the same bytes: the trace's buffer keeps TRL's 0-dim
    # `num_items_in_batch`; its stand-in batch ids at setup ((2, 32) int64, one 512-byte
    # block) are as large here as GRPOTrainer's `reward_weights`, a (1,) fp32 tensor the real
    # trainer holds on the device
    assert traced[1] - real[1] == traced[2] - real[2] == GRPO_PADDED_MASK


# ---------------------------------------------------------------- SFT's data paths

def sft_variant(config: str, variant: str):
    """SFTTrainer on the vocab-4,000 Llama (fp32) with one of its data paths: `packing` (BFD
    into one row of 192 tokens: 128 + 64, `position_ids` restarting), `padding_free` (the
    collator flattens the batch into one row), `completion_only` (a prompt-completion
    dataset: labels -100 on the prompt, `completion_only_loss`'s default for it)."""
    from datasets import Dataset
    from tokenizers import pre_tokenizers
    from trl import SFTConfig, SFTTrainer

    tok = tokenizer(DPO_VOCAB)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    ids = {"input_ids": token_rows([128, 64], DPO_VOCAB)}
    data, args = {
        "packing": (ids, dict(packing=True, max_length=192)),
        "padding_free": (ids, dict(padding_free=True, max_length=None)),
        # the prompt ends on a word boundary: its tokens are a prefix of prompt + completion
        "completion_only": ({"prompt": [words(30, 0) + " ", words(20, 1) + " "],
                             "completion": [words(60, 2), words(40, 3)]},
                            dict(max_length=None))}[variant]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SFTTrainer(model=model_from(config, torch.float32),
                          args=SFTConfig(**TRAINER_ARGS, **args),
                          train_dataset=Dataset.from_dict(data), processing_class=tok)


@pytest.mark.parametrize("variant", ["packing", "padding_free", "completion_only"])
def test_sft_trainer_data_paths_equal_the_trace_tier(tmp_path, variant):
    # packing and padding-free: one row of 192 tokens, the trace tier's `packing` (2 x 96
    # tokens in one row); completion-only: the padded batch (the torch fold scores every
    # position, the prompt's too: only the labels differ)
    config = tiny_config(tmp_path, DPO_VOCAB)
    real, seq = real_peak(sft_variant(config, variant))
    packed = variant != "completion_only"
    assert seq == (192 if packed else 91)
    spec = TrainingSpec(model=config, micro_batch=BATCH, seq_len=seq // 2 if packed else seq,
                        packing=packed, precision="fp32", optimizer="sgd", attn="sdpa",
                        trainer="trl", grad_ckpt=True)
    assert trace_peak(spec) == real


# ---------------------------------------------------------------- RM and ORPO

def pair_trainer(which: str, config: str, dtype=torch.float32):
    """RewardTrainer (a 1-label sequence classifier) or ORPOTrainer (trl.experimental) on the
    DPO test's pairs: their collators pad chosen and rejected to the longest."""
    from datasets import Dataset
    from tokenizers import pre_tokenizers

    tok = tokenizer(DPO_VOCAB)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    pairs = {"prompt": [words(20, 0), words(30, 1)], "chosen": [words(60, 2), words(40, 3)],
             "rejected": [words(50, 4), words(80, 5)]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if which == "rm":
            from transformers import AutoConfig, AutoModelForSequenceClassification
            from trl import RewardConfig, RewardTrainer

            cfg = AutoConfig.from_pretrained(config)
            cfg.num_labels = 1
            torch.manual_seed(0)
            model = AutoModelForSequenceClassification.from_config(cfg,
                                                                   attn_implementation="sdpa")
            return RewardTrainer(model=model.to(dtype),
                                 args=RewardConfig(**TRAINER_ARGS, max_length=None),
                                 train_dataset=Dataset.from_dict(
                                     {k: pairs[k] for k in ("chosen", "rejected")}),
                                 processing_class=tok)
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        return ORPOTrainer(model=model_from(config, dtype),
                           args=ORPOConfig(**TRAINER_ARGS, max_length=None),
                           train_dataset=Dataset.from_dict(pairs), processing_class=tok)


def padded_length(trainer) -> int:
    """The padded length of the trainer's first batch."""
    batch = next(iter(trainer.get_train_dataloader()))
    return max(v.shape[-1] for v in batch.values() if hasattr(v, "shape") and v.dim() == 2)


def int64_block(rows: int, seq: int) -> int:
    """One (rows x seq) int64 tensor as CUDA's allocator rounds it (512-byte blocks)."""
    return -(-rows * seq * 8 // 512) * 512


@pytest.mark.parametrize("which", ["rm", "orpo"])
def test_rm_and_orpo_trainers_pad_as_the_trace_tier(tmp_path, which):
    # the collators' attention mask reaches each layer's SDPA (the objective's `PADDED`); the
    # Trainer loop divides these trainers' loss (`loss_is_scaled_for_ga = False`) and
    # accelerate's `backward` divides it again (`objectives.loop_divisions`): the reward
    # model equals the trace to the byte
    config = tiny_config(tmp_path, DPO_VOCAB)
    trainer = pair_trainer(which, config)
    seq = padded_length(trainer)
    real, _ = real_peak(trainer)
    spec = TrainingSpec(model=config, micro_batch=BATCH, seq_len=seq, precision="fp32",
                        optimizer="sgd", attn="sdpa", objective=which, grad_ckpt=True)
    gap = real - trace_peak(spec)
    if which == "rm":
        assert gap == 0
        return
    # ORPO (trl.experimental's DPODataCollatorWithPadding): the batch holds each side apart,
    # padded to its own longest (prompt 29 tokens: prompt and answer are joined without a
    # space, so the 30-word prompt's last word merges into the answer's first,
    # orpo_trainer.py `build_tokenized_answer`; chosen 80, rejected 110 tokens; ids, masks
    # and the sides' labels), and `concatenated_inputs` pads and stacks
    # them in the forward; the trace's batch is that concatenation, whose attention mask and
    # labels the real step has freed by its peak (hand count, `int64_block`)
    assert seq == 110
    sides = 2 * int64_block(BATCH, 30 - 1) + 3 * int64_block(BATCH, 80) \
        + 3 * int64_block(BATCH, 110)
    assert gap == sides - 2 * int64_block(2 * BATCH, seq)
