"""The family registry (`hybridmem/families/`, docs/design.md "Families"): one record per
model_type, read by every tier; adding a family is one file.

Oracles: transformers' own Auto mappings and config classes (kind, defaults), and a family
file written by the test (discovery, duplicate refusal).
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
    from hybridmem.job.images import HXW_FAMILIES, IMAGE_FAMILIES
    from hybridmem.models.decoder import MOE_TYPES, QK_NORM_TYPES
    from hybridmem.models.loader import DECODER_TYPES, MULTIMODAL_TYPES

    assert set(MULTIMODAL_TYPES) == {m for m, f in REGISTRY.items() if f.kind == VLM}
    assert set(DECODER_TYPES) == {m for m, f in REGISTRY.items() if f.kind == DECODER}
    assert set(HXW_FAMILIES) <= set(IMAGE_FAMILIES) <= set(REGISTRY)
    assert {"mixtral", "qwen3_moe"} <= set(MOE_TYPES)
    assert "qwen3" in QK_NORM_TYPES and "llama" not in QK_NORM_TYPES


def test_a_family_file_is_all_it_takes(tmp_path, monkeypatch):
    """A new file in the package is discovered; a model_type declared twice is refused."""
    name = "hybridmem.families.zz_test_family"
    path = tmp_path / "zz_test_family.py"
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(tmp_path)])
    path.write_text(textwrap.dedent("""
        from hybridmem.families import DECODER, Family
        FAMILIES = (Family("olmo2", DECODER, "modeling_olmo2.py",
                           text_defaults=dict(hidden_size=4096)),)
    """))
    monkeypatch.delitem(sys.modules, name, raising=False)
    found = families._discover()
    assert found["olmo2"].source == "modeling_olmo2.py" and set(REGISTRY) < set(found)
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
