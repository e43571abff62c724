"""hybridmem.integrations: the callbacks inside real Trainer / TRL runs on tiny models (CPU).

Each config path (plain, PEFT LoRA, DeepSpeed JSON, FSDP args, TRL DPO) runs a real `Trainer`
for one step with `HybridmemCallback`; the job the callback built must equal the one
`hybridmem predict` builds from the same settings written as the files it takes
(`--training-args`, `--model config.json`, `--peft-config`); `fail_if_no_fit` must stop the run
before its first step. The CUDA measurement needs a GPU and skips with its reason here.
"""

from __future__ import annotations

import importlib.util
import json
import logging

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hybridmem.cli import main  # noqa: E402
from hybridmem.integrations import HybridmemCallback, NoFit  # noqa: E402
from hybridmem.models.loader import load_config_dict  # noqa: E402

SEQ = 16


def tiny_model():
    """tiny-llama (the shipped preset: 2 layers, hidden 64, vocab 128), random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _, data = load_config_dict("tiny-llama")
    config = LlamaConfig(**{k: v for k, v in data.items() if not k.startswith("_")})
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    """Four fixed-length samples of random token ids (labels = inputs)."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 128, (SEQ,), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}


def args(tmp_path, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1,
                             per_device_train_batch_size=2, report_to=[], save_strategy="no",
                             use_cpu=True, logging_strategy="no", **kw)


def train(model, training_args, callback, **late):
    """One step of a real Trainer; `late`: arguments set after the Trainer is built (what
    its constructor refuses on one CPU process but a launched run holds)."""
    from transformers import Trainer

    trainer = Trainer(model=model, args=training_args, train_dataset=Tokens(),
                      callbacks=[callback])
    for key, value in late.items():
        setattr(trainer.args, key, value)
    trainer.train()
    return trainer


def cli_job(tmp_path, callback, model, flags=()):
    """The job `hybridmem predict --json` builds from the callback's settings written as files:
    the run's TrainingArguments JSON (+ its world size), the model's config.json, the adapter's
    adapter_config.json."""
    from hybridmem.integrations.live import peft_dict, training_args_dict, base_model

    ta = tmp_path / "training_args.json"
    ta.write_text(json.dumps(training_args_dict(callback.run_args)))
    cfg = tmp_path / "config.json"
    cfg.write_text(base_model(model).config.to_json_string(use_diff=False))
    argv = ["predict", "--training-args", str(ta), "--model", str(cfg), "--seq-len", str(SEQ),
            "--json", *flags]
    adapter = peft_dict(model)
    if adapter is not None:
        (tmp_path / "adapter_config.json").write_text(json.dumps(adapter))
        argv += ["--peft-config", str(tmp_path / "adapter_config.json")]
    return argv


class Recording(HybridmemCallback):
    """The callback, keeping the arguments it saw (to write the same files for the CLI)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.run_args = args
        self.steps_begun = 0
        super().on_train_begin(args, state, control, model=model, **kwargs)

    def on_step_begin(self, args, state, control, **kwargs):
        self.steps_begun += 1


def assert_same_job(tmp_path, capsys, callback, model, flags=()):
    """The callback's job equals `hybridmem predict`'s for the same settings (the model is a
    config path on both sides: compared by content)."""
    capsys.readouterr()
    assert main(cli_job(tmp_path, callback, model, flags)) == 0
    cli = json.loads(capsys.readouterr().out)["job"]
    ours = callback.check.found.result.job
    for job in (cli, ours):
        job.pop("sources"), job.pop("warnings")
    assert load_config_dict(ours.pop("model"))[1] == load_config_dict(cli.pop("model"))[1]
    assert ours == cli
    return ours


def test_plain_trainer_job_equals_cli(tmp_path, capsys):
    model = tiny_model()
    cb = Recording(seq_len=SEQ)
    train(model, args(tmp_path, max_grad_norm=0.5, optim="adamw_torch"), cb)
    job = assert_same_job(tmp_path, capsys, cb, model)
    # the arguments' own values, not the schema defaults (micro-batch 2, adamw, clip 0.5)
    assert (job["micro_batch"], job["optimizer"], job["max_grad_norm"], job["loop"]) == \
        (2, "adamw", 0.5, "trainer")
    assert cb.check.lengths.summary()["max_seq_len"] == SEQ  # the forward hook saw the data


def test_peft_lora_trainer_job_equals_cli(tmp_path, capsys):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model(), LoraConfig(r=4, lora_alpha=8,
                                                    target_modules=["q_proj", "v_proj"]))
    cb = Recording(seq_len=SEQ)
    train(model, args(tmp_path), cb)
    job = assert_same_job(tmp_path, capsys, cb, model)
    assert job["train"] == "lora" and job["lora"]["r"] == 4
    assert sorted(job["lora"]["targets"]) == ["q_proj", "v_proj"]


def test_deepspeed_dict_job_equals_cli(tmp_path, capsys):
    ds = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"},
          "train_micro_batch_size_per_gpu": "auto"}
    training_args = args(tmp_path, bf16=True)
    # TrainingArguments(deepspeed=...) builds accelerate's DeepSpeed plugin, which imports
    # deepspeed (not installed here, and it needs CUDA): the dict is set after construction,
    # which is what the callback reads (`args.to_json_string()` carries it)
    training_args.deepspeed = ds
    model = tiny_model()
    cb = Recording(seq_len=SEQ, world_size=2)
    train(model, training_args, cb)
    job = assert_same_job(tmp_path, capsys, cb, model, ["--world-size", "2"])
    assert (job["strategy"], job["world_size"], job["precision"]) == ("zero2", 2, "bf16-master")


def test_fsdp_args_job_equals_cli(tmp_path, capsys):
    # Trainer refuses `fsdp` outside a distributed launch ("Using fsdp only works in
    # distributed training", trainer.py): set after it is built, as a launched run holds them
    model = tiny_model()
    cb = Recording(seq_len=SEQ, world_size=4)
    train(model, args(tmp_path), cb, fsdp="full_shard auto_wrap",
          fsdp_config={"activation_checkpointing": True})
    job = assert_same_job(tmp_path, capsys, cb, model, ["--world-size", "4"])
    assert (job["strategy"], job["world_size"], job["grad_ckpt"]) == ("fsdp", 4, True)


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed")
def test_trl_dpo_trainer_job_equals_cli(tmp_path, capsys):
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl import DPOConfig, DPOTrainer

    words = [f"w{i}" for i in range(120)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<pad>", "<eos>", *words])},
                                     unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                        eos_token="<eos>")
    data = Dataset.from_dict({"prompt": ["w1 w2 w3", "w4 w5"], "chosen": [" w6 w7", " w8"],
                              "rejected": [" w9", " w10 w11"]})
    config = DPOConfig(output_dir=str(tmp_path / "out"), max_steps=1,
                       per_device_train_batch_size=2, report_to=[], save_strategy="no",
                       use_cpu=True, logging_strategy="no", beta=0.2, max_length=SEQ)
    model = tiny_model()
    cb = Recording()
    # an explicit reference model: TRL would load one from the hub id of the policy's config
    DPOTrainer(model=model, ref_model=tiny_model(), args=config, train_dataset=data,
               processing_class=tokenizer,
               callbacks=[cb]).train()
    job = assert_same_job(tmp_path, capsys, cb, model, [])
    assert (job["objective"], job["beta"], job["seq_len"]) == ("dpo", 0.2, SEQ)


def test_fail_if_no_fit_stops_before_a_step(tmp_path):
    model = tiny_model()
    # 0.51 GiB: the 0.5 GiB CUDA context the tiers assume (docs/design.md) leaves 10 MiB,
    # less than the two cuBLAS workspaces and tiny-llama's states
    cb = Recording(seq_len=SEQ, gpu_mem=0.51, fail_if_no_fit=True)
    with pytest.raises(NoFit, match="DOES NOT FIT"):
        train(model, args(tmp_path), cb)
    assert cb.steps_begun == 0


def test_callback_logs_the_job_and_the_verdict(tmp_path, caplog):
    cb = Recording(seq_len=SEQ, gpu="h100-80gb")
    logging.getLogger("hybridmem").propagate = True
    with caplog.at_level(logging.INFO, logger="hybridmem"):
        train(tiny_model(), args(tmp_path), cb)
    text = caplog.text
    # the job echo with each value's source in the live objects' names, then the verdict
    assert "micro_batch=2 (TrainingArguments: per_device_train_batch_size)" in text
    assert "seq_len=16 (callback seq_len=)" in text and "FITS on h100-80gb" in text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the measurement reads "
                    "torch.cuda.max_memory_allocated / NVML: needs a CUDA GPU")
@pytest.mark.gpu
def test_cuda_measurement_writes_a_user_row(tmp_path):
    from hybridmem.harness import store

    training_args = args(tmp_path)
    training_args.use_cpu = False
    cb = Recording(seq_len=SEQ, measure_after=1, dataset=str(tmp_path / "ds"))
    train(tiny_model().cuda(), training_args, cb)
    df = store.load_dataset(tmp_path / "ds")
    assert list(df["source"]) == ["user"] and df["peak_allocated_bytes"].iloc[0] > 0


def test_accelerate_helper_job_equals_cli_config(tmp_path, capsys):
    """The accelerator's state read as `--config accelerate.yaml` with the same keys."""
    import yaml
    from accelerate import Accelerator

    from hybridmem.integrations import check_accelerator

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(tiny_model())
    check = check_accelerator(accelerator, model, micro_batch=2, seq_len=SEQ)
    check.end()
    (tmp_path / "accelerate.yaml").write_text(yaml.safe_dump(
        {"distributed_type": "NO", "mixed_precision": "no", "num_processes": 1}))
    (tmp_path / "config.json").write_text(model.config.to_json_string(use_diff=False))
    capsys.readouterr()
    assert main(["predict", "--config", str(tmp_path / "accelerate.yaml"), "--model",
                 str(tmp_path / "config.json"), "--micro-batch", "2", "--seq-len", str(SEQ),
                 "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)["job"]
    ours = check.found.result.job
    for job in (cli, ours):
        job.pop("sources"), job.pop("warnings"), job.pop("model")
    assert ours == cli


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                    reason="lightning is not installed (the callback is imported only when used)")
def test_lightning_callback_prices_before_the_first_step(tmp_path):
    import lightning.pytorch as pl

    from hybridmem.integrations import HybridmemLightningCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_model()

        def training_step(self, batch, _):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    cb = HybridmemLightningCallback(micro_batch=2, seq_len=SEQ, gpu_mem=0.51,
                                    fail_if_no_fit=True)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=2)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False,
                         enable_checkpointing=False, callbacks=[cb])
    with pytest.raises(NoFit, match="DOES NOT FIT"):
        trainer.fit(Module(), loader)
    assert trainer.global_step == 0


def test_user_rows_merge_deduplicated(tmp_path, capsys):
    """A run's row (collect's schema, source "user", seq_len the longest seen) and `hybridmem
    import --from user`: two users' folders merge; importing one again adds nothing. The
    measured figures are stand-ins (no GPU here), written only under tmp_path."""
    from hybridmem.harness import store

    cb = Recording(seq_len=2 * SEQ)
    train(tiny_model(), args(tmp_path), cb)
    stand_in = {"peak_allocated_bytes": 1 << 20, "peak_reserved_bytes": 2 << 20,
                "peak_device_bytes": None, "num_alloc_retries": 0, "num_ooms": 0}
    env = {"gpu_name": "stand-in", "gpu_memory_bytes": 0, "torch_version": torch.__version__,
           "transformers_version": transformers.__version__, "hostname": "a"}
    cb.check.dataset = str(tmp_path / "alice")
    cb.check.write_row(stand_in, env, steps=1)
    cb.check.dataset = str(tmp_path / "bob")
    cb.check.write_row(stand_in, {**env, "hostname": "b"}, steps=1)
    row = store.load_dataset(tmp_path / "alice").iloc[0]
    # priced at 32 tokens, but the data had 16: the row records what ran
    assert (row["source"], row["seq_len"], row["seq_len_kind"]) == ("user", SEQ, "upper-bound")
    out = tmp_path / "merged"
    for folders, added in (([tmp_path / "alice", tmp_path / "bob"], 2), ([tmp_path / "bob"], 0)):
        assert main(["import", "--from", "user", *map(str, folders), "--out", str(out)]) == 0
        assert f"added {added} rows" in capsys.readouterr().out
    assert len(store.load_dataset(out)) == 2
