"""Every layer's `dims` fit the TypedDict its priced kind declares (`families.LayerKind.dims`).

The closed forms read a layer's dims by key; a typo in a graph builder, a key one family adds
that the formula never reads, or an int where a bool is meant would otherwise price silently.
The graphs: every preset, full and LoRA, with and without images where the model has a tower,
plus an objective's score head (vocab 1).
"""

from __future__ import annotations

import pytest

from hybridmem.families import dims_problems, layer_kinds
from hybridmem.families.defaults import as_job
from hybridmem.job.spec import TrainingSpec
from hybridmem.models import build_graph, preset_names


def test_every_layer_kind_declares_its_dims():
    assert [k for k, lk in layer_kinds().items() if lk.dims is None] == []


@pytest.mark.parametrize("name", preset_names())
def test_a_preset_graph_fits_its_declared_dims(name):
    jobs = [dict(), dict(train="lora"), dict(images_per_sample=0)]
    problems = set()
    for kw in jobs:
        graph = build_graph(as_job(TrainingSpec(model=name, seq_len=8192, **kw)))
        for _, layer in graph.layers():
            problems.update(dims_problems(layer))
    assert sorted(problems) == []


def test_a_misspelt_or_mistyped_key_is_named():
    from dataclasses import replace

    graph = build_graph(as_job(TrainingSpec(model="tiny-llava")))
    layer = next(l for _, l in graph.layers() if l.kind == "decoder_layer")
    bad = replace(layer, dims={**layer.dims, "hiden": 4, "qk_norm": 1})
    del bad.dims["ffn"]
    assert dims_problems(bad) == ["decoder_layer.ffn: missing",
                                  "decoder_layer.qk_norm: int, declared bool",
                                  "decoder_layer.hiden: not declared in DecoderLayerDims"]
