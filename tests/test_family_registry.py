"""The family registry (`hybridmem/families/`, docs/design.md "Families"): one record per
model_type, read by every tier; adding a family is one folder.

Oracles: transformers' own Auto mappings and config classes (kind, defaults), and a family
folder written by the test (discovery, duplicate refusal).
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest

import hybridmem.families as families
from hybridmem.families import DECODER, REGISTRY, VLM
from hybridmem.models.loader import CAUSAL_LM, IMAGE_TEXT_TO_TEXT, transformers_types


@pytest.mark.parametrize("model_type", sorted(REGISTRY))
def test_every_family_is_one_transformers_builds_as_its_kind(model_type):
    fam = REGISTRY[model_type]
    expected = IMAGE_TEXT_TO_TEXT if fam.kind == VLM else CAUSAL_LM
    assert transformers_types()[model_type] == expected
    if fam.kind == VLM:  # the analytic graph needs the family's parts
        assert fam.image_plan is not None and fam.vision_graph is not None
        assert fam.vision_seq is not None and (fam.light_config is not None or fam.full_config)
    if fam.kind == DECODER:
        assert fam.text_defaults and fam.image_plan is None


@pytest.mark.parametrize("model_type", families.types(DECODER))
def test_decoder_defaults_are_the_config_class_defaults(model_type):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    for key, value in REGISTRY[model_type].text_defaults.items():
        # None: resolved from other fields (kv heads = heads, head_dim = hidden / heads);
        # a field the class no longer defines is read with the record's value (phi3's
        # partial_rotary_factor lives in rope_parameters, gemma3's pattern in layer_types)
        if value is not None and hasattr(config, key):
            assert getattr(config, key) == value, key


def test_the_tuples_other_modules_export_are_views_of_the_registry():
    from hybridmem.families.common.images import HXW_FAMILIES, IMAGE_FAMILIES
    from hybridmem.families.common.decoder_graph import MOE_TYPES, QK_NORM_TYPES
    from hybridmem.models.loader import DECODER_TYPES, MULTIMODAL_TYPES

    assert set(MULTIMODAL_TYPES) == {m for m, f in REGISTRY.items() if f.kind == VLM}
    assert set(DECODER_TYPES) == {m for m, f in REGISTRY.items() if f.kind == DECODER}
    assert set(HXW_FAMILIES) <= set(IMAGE_FAMILIES) <= set(REGISTRY)
    assert {"mixtral", "qwen3_moe"} <= set(MOE_TYPES)
    assert "qwen3" in QK_NORM_TYPES and "llama" not in QK_NORM_TYPES


def test_a_family_folder_is_all_it_takes(tmp_path, monkeypatch):
    """A new folder in the package is discovered; a model_type declared twice is refused."""
    name = "hybridmem.families.zz_test_family"
    folder = tmp_path / "zz_test_family"
    folder.mkdir()
    path = folder / "__init__.py"
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(tmp_path)])
    path.write_text(textwrap.dedent("""
        from hybridmem.families import DECODER, Family
        FAMILIES = (Family("granite", DECODER, "modeling_granite.py",
                           text_defaults=dict(hidden_size=4096)),)
    """))
    monkeypatch.delitem(sys.modules, name, raising=False)
    found = families._discover()
    assert found["granite"].source == "modeling_granite.py" and set(REGISTRY) < set(found)
    path.write_text("from hybridmem.families import DECODER, Family\n"
                    "FAMILIES = (Family('llama', DECODER, 'x.py'),)\n")
    sys.modules.pop(name)
    importlib.invalidate_caches()
    with pytest.raises(RuntimeError, match="'llama' declared twice"):
        families._discover()
    sys.modules.pop(name, None)


def test_the_registry_imports_neither_torch_nor_transformers():
    code = ("import sys, hybridmem.families as f; f.types(); "
            "print(int('torch' in sys.modules), int('transformers' in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["0", "0"]


def test_a_layer_kind_no_family_registered_is_an_error_naming_it(monkeypatch):
    """The analytic tier prices a layer by its family's registered closed form
    (`Family.layer_kinds`); a kind nobody registered is refused, never priced as nothing."""
    from dataclasses import replace

    from hybridmem import TrainingSpec
    from hybridmem.families import UnpricedLayerKind
    from hybridmem.models import build_graph

    E = importlib.import_module("hybridmem.analytic.estimate")
    spec = TrainingSpec(model="tiny-llava", micro_batch=1, seq_len=700)
    graph = build_graph(spec)
    renamed = tuple(replace(m, layers=tuple(
        replace(layer, kind="made_up_norm") if layer.kind == "layernorm" else layer
        for layer in m.layers)) for m in graph.modules)
    monkeypatch.setattr(E, "build_graph", lambda s: replace(graph, modules=renamed))
    with pytest.raises(UnpricedLayerKind, match="'made_up_norm'"):
        E.estimate(spec)


def test_every_layer_of_every_preset_graph_has_a_registered_kind():
    from hybridmem import TrainingSpec
    from hybridmem.families import layer_kinds
    from hybridmem.models import build_graph, preset_names

    made = set()
    for name in preset_names():
        for _, layer in build_graph(TrainingSpec(model=name, micro_batch=1,
                                                 seq_len=8192)).layers():
            made |= {layer.kind, layer.formula or layer.kind}
    assert made <= set(layer_kinds())


def test_a_kind_two_families_register_differently_is_refused(monkeypatch):
    from dataclasses import replace

    from hybridmem.families import LayerKind, layer_kinds

    llama, mistral = REGISTRY["llama"], REGISTRY["mistral"]
    monkeypatch.setitem(REGISTRY, "mistral", replace(
        mistral, layer_kinds=lambda: {"rmsnorm": LayerKind(lambda *a: None)}))
    layer_kinds.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="'rmsnorm' registered twice"):
            layer_kinds()
    finally:
        monkeypatch.setitem(REGISTRY, "mistral", mistral)
        layer_kinds.cache_clear()
    assert layer_kinds()["rmsnorm"] == llama.layer_kinds()["rmsnorm"]


def test_the_shared_decoder_code_names_no_family():
    """What one decoder family does differently is in its record (`Family.traits`, its hooks),
    never a `model_type` compared in the shared graph or closed forms."""
    import re
    from pathlib import Path

    common = Path(families.__file__).parent / "common"
    compared = re.compile(r"""model_type *(==|!=|(not +)?in) *[(\[{]*["']""")
    for name in ("decoder_graph.py", "decoder_acts.py", "objective_acts.py"):
        assert not compared.search((common / name).read_text()), name


def test_gemma3s_default_layer_types_are_its_config_classes():
    """Oracle: transformers' Gemma3TextConfig fills `layer_types` from the pattern itself."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from hybridmem.families.common.decoder_graph import layer_types, rope_tables

    config = AutoConfig.for_model("gemma3_text", num_hidden_layers=13)
    light = SimpleNamespace(model_type="gemma3_text", num_hidden_layers=13, layer_types=None,
                            sliding_window_pattern=6)
    assert layer_types(light) == list(config.layer_types)
    assert rope_tables(light) == ("full_attention", "sliding_attention")
    llama = SimpleNamespace(model_type="llama", num_hidden_layers=3)
    assert layer_types(llama) == ["full_attention"] * 3 and rope_tables(llama) == ("",)


def test_the_moe_families_records_give_their_experts():
    """Oracle: the config classes' expert fields (configuration_mixtral.py: 8 local experts,
    top-2, intermediate 14336; configuration_qwen3_moe.py: 128 experts, top-8, 768 with
    `decoder_sparse_step` / `mlp_only_layers` choosing the sparse layers)."""
    from transformers import AutoConfig

    from hybridmem.families.common.decoder_graph import moe, moe_dims, moe_layer

    mixtral = AutoConfig.for_model("mixtral")
    assert moe(mixtral) == (8, 2, 14336) and moe_layer(mixtral, 0)
    assert moe_dims(mixtral, {})["router_fp32_weights"]
    qwen = AutoConfig.for_model("qwen3_moe", decoder_sparse_step=2, mlp_only_layers=[3])
    assert moe(qwen) == (128, 8, 768)
    assert [moe_layer(qwen, i) for i in range(6)] == [False, True, False, False, False, True]
    assert not moe_dims(qwen, {})["router_norm"]  # norm_topk_prob False
    assert moe(AutoConfig.for_model("llama")) == (0, 0, 0)
    assert not moe_layer(AutoConfig.for_model("llama"), 0)
