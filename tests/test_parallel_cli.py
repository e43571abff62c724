"""The pure functions behind the parallel options of `hybridmem predict`."""

from __future__ import annotations

import pytest

from hybridmem.errors import SpecError
from hybridmem.intake.resolve import spec_from_cli
from hybridmem.parallel.cli import fit_lines
from hybridmem.job.spec import TrainingSpec


def test_no_parallel_inputs_gives_the_plain_spec():
    assert spec_from_cli(model="llama-3.2-3b", micro_batch=None, precision=None) == \
        TrainingSpec(model="llama-3.2-3b")


def test_flags_override_recipe():
    spec = spec_from_cli(model="llava-1.5-13b", recipe="llava-1.5-finetune-lora", world_size=4,
                         lora_r=64, lora_targets="q_proj,v_proj", offload_optimizer="cpu")
    assert (spec.parallel.world_size, spec.lora.r, spec.lora.alpha) == (4, 64, 256)
    assert spec.lora.targets == ("q_proj", "v_proj")
    assert spec.parallel.offload_optimizer == "cpu"


def test_lora_flags_need_lora():
    with pytest.raises(SpecError, match="train='llm\\+projector'.*--lora-\\* options need --train lora"):
        spec_from_cli(model="llava-1.5-7b", recipe="llava-1.5-finetune", lora_r=16)


def test_fit_lines():
    opt = {"world_size": 8, "strategy": "zero3", "grad_ckpt": True, "peak_bytes": 30 * 2**30,
           "headroom_bytes": 10 * 2**30}
    fits = {"gpu": "a100-40gb", "gpu_memory_bytes": 40 * 2**30, "fits_as_is": True, "current": opt}
    assert fit_lines(fits) == ["fits a100-40gb (40.0 GiB) as configured: 8 GPU(s), zero3, "
                               "checkpointing on: 30.0 GiB per GPU (+10.0 GiB headroom)"]
    over = {**opt, "world_size": 2, "peak_bytes": 50 * 2**30, "headroom_bytes": -10 * 2**30}
    no = {**fits, "fits_as_is": False, "current": over, "world_size": opt, "zero_stage": None,
          "grad_ckpt": None, "micro_batch": {**over, "micro_batch": 3}}
    lines = fit_lines(no)
    assert lines[0].startswith("does not fit a100-40gb") and "-10.0 GiB headroom" in lines[0]
    assert lines[1].startswith("  smallest world size: 8 GPU(s)")
    assert "micro-batch 3" in lines[2]
