"""The technique plug-ins (`hybridmem.techniques`): the loss replacements are one axis whose
old flags fold onto it, every technique module is found with its protocol, and each prices
what it did as a flag."""

from __future__ import annotations

import pkgutil

import pytest

import hybridmem.techniques as techniques
from hybridmem import TrainingSpec
from hybridmem.analytic import estimate as analytic
from hybridmem.errors import SpecError
from hybridmem.techniques.protocol import REQUIRED

SHARED = {"protocol", "kernels", "liger_kernels", "offload_hooks"}  # helpers, not techniques


def tiny(**kw) -> TrainingSpec:
    return TrainingSpec(model="tiny-llama", micro_batch=2, seq_len=64, precision="bf16", **kw)


def test_every_technique_module_is_registered_with_the_protocol():
    modules = {m.name for m in pkgutil.iter_modules(techniques.__path__)} - SHARED
    assert {m.__name__.rsplit(".", 1)[1] for m in techniques.TECHNIQUES.values()} == modules
    for module in techniques.TECHNIQUES.values():
        assert all(hasattr(module, attr) for attr in REQUIRED), module.__name__
    assert {"packing", "optimizer-in-backward", "offload", "sac",
            "quantize"} <= set(techniques.TECHNIQUES)
    assert set(techniques.LOSS_CHOICES) >= {"none", "liger", "chunked-ce", "cce"}


@pytest.mark.parametrize("choice, flags", [
    ("liger", dict(liger=True)),
    ("cce", dict(cut_cross_entropy=True)),
    ("chunked-ce", dict(chunked_ce=8)),  # torchtune's recipes' num_output_chunks
    ("none", dict()),
])
def test_the_loss_axis_and_its_shorthands_are_the_same_job(choice, flags):
    by_axis, by_flag = tiny(loss=choice), tiny(**flags)
    assert by_axis == by_flag and techniques.loss_choice(by_flag) == choice
    assert analytic(by_axis).peak == analytic(by_flag).peak


def test_the_loss_axis_takes_one_choice():
    with pytest.raises(SpecError) as err:
        tiny(loss="cce", liger=True)
    assert err.value.field == "loss" and "--liger" in str(err.value)
    with pytest.raises(SpecError) as err:
        tiny(loss="fused")
    assert err.value.field == "loss" and "liger" in str(err.value)
    assert tiny(loss="chunked-ce", chunked_ce=4).chunked_ce == 4  # the flag sets its N


def test_cli_loss_option_folds_onto_the_flag(capsys):
    from hybridmem.cli import main

    code = main(["predict", "--model", "tiny-llama", "--precision", "bf16", "--loss", "cce",
                 "--method", "analytic", "--json"])
    assert code == 0 and '"cut_cross_entropy": true' in capsys.readouterr().out
