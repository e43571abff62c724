"""--lengths: the batches a dataset makes (hybridmem/batches), priced step by step.

Every length file here is SYNTHETIC (made in the test): it exercises the mechanism, it is no
dataset's distribution. Oracles: accelerate's `SeedableRandomSampler` and transformers'
`get_length_grouped_indices` for the order, the fixed-length answer of each tier for a file whose
samples are all `seq_len` long, the allocator simulator's rules for growth.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from hybridmem.batches import run as R
from hybridmem.batches.read import read_lengths
from hybridmem.batches.steps import BUCKETS, bucket, grouped, order, plan
from hybridmem.errors import SpecError
from hybridmem.families.defaults import as_job
from hybridmem.job.spec import TrainingSpec
from hybridmem.predict import predict


def _lines(path, values):
    path.write_text("\n".join(map(str, values)) + "\n")
    return str(path)


# ---------------------------------------------------------------- reading

def test_formats(tmp_path):
    import pandas as pd

    assert read_lengths(_lines(tmp_path / "a.txt", [3, 5, 7])).tokens.tolist() == [3, 5, 7]
    pd.DataFrame({"length": [4, 9]}).to_csv(tmp_path / "a.csv", index=False)
    assert read_lengths(tmp_path / "a.csv").tokens.tolist() == [4, 9]
    (tmp_path / "a.jsonl").write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [4]}\n')
    got = read_lengths(tmp_path / "a.jsonl")
    assert got.tokens.tolist() == [3, 1] and got.images is None
    pd.DataFrame({"num_tokens": [10, 20], "num_images": [0, 2]}).to_parquet(tmp_path / "a.parquet")
    got = read_lengths(tmp_path / "a.parquet")
    assert got.tokens.tolist() == [10, 20] and got.images.tolist() == [0, 2]
    # LLaVA's data JSON: an image path where the sample has one
    (tmp_path / "l.jsonl").write_text('{"length": 5, "image": "a.jpg"}\n{"length": 6}\n')
    assert read_lengths(tmp_path / "l.jsonl").images.tolist() == [1, 0]


@pytest.mark.parametrize("name, text, words", [
    ("a.txt", "12\nx\n", "a.txt:2"),
    ("a.txt", "0\n", "token count from 1"),
    ("a.txt", "\n", "no token counts"),
    ("a.csv", "tokens\n3\n", "length, num_tokens, input_ids"),
    ("a.csv", "length\n2.5\n", "not a whole number"),
    ("a.jsonl", "{not json\n", "cannot read it as jsonl"),
])
def test_bad_files_are_one_line(tmp_path, name, text, words):
    (tmp_path / name).write_text(text)
    with pytest.raises(SpecError) as err:
        read_lengths(tmp_path / name)
    assert words in str(err.value) and "\n" not in str(err.value)
    assert err.value.field == "lengths"


def test_missing_file_and_bad_fields():
    with pytest.raises(SpecError, match="no such file"):
        read_lengths("/nonexistent/lengths.txt")
    with pytest.raises(SpecError, match="sampler"):
        TrainingSpec(model="tiny-llama", sampler="shuffle")
    with pytest.raises(SpecError, match="pad_to"):
        TrainingSpec(model="tiny-llama", pad_to="short")


# ---------------------------------------------------------------- order and shapes

def test_random_order_is_the_seeded_trainer_sampler():
    """accelerate's SeedableRandomSampler (what Trainer's RandomSampler becomes in
    `prepare_data_loader`), seeded as Trainer seeds it, yields exactly our order per epoch."""
    from accelerate.data_loader import SeedableRandomSampler

    n, seed = 1001, 123
    spec = TrainingSpec(model="tiny-llama", seed=seed)
    sampler = SeedableRandomSampler(data_source=range(n), data_seed=seed)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        assert list(sampler) == order(np.ones(n, dtype=np.int64), spec, epoch).tolist()


def test_group_by_length_first_epoch_is_the_trainers_own_draw():
    """transformers' Trainer with `train_sampling_strategy="group_by_length"` (older releases'
    `group_by_length=True`): its loader's first epoch yields exactly our order (the global
    generator `set_seed(seed)` left, after the loader iterator's base-seed draw)."""
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    lengths = np.random.default_rng(1).integers(1, 60, 96)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8,
                                         num_hidden_layers=1, num_attention_heads=1))
    data = Dataset.from_dict({"input_ids": [[1] * int(n) for n in lengths],
                              "idx": list(range(len(lengths)))})
    args = TrainingArguments(output_dir="unused", per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, seed=11, use_cpu=True,
                             report_to=[], remove_unused_columns=False,
                             train_sampling_strategy="group_by_length")
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      data_collator=lambda rows: {"idx": torch.tensor([r["idx"] for r in rows])})
    real = [int(i) for b in trainer.get_train_dataloader() for i in b["idx"]]
    spec = TrainingSpec(model="tiny-llama", sampler="group_by_length", micro_batch=2,
                        grad_accum=2, seed=11)
    assert real == order(lengths, spec).tolist()


def test_group_by_length_is_transformers_grouping():
    import torch
    from transformers.trainer_pt_utils import get_length_grouped_indices

    lengths = np.random.default_rng(0).integers(1, 900, 5000)
    spec = TrainingSpec(model="tiny-llama", sampler="group_by_length", micro_batch=4,
                        grad_accum=2, seed=5)
    generator = torch.Generator()
    generator.manual_seed(5)
    torch.empty((), dtype=torch.int64).random_(generator=generator)  # the loader's base seed
    ref = get_length_grouped_indices(lengths.tolist(), 8, generator=generator)
    got = order(lengths, spec)
    assert got.tolist() == ref
    # megabatches of 50 x 8 indices, each sorted longest first (after the front swap)
    mega = 50 * 8
    for start in range(mega, len(got), mega):
        chunk = lengths[got[start:start + mega]]
        assert (np.diff(chunk) <= 0).all()
    assert lengths[got[0]] == lengths.max()
    perm = np.arange(10)
    assert sorted(grouped(perm, np.arange(10), 2).tolist()) == list(range(10))


def test_padding_truncation_and_packing(tmp_path):
    path = _lines(tmp_path / "l.txt", [10, 300, 20, 30, 5])
    base = TrainingSpec(model="tiny-llama", micro_batch=2, seq_len=256, sampler="sequential",
                        lengths=path)
    steps = plan(read_lengths(path), base, 0)
    # [10, 300->256], [20, 30], [5] (the last batch of one sample)
    assert steps.padded.tolist() == [256, 30, 5] and len(steps) == 3 and steps.batches == 3
    assert [(s.batch, s.tokens) for s in steps.shapes] == [(1, 5), (2, 30), (2, 256)]
    assert plan(read_lengths(path), base.with_(drop_last=True), 0).padded.tolist() == [256, 30]
    assert plan(read_lengths(path), base.with_(pad_multiple=64), 0).padded.tolist() == [256, 64, 64]
    assert plan(read_lengths(path), base.with_(pad_to="max_length"), 0).padded.tolist() == [256] * 3
    packed = plan(read_lengths(path), base.with_(packing=True), 0)
    assert packed.padded.tolist() == [266, 50, 5] and {s.batch for s in packed.shapes} == {1}
    # max_steps beyond an epoch: the next epoch, reshuffled; grad_accum: the longest micro-batch
    more = plan(read_lengths(path), base.with_(max_steps=2, grad_accum=2), 0)
    assert len(more) == 2 and more.epochs == 2 and more.padded.tolist() == [256, 256]


def test_buckets_are_bounded_and_round_up():
    padded = np.random.default_rng(1).integers(16, 4096, 20000)
    out = bucket(padded, BUCKETS)
    assert len(np.unique(out)) <= BUCKETS
    assert (out >= padded).all() and out.max() == padded.max()
    few = np.array([5, 9, 5, 7])
    assert bucket(few, BUCKETS).tolist() == few.tolist()
    # lengths padded to a multiple stay multiples of it in every bucket
    assert (bucket(padded // 64 * 64 + 64, 4, 64) % 64 == 0).all()


# ---------------------------------------------------------------- the simulated run

@pytest.mark.parametrize("method", ["analytic", "trace"])
def test_every_sample_at_seq_len_is_the_fixed_answer(tmp_path, method):
    """One shape all run long: the composed replay is the tier's own two iterations."""
    path = _lines(tmp_path / "l.txt", [64] * 8)
    spec = TrainingSpec(model="tiny-llama", micro_batch=2, seq_len=64)
    fixed = predict(spec, method=method)
    run = predict(spec.with_(lengths=path), method=method)
    assert run.peak == fixed.peak and run.breakdown == fixed.breakdown
    info = run.extras["lengths"]
    assert info["steps"] == 4 and info["shape_growth_bytes"] == 0
    assert info["reserved_per_step"]["max"] == fixed.peak.reserved_bytes


def test_reserved_grows_when_shapes_change():
    """A short batch, then a long one: the short step's cached segments stay reserved and the
    long step's larger blocks need new ones (no empty_cache, no capacity: the simulator never
    releases a segment, as CUDACachingAllocator does below the device limit)."""
    spec = as_job(TrainingSpec(model="llama-3.2-3b", micro_batch=4, seq_len=1024,
                                 train="lora", precision="bf16"))
    long_, short = (R.shape_stream("analytic", spec.with_(seq_len=n)) for n in (1024, 300))
    same = R.replay_steps([long_], np.zeros(3, dtype=np.int64))
    mixed = R.replay_steps([long_, short], np.array([1, 0, 1, 0]))
    assert mixed.peak_reserved > same.peak_reserved
    assert (np.diff(mixed.reserved) >= 0).all()  # no empty_cache: reserved never shrinks


def test_replay_skips_repeated_transitions():
    spec = as_job(TrainingSpec(model="tiny-llama", micro_batch=2, seq_len=64))
    a, b = (R.shape_stream("analytic", spec.with_(seq_len=n)) for n in (64, 32))
    index = np.array([0, 1] * 500)
    out = R.replay_steps([a, b], index)
    assert out.replayed_steps == 3 and len(out.reserved) == 1000


def test_json_and_console(tmp_path, capsys):
    from hybridmem.cli import main

    path = _lines(tmp_path / "l.txt", [40, 64, 12, 64, 30, 8])
    assert main(["predict", "--model", "tiny-llama", "--micro-batch", "2", "--seq-len", "64",
                 "--lengths", path, "--method", "analytic", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    info = out["lengths"]
    assert info["samples"] == 6 and info["steps"] == 3 and info["longest_batch"]["tokens"] == 64
    assert out["job"]["lengths"] == path and out["job"]["sampler"] == "random"
    assert main(["predict", "--model", "tiny-llama", "--seq-len", "64", "--lengths", path,
                 "--method", "analytic"]) == 0
    assert "lengths: 6 samples, 6 steps" in capsys.readouterr().out
    bad = tmp_path / "bad.csv"
    bad.write_text("tokens\n3\n")
    assert main(["predict", "--model", "tiny-llama", "--lengths", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "lengths=" in err and "length, num_tokens, input_ids" in err and "\n" not in err


def test_training_args_keys(tmp_path):
    from hybridmem.intake.merge import spec_from_inputs

    path = tmp_path / "args.json"
    path.write_text(json.dumps({"group_by_length": True, "seed": 3, "data_seed": 9,
                                "max_steps": -1, "dataloader_drop_last": True,
                                "pad_to_multiple_of": 8}))
    spec = spec_from_inputs(training_args=str(path), overrides={"model": "tiny-llama"})
    assert (spec.sampler, spec.seed, spec.max_steps, spec.drop_last, spec.pad_multiple) == (
        "group_by_length", 9, 0, True, 8)
    path.write_text(json.dumps({"train_sampling_strategy": "sequential", "max_steps": 50}))
    spec = spec_from_inputs(training_args=str(path), overrides={"model": "tiny-llama"})
    assert (spec.sampler, spec.max_steps) == ("sequential", 50)
    path.write_text(json.dumps({"train_sampling_strategy": "batch_rebalance"}))
    with pytest.raises(SpecError, match="train_sampling_strategy"):
        spec_from_inputs(training_args=str(path), overrides={"model": "tiny-llama"})


def test_launcher_configs_say_the_sampler(tmp_path):
    from hybridmem.intake.resolve import resolve

    axolotl = tmp_path / "a.yml"
    axolotl.write_text("base_model: meta-llama/Llama-3.2-3B\ngroup_by_length: true\n"
                       "seed: 7\nmax_steps: 30\n")
    spec = resolve(config=str(axolotl), overrides={}).spec
    assert (spec.sampler, spec.seed, spec.max_steps) == ("group_by_length", 7, 30)
    factory = tmp_path / "f.yaml"
    factory.write_text("model_name_or_path: meta-llama/Llama-3.2-3B\nstage: sft\n"
                       "finetuning_type: lora\ngroup_by_length: true\ndata_seed: 3\n")
    spec = resolve(config=str(factory), overrides={}).spec
    assert (spec.sampler, spec.seed) == ("group_by_length", 3)


@pytest.mark.parametrize("lengths, kw, padded", [
    ([100, 100, 60, 60], {}, [False, False]),       # equal lengths in each batch: no mask
    ([100, 60, 60, 60], {}, [True, False]),         # 60 padded to 100
    ([128, 128, 60, 60], {"pad_multiple": 64}, [False, True]),  # 60 -> 64 pads too
    ([100, 60, 60, 60], {"packing": True}, [False, False]),     # padding-free
    ([60, 60, 60], {}, [False, False]),             # the last, partial batch is not padding
])
def test_each_batch_says_whether_it_is_padded(tmp_path, lengths, kw, padded):
    # a collator pads a batch whose samples differ (or round up to pad_to_multiple_of): its
    # attention mask has zeros and every sdpa layer builds the mask (`TrainingSpec.padded`)
    from hybridmem.batches.read import read_lengths
    from hybridmem.batches.steps import plan

    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(map(str, lengths)))
    spec = TrainingSpec(model="tiny-llama", micro_batch=2, seq_len=128, sampler="sequential",
                        **kw)
    steps = plan(read_lengths(str(path)), spec, 0)
    assert [steps.shapes[i].padded for i in steps.index] == padded
