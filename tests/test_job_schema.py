"""The job schema (hybridmem/job/schema.py): one declaration per field, every view derived.

The expected dataset columns and added defaults below are the dataset contract as the parquet
parts already written have it (datasets/README.md, `TrainingSpec.to_dict`): a change there
re-hashes every measured spec, so they are spelled out here rather than read from the code.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hybridmem.errors import SpecError
from hybridmem.job import schema
from hybridmem.job.field import GROUPS
from hybridmem.job.parallel import ParallelSpec
from hybridmem.job.recorded import RECORDED
from hybridmem.job.spec import ADDED_DEFAULTS, LoraSpec, TrainingSpec


def test_recorded_columns_are_the_dataset_contract():
    assert list(RECORDED.items()) == [
        ("loop", ("string", "trainer")), ("max_grad_norm", ("float64", 0.0)),
        ("grad_accum", ("int64", 1)), ("empty_cache_steps", ("int64", 0)),
        ("grad_ckpt_policy", ("string", "full")), ("optimizer_in_backward", ("bool", False)),
        ("quantize", ("string", "none")), ("liger", ("bool", False)),
        ("chunked_ce", ("int64", 0)), ("offload_activations", ("string", "none")),
        ("packing", ("bool", False)), ("cut_cross_entropy", ("bool", False)),
        ("adapter_dtype", ("string", "fp32")), ("objective", ("string", "sft")),
        ("num_generations", ("int64", 8)),
        # the model-parallel layout (ParallelSpec; docs/parallel.md, "Model parallelism")
        ("tp", ("int64", 1)), ("sequence_parallel", ("bool", False)), ("cp", ("int64", 1)),
        ("pp", ("int64", 1)), ("pp_schedule", ("string", "1f1b")),
        ("pp_virtual_stages", ("int64", 1)), ("pp_microbatches", ("Int64", None)),
        ("ep", ("int64", 1)), ("dp_replicate", ("int64", 1)), ("dp_shard", ("Int64", None))]


def test_added_defaults_keep_old_spec_hashes():
    assert ADDED_DEFAULTS == {
        "loop": "trainer", "max_grad_norm": 0.0, "grad_accum": 1, "peft_config": None,
        "empty_cache_steps": 0, "grad_ckpt_policy": "full", "optimizer_in_backward": False,
        "quantize": "none", "quant_double_quant": True, "quant_compute_dtype": None,
        "quant_storage": "uint8", "quant_skip": None, "kbit_prep": True, "liger": False,
        "chunked_ce": 0, "offload_activations": "none", "packing": False,
        "use_dora": False, "use_rslora": False, "modules_to_save": (),
        "cut_cross_entropy": False, "weights_dtype": None, "autocast": None,
        "master_weights": None, "adapter_dtype": "fp32",
        "lengths": None, "pad_to": "longest", "pad_multiple": 0,
        "sampler": "random", "seed": 42, "max_steps": 0, "drop_last": False,
        "objective": "sft", "ref_model": None, "beta": None,
        "num_generations": 8, "max_prompt_length": None, "max_completion_length": None,
        "num_iterations": 1, "vllm_gpu_memory_utilization": 0.0,
        "tp": 1, "sequence_parallel": False, "cp": 1, "pp": 1, "pp_schedule": "1f1b",
        "pp_virtual_stages": 1, "pp_microbatches": None, "ep": 1, "dp_replicate": 1,
        "dp_shard": None, "loss": None, "target_regex": None, "trainer": "transformers",
        "padded": False}
    # a spec that uses none of them serialises with the first rows' keys only
    assert set(TrainingSpec(model="tiny-llama").to_dict()) == {
        "model", "micro_batch", "seq_len", "images_per_sample", "image_size", "precision",
        "optimizer", "grad_ckpt", "train", "lora", "attn", "parallel"}


def test_every_field_is_declared_once_with_a_group_and_help():
    keys = [m.key for m in schema.FIELDS]
    assert len(keys) == len(set(keys))
    for m in schema.FIELDS:
        assert m.group in GROUPS and m.help.endswith(".") and "\n" not in m.help, m.key
    # the nested specs' fields are all there, flat
    assert {"lora_r", "lora_targets", "world_size", "strategy", "sub_group_size"} <= set(keys)


def test_choices_come_from_the_literals():
    assert schema.BY_KEY["precision"].choices == ("fp32", "bf16", "fp16", "bf16-mixed",
                                                  "fp16-mixed", "bf16-master",
                                                  "bf16-autocast")
    assert schema.BY_KEY["strategy"].choices == ("none", "ddp", "zero1", "zero2", "zero3", "fsdp")
    assert schema.BY_KEY["micro_batch"].choices is None


def test_schema_imports_neither_torch_nor_transformers():
    code = ("import sys, hybridmem.job.schema; "
            "print([m for m in ('torch', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


JOBS = [
    TrainingSpec(model="tiny-llama"),
    TrainingSpec(model="llava-1.5-7b", micro_batch=8, train="lora", grad_ckpt=True,
                 lora=LoraSpec(r=16, targets=("q_proj", "v_proj"), use_dora=True,
                               modules_to_save=("lm_head",)),
                 quantize="nf4", quant_skip=("lm_head", "mm_projector"), precision="bf16"),
    TrainingSpec(model="llama-3.2-3b", image_size=None, grad_ckpt=True,
                 grad_ckpt_policy="every:2", liger=True, grad_accum=4, max_grad_norm=1.0,
                 parallel=ParallelSpec(world_size=8, strategy="zero3", overlap_comm=False)),
    TrainingSpec(model="tiny-llava", image_size="28x56", images_per_sample=2,
                 parallel=ParallelSpec(world_size=2, strategy="fsdp",
                                       reshard_after_forward=False)),
]


@pytest.mark.parametrize("spec", JOBS)
def test_job_dict_round_trips_through_json(spec):
    job = json.loads(json.dumps(schema.job_dict(spec)))
    assert schema.spec_from_job(job) == spec
    assert schema.spec_from_job({**job, "warnings": ["ignored"]}) == spec


def test_job_dict_is_flat_with_the_schema_names():
    job = schema.job_dict(JOBS[2])
    assert job["world_size"] == 8 and job["strategy"] == "zero3" and "parallel" not in job
    assert schema.job_dict(JOBS[1])["lora"]["targets"] == ["q_proj", "v_proj"]
    assert set(job) == {f.name for f in schema.FIELDS if f.owner != "lora"} | {"lora"}


def test_unknown_job_key_is_one_line_naming_it():
    with pytest.raises(SpecError) as err:
        schema.spec_from_job({"model": "tiny-llama", "micro_batch_size": 2})
    msg = str(err.value)
    assert "\n" not in msg and "micro_batch_size" in msg and "micro_batch" in msg
    with pytest.raises(SpecError, match="job.lora.*rank"):
        schema.spec_from_job({"model": "tiny-llama", "train": "lora", "lora": {"rank": 4}})


# ---------------------------------------------------------------- the CLI is generated

# every option `hybridmem predict` had before the schema (names are a contract)
CONTRACT_OPTIONS = {
    "--model", "--micro-batch", "--seq-len", "--images-per-sample", "--image-size", "--precision",
    "--optimizer", "--grad-ckpt", "--no-grad-ckpt", "--grad-ckpt-policy", "--train", "--lora-r",
    "--lora-alpha", "--lora-targets", "--attn", "--peft-config", "--quantize",
    "--quantization-config", "--kbit-prep", "--no-kbit-prep", "--loop", "--max-grad-norm",
    "--grad-accum", "--optimizer-in-backward", "--no-optimizer-in-backward",
    "--offload-activations", "--packing", "--no-packing", "--empty-cache-steps", "--liger",
    "--no-liger", "--chunked-ce", "--recipe", "--deepspeed", "--training-args", "--world-size",
    "--strategy", "--zero-stage", "--offload-optimizer", "--offload-param", "--gpu", "--gpu-mem",
    "--find-max-batch", "--method", "--json", "--plot", "--timeline"}


def _click_command():
    import typer.main

    from hybridmem.cli import app

    group = typer.main.get_command(app)
    return group.commands["predict"]


def test_every_option_comes_from_the_schema_or_the_other_options():
    from hybridmem.cli.predict import OTHER_OPTIONS

    cmd = _click_command()
    by_param = {p.name: p for p in cmd.params if p.name != "help"}
    job = {m.key: m for m in schema.CLI_FIELDS}
    other = {o.name: o for o in OTHER_OPTIONS}
    assert set(by_param) == set(job) | set(other) and not set(job) & set(other)
    for name, param in by_param.items():
        names = set(param.opts) | set(param.secondary_opts)
        declared = job[name].cli if name in job else other[name].decls
        assert names == {n for d in declared for n in d.split("/")}, name
    # every field with a CLI name is an option, in its group's panel
    for m in schema.CLI_FIELDS:
        assert by_param[m.key].rich_help_panel == GROUPS[m.group]


def test_option_names_are_kept():
    cmd = _click_command()
    names = {n for p in cmd.params for n in (*p.opts, *p.secondary_opts)} - {"--help"}
    assert names >= CONTRACT_OPTIONS


def test_a_cli_only_field_reaches_the_spec_by_its_schema_key():
    from hybridmem.intake.resolve import spec_from_cli

    spec = spec_from_cli(model="tiny-llama", train="lora", lora_targets="q_proj, v_proj",
                         lora_dropout=0.1, world_size=2, strategy="zero2", sub_group_size=10**8)
    assert spec.lora.targets == ("q_proj", "v_proj") and spec.lora.dropout == 0.1
    assert spec.parallel.sub_group_size == 10**8
    with pytest.raises(SpecError, match="overrides='lora_rank'"):
        spec_from_cli(model="tiny-llama", lora_rank=4)


# ---------------------------------------------------------------- config readers' keys

def test_a_misspelled_training_args_key_warns_and_trainers_default_batch_is_priced(tmp_path):
    from hybridmem.intake.config_keys import collect_warnings
    from hybridmem.intake.merge import spec_from_inputs
    from hybridmem.intake.readers.trainer import HF_DEFAULT_BATCH

    path = tmp_path / "args.json"
    path.write_text(json.dumps({"per_device_train_batch_sise": 4, "bf16": True,
                                "learning_rate": 2e-5, "output_dir": "out"}))
    with collect_warnings() as caught:
        spec = spec_from_inputs(training_args=str(path), overrides={"model": "tiny-llama"})
    # Trainer never sees a batch size in this file: its default, not our spec's 1
    assert HF_DEFAULT_BATCH == 8 and spec.micro_batch == 8
    assert len(caught) == 1  # learning_rate / output_dir are TrainingArguments fields
    assert "per_device_train_batch_sise" in caught[0] and str(path) in caught[0]
    assert "nearest known key: per_device_train_batch_size" in caught[0]
    # given, the file's batch wins over the default, and a flag over both
    path.write_text(json.dumps({"per_device_train_batch_size": 4}))
    assert spec_from_inputs(training_args=str(path), overrides={"model": "tiny-llama"}).micro_batch == 4
    assert spec_from_inputs(training_args={"bf16": True},
                            overrides={"model": "tiny-llama", "micro_batch": 2}).micro_batch == 2


def test_without_a_collector_the_warning_is_a_python_warning():
    from hybridmem.intake.config_keys import ConfigKeyWarning
    from hybridmem.intake.readers.trainer import from_training_args

    with pytest.warns(ConfigKeyWarning, match="gradient_acumulation_steps.*gradient_accumulation_steps"):
        from_training_args({"gradient_acumulation_steps": 4})


def test_deepspeed_unknown_and_unpriced_keys_warn():
    from hybridmem.intake.config_keys import collect_warnings
    from hybridmem.intake.readers.deepspeed import from_deepspeed_json

    with collect_warnings() as caught:
        out = from_deepspeed_json({"zero_optimization": {"stage": 2, "reduce_bucket_sise": 5,
                                                          "round_robin_gradients": True,
                                                          "cpu_offload": True},
                                   "steps_per_print": 10, "gradient_clippin": 1.0})
    assert out["parallel"]["strategy"] == "zero2"
    text = "\n".join(caught)
    assert "'zero_optimization.reduce_bucket_sise'" in text and "reduce_bucket_size" in text
    assert "'gradient_clippin'" in text and "gradient_clipping" in text
    assert "cpu_offload" in text and "offload_optimizer" in text
    assert "round_robin" not in text and "steps_per_print" not in text
    # DeepSpeed's short aliases of the stage-3 knobs are read, not dropped
    out = from_deepspeed_json({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 7}})
    assert out["parallel"]["stage3_prefetch_bucket_size"] == 7


def test_bnb_and_peft_unknown_keys_warn(tmp_path):
    from hybridmem.intake.config_keys import collect_warnings
    from hybridmem.intake.merge import spec_from_inputs

    bnb = tmp_path / "bnb.json"
    bnb.write_text(json.dumps({"load_in_4bit": True, "bnb_4bit_quant_typ": "nf4"}))
    adapter = tmp_path / "adapter_config.json"
    adapter.write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                   "target_modules": ["q_proj"], "lora_dropuot": 0.1,
                                   "task_type": "CAUSAL_LM"}))
    with collect_warnings() as caught:
        spec_from_inputs(overrides={"model": "tiny-llama", "peft_config": str(adapter),
                                    "quantization_config": str(bnb)})
    text = "\n".join(caught)
    assert "bnb_4bit_quant_typ'" in text and "bnb_4bit_quant_type" in text
    assert "lora_dropuot'" in text and "lora_dropout" in text and "task_type" not in text


def test_every_conversion_key_is_declared_on_a_field():
    from hybridmem.intake.readers.common import CONVERSIONS

    for source, conversions in CONVERSIONS.items():
        declared = set(schema.config_keys(source))
        for c in conversions:
            assert set(c.reads) <= declared, (source, c.fn.__name__, set(c.reads) - declared)


def test_declared_training_args_keys_are_trainer_or_extension_fields():
    from hybridmem.intake.config_keys import training_args_known

    known = training_args_known()
    # world_size: torchrun's, not a TrainingArguments field; attn_implementation: a
    # TrainingArguments field of LLaVA-NeXT-style trainers (upstream LLaVA passes it to train())
    assert set(schema.config_keys("training_args")) - known <= {"world_size", "attn_implementation"}


# ---------------------------------------------------------------- the job echo

def test_json_carries_the_job_and_the_console_echoes_it_first(tmp_path, capsys, stub_tier):
    from hybridmem.cli import main

    args = tmp_path / "args.json"
    args.write_text(json.dumps({"per_device_train_batch_sise": 4, "gradient_checkpointing": True}))
    assert main(["predict", "--model", "tiny-llama", "--training-args", str(args), "--train",
                 "lora", "--lora-r", "4", "--method", "analytic", "--json"]) == 0
    captured = capsys.readouterr()
    job = json.loads(captured.out)["job"]
    assert (job["micro_batch"], job["grad_ckpt"], job["train"]) == (8, True, "lora")
    assert job["lora"]["r"] == 4 and job["world_size"] == 1 and job["strategy"] == "none"
    # the file's unread key (tiny-llama's 512 positions also warn: seq_len 2048 is past them)
    assert [w for w in job["warnings"] if "TrainingArguments key" in w] == [
        w for w in job["warnings"] if "per_device_train_batch_sise" in w] != []
    assert any("max_position_embeddings 512" in w for w in job["warnings"])
    assert "per_device_train_batch_sise" in captured.err
    assert schema.spec_from_job(job).micro_batch == 8
    assert main(["predict", "--model", "tiny-llama", "--micro-batch", "3", "--liger",
                 "--method", "analytic"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("model: tiny-llama")
    assert lines[1].startswith("batch: micro_batch=3 seq_len=2048")
    assert any(line.startswith("savers: liger=on") for line in lines[:6])
