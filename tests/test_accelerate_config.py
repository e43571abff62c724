"""accelerate's own config file (`accelerate config` YAML) read by `--config`: the strategy,
FSDP2's mixed-precision policy, the world size, every key used / known / warned."""

from __future__ import annotations

import json

import pytest

from hybridmem.errors import SpecError
from hybridmem.intake.config_keys import collect_warnings
from hybridmem.intake.merge import spec_from_inputs
from hybridmem.intake.dialects import detect
from hybridmem.intake.resolve import resolve

# the file `accelerate config` writes for FSDP2 on one 8-GPU machine (keys of accelerate's
# commands/config/cluster.py, FSDP2 as its docs' fsdp2 example config)
FSDP2 = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: true
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def _read(tmp_path, text: str, name: str = "acc.yaml", **flags):
    path = tmp_path / name
    path.write_text(text)
    with collect_warnings() as caught:
        resolved = resolve(config=str(path), overrides={"model": "llama-3.1-8b", **flags})
    return resolved.spec, resolved.sources, list(caught), str(path)


def test_fsdp2_is_the_job_accelerate_runs(tmp_path):
    spec, sources, warned, path = _read(tmp_path, FSDP2)
    assert warned == []  # every key read or known
    flags = spec_from_inputs(overrides=dict(
        model="llama-3.1-8b", train="full",
        strategy="fsdp", world_size=8,        # distributed_type FSDP, num_processes 8
        reshard_after_forward=True, grad_ckpt=True,  # fsdp_reshard_after_forward, ..._checkpointing
        # mixed_precision bf16: fp32 sharded params (fsdp2_prepare_model upcasts them) under
        # autocast; set_mixed_precision's policy gathers and reduces in bf16
        precision="bf16-mixed", mp_param_dtype="bf16", mp_reduce_dtype="bf16"))
    assert spec == flags
    assert sources["world_size"] == f"{path}: num_processes"
    assert sources["mp_param_dtype"].startswith(f"{path}: mixed_precision")


def test_the_file_policy_and_flags_win(tmp_path):
    text = FSDP2.replace("  fsdp_version: 2\n", "  fsdp_version: 2\n  fsdp_mixed_precision_policy:"
                         "\n    param_dtype: bfloat16\n    reduce_dtype: float32\n")
    spec, *_ = _read(tmp_path, text)
    assert (spec.parallel.mp_param_dtype, spec.parallel.mp_reduce_dtype) == ("bf16", "fp32")
    spec, *_ = _read(tmp_path, FSDP2, mp_reduce_dtype="fp32")
    assert spec.parallel.mp_reduce_dtype == "fp32"


def test_deepspeed_block_and_file(tmp_path):
    text = ("distributed_type: DEEPSPEED\nmixed_precision: bf16\nnum_processes: 8\n"
            "deepspeed_config:\n  zero_stage: 3\n  offload_optimizer_device: none\n"
            "  zero3_init_flag: true\n")
    spec, *_ = _read(tmp_path, text)
    # DeepSpeedPlugin: bf16 enabled -> bf16 weights with fp32 master copies
    assert (spec.parallel.strategy, spec.parallel.world_size, spec.precision) == (
        "zero3", 8, "bf16-master")
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2},
                                                  "bf16": {"enabled": True}}))
    text = ("distributed_type: DEEPSPEED\nnum_processes: 2\n"
            "deepspeed_config:\n  deepspeed_config_file: ds.json\n")
    spec, *_ = _read(tmp_path, text, name="acc2.yaml")
    assert spec.parallel.strategy == "zero2"


def test_keys_unknown_warned_and_bad_values_refused(tmp_path):
    *_, warned, _ = _read(tmp_path, FSDP2 + "num_proceses: 4\n")
    assert len(warned) == 1 and "nearest known key: num_processes" in warned[0]
    assert detect({"distributed_type": "NO"}, "f") == "accelerate"
    with pytest.raises(SpecError, match="mixed_precision"):
        _read(tmp_path, FSDP2.replace("mixed_precision: bf16", "mixed_precision: fp8"))
    with pytest.raises(SpecError, match="offload"):
        _read(tmp_path, FSDP2.replace("fsdp_offload_params: false", "fsdp_offload_params: true"))
    spec, *_ = _read(tmp_path, "distributed_type: MULTI_GPU\nnum_processes: 4\n")
    # no mixed_precision: accelerate casts nothing, the model's default precision stands
    assert (spec.parallel.strategy, spec.precision) == ("ddp", None)
