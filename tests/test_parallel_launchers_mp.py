"""torchtitan TOML and Megatron-LM arguments as launcher dialects (intake/dialects/
torchtitan.py, megatron.py): every key read, known or warned; the layouts they give are
priced per rank. The TOMLs under tests/data/torchtitan have the shape of torchtitan's own
llama3_{8b,70b,405b}.toml (pytorch/torchtitan torchtitan/models/llama3/train_configs)."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from hybridmem.errors import SpecError
from hybridmem.intake.resolve import spec_from_cli
from hybridmem.intake.dialects import read_config

DATA = Path(__file__).parent / "data"


def _spec(path, **flags):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = spec_from_cli(config=str(path), **flags)
    return spec, [str(w.message) for w in caught]


def test_torchtitan_70b_reads_the_mesh_and_torchtitan_defaults():
    spec, _ = _spec(DATA / "torchtitan" / "llama3_70b.toml",
                    world_size=64)
    ps = spec.parallel
    assert spec.model == "llama-3.1-70b" and spec.micro_batch == 8 and spec.seq_len == 8192
    assert (ps.tp, ps.data_shard, ps.strategy, ps.sequence_parallel) == (8, 8, "fsdp", True)
    assert spec.precision == "bf16-mixed" and (ps.mp_param_dtype, ps.mp_reduce_dtype) == (
        "bf16", "fp32")  # torchtitan's MixedPrecisionPolicy(bf16, fp32) over fp32 params
    assert spec.grad_ckpt and spec.optimizer == "adamw-fused"


def test_torchtitan_405b_warns_about_what_it_does_not_price():
    _, warned = _spec(DATA / "torchtitan" / "llama3_405b.toml", world_size=128)
    assert any("model.converters" in w for w in warned)
    assert any("training.compile" in w for w in warned)


def test_torchtitan_unknown_key_is_warned_with_the_nearest(tmp_path):
    toml = tmp_path / "x.toml"
    toml.write_text('[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\n'
                    'tensor_paralel_degree = 2\n')
    _, warned = _spec(toml, world_size=8)
    assert any("parallelism.tensor_paralel_degree" in w and "tensor_parallel_degree" in w
               for w in warned)


def test_torchtitan_pipeline_schedule_and_microbatches(tmp_path):
    toml = tmp_path / "pp.toml"
    toml.write_text('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 8\n'
                    '[parallelism]\npipeline_parallel_degree = 4\n'
                    'pipeline_parallel_schedule = "Interleaved1F1B"\n'
                    'pipeline_parallel_layers_per_stage = 4\n'
                    'pipeline_parallel_microbatch_size = 1\n')
    spec, _ = _spec(toml, world_size=8)
    ps = spec.parallel
    assert (ps.pp, ps.pp_schedule, ps.pp_virtual_stages, ps.microbatches) == (
        4, "interleaved-1f1b", 2, 8)  # 32 layers / (4 ranks x 4 layers per stage)
    assert spec.micro_batch == 1 and ps.reshard_after_forward is False  # torchtitan under PP


def test_torchtitan_unknown_flavor_is_one_line(tmp_path):
    toml = tmp_path / "x.toml"
    toml.write_text('[model]\nname = "llama3"\nflavor = "debugmodel"\n')
    with pytest.raises(SpecError, match="model.flavor='debugmodel'"):
        read_config(toml)


def test_megatron_arguments_file(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "64")
    spec, warned = _spec(DATA / "megatron_llama2_70b.sh")
    ps = spec.parallel
    assert (ps.tp, ps.pp, ps.pp_schedule, ps.pp_virtual_stages) == (8, 4, "interleaved-1f1b", 5)
    assert ps.sequence_parallel and ps.strategy == "zero1" and ps.data_shard == 2
    assert ps.microbatches == 16 // (1 * 2)  # global / (micro x dp)
    assert spec.precision == "bf16-master" and spec.attn == "flash_attention_2"
    assert any("bogus_knob" in w for w in warned)
    assert not any("train_iters" in w or "data_path" in w for w in warned)  # known keys


def test_megatron_model_has_llama_2_70b_parameters(monkeypatch):
    """The config written from the arguments has Llama-2-70B's parameter count (the preset's
    meta-device count: 68,976,648,192)."""
    from hybridmem.parallel.states import model_tensors

    monkeypatch.setenv("WORLD_SIZE", "64")
    spec, _ = _spec(DATA / "megatron_llama2_70b.sh")
    preset = model_tensors(spec.with_(model="llama-2-70b",
                                      parallel=spec.parallel.__class__())).params
    assert model_tensors(spec.with_(parallel=spec.parallel.__class__())).params == preset


def test_cli_prices_torchtitan_70b_per_rank():
    out = subprocess.run(
        [sys.executable, "-m", "hybridmem", "predict", "--config",
         str(DATA / "torchtitan" / "llama3_70b.toml"), "--world-size", "64", "--json"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["method"] == "analytic+layout" and answer["layout"]["tp"] == 8
    assert answer["job"]["tp"] == 8 and answer["job"]["world_size"] == 64


def test_http_api_takes_torchtitan_toml_text(tmp_path):
    """`POST /v1/predict` with a pasted torchtitan TOML (`config_format: torchtitan`)."""
    from hybridmem.answer import resolve_job
    from hybridmem.serve.request import parse_body

    text = (DATA / "torchtitan" / "llama3_70b.toml").read_text()
    job = parse_body({"config": text, "config_format": "torchtitan", "world_size": 64}, tmp_path)
    spec = resolve_job(job.values)[0].spec
    assert (spec.model, spec.parallel.tp, spec.parallel.data_shard) == ("llama-3.1-70b", 8, 8)
