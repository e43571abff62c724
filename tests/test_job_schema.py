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
        ("packing", ("bool", False))]


def test_added_defaults_keep_old_spec_hashes():
    assert ADDED_DEFAULTS == {
        "loop": "trainer", "max_grad_norm": 0.0, "grad_accum": 1, "peft_config": None,
        "empty_cache_steps": 0, "grad_ckpt_policy": "full", "optimizer_in_backward": False,
        "quantize": "none", "quant_double_quant": True, "quant_compute_dtype": None,
        "quant_storage": "uint8", "quant_skip": None, "kbit_prep": True, "liger": False,
        "chunked_ce": 0, "offload_activations": "none", "packing": False,
        "use_dora": False, "use_rslora": False, "modules_to_save": ()}
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
                                                  "fp16-mixed", "bf16-master")
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
    from hybridmem.parallel.cli import spec_from_cli

    spec = spec_from_cli(model="tiny-llama", train="lora", lora_targets="q_proj, v_proj",
                         lora_dropout=0.1, world_size=2, strategy="zero2", sub_group_size=10**8)
    assert spec.lora.targets == ("q_proj", "v_proj") and spec.lora.dropout == 0.1
    assert spec.parallel.sub_group_size == 10**8
    with pytest.raises(SpecError, match="overrides='lora_rank'"):
        spec_from_cli(model="tiny-llama", lora_rank=4)
