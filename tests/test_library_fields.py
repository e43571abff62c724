"""Config classes' field names read from source (`intake.library_fields`) equal what
`dataclasses.fields` says of the installed classes, and the config front doors that use them
import neither transformers nor torch."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hybridmem.intake import config_keys, library_fields

ROOT = Path(__file__).resolve().parents[1]


def _real(cls) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


def test_training_arguments_fields_match_the_installed_transformers():
    transformers = pytest.importorskip("transformers")
    assert library_fields.class_fields(*config_keys.TRAINING_ARGS) == _real(
        transformers.TrainingArguments)
    assert library_fields.class_fields("transformers.training_args_seq2seq",
                                       "Seq2SeqTrainingArguments") == _real(
        transformers.Seq2SeqTrainingArguments)


def test_sft_config_fields_match_the_installed_trl():
    trl = pytest.importorskip("trl")
    got = library_fields.class_fields(*config_keys.SFT_CONFIG,
                                      hints={"TrainingArguments": config_keys.TRAINING_ARGS})
    assert got == _real(trl.SFTConfig)


def test_every_peft_method_config_matches_the_installed_peft():
    peft = pytest.importorskip("peft")
    wrong = {}
    for peft_type, cls in peft.PEFT_TYPE_TO_CONFIG_MAPPING.items():
        name = getattr(peft_type, "value", peft_type)
        where = library_fields.peft_config_class(name)
        got = library_fields.class_fields(*where) if where else None
        if got != _real(cls):
            wrong[name] = where
    assert not wrong
    assert "lora_alpha" in config_keys.peft_known("LORA")


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """A package `fakecfg` on sys.path (the readers' caches cleared around it)."""
    root = tmp_path / "fakecfg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "base.py").write_text(textwrap.dedent("""\
        from dataclasses import dataclass, field, InitVar, KW_ONLY
        from typing import ClassVar

        class Plain:
            not_a_field: int = 0

        @dataclass
        class Base(Plain):
            a: int = 1
            kind: ClassVar[str] = "x"
            _: KW_ONLY
            b: "str" = "b"
            init_only: InitVar[int] = 0
            not_annotated = 3
        """))
    (root / "child.py").write_text(textwrap.dedent("""\
        import dataclasses
        from .base import Base

        @dataclasses.dataclass
        class Child(Base):
            c: float = 0.0

        class NotADataclass(Base):
            e: int = 0
        """))
    (root / "orphan.py").write_text(textwrap.dedent("""\
        from dataclasses import dataclass
        from elsewhere import Unknown

        @dataclass
        class Orphan(Unknown):
            d: int = 0
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    library_fields._package_dir.cache_clear()
    library_fields._tree.cache_clear()
    yield "fakecfg"
    library_fields._package_dir.cache_clear()
    library_fields._tree.cache_clear()


def test_fields_follow_dataclass_bases_as_dataclasses_does(fake_package):
    got = library_fields.class_fields("fakecfg.child", "Child")
    # ClassVar, InitVar, KW_ONLY and a non-dataclass base's annotations are not fields
    assert got == {"a", "b", "c"}
    assert "fakecfg.child" not in sys.modules  # read, never imported
    import importlib

    importlib.invalidate_caches()
    real = importlib.import_module("fakecfg.child")
    assert got == _real(real.Child)  # what dataclasses itself says


def test_what_the_source_does_not_say_is_none(fake_package):
    assert library_fields.class_fields("fakecfg.orphan", "Orphan") is None  # base not followed
    assert library_fields.class_fields("fakecfg.child", "NotADataclass") is None
    assert library_fields.class_fields("fakecfg.child", "Missing") is None
    assert library_fields.class_fields("not_installed_pkg_xyz.mod", "X") is None
    assert library_fields.installed("fakecfg")
    assert not library_fields.installed("not_installed_pkg_xyz")


NO_HEAVY = """
import json, sys
from hybridmem.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "heavy": sorted(m for m in ("torch", "transformers", "peft")
                                             if m in sys.modules)}))
"""


@pytest.mark.parametrize("files", [
    ["--config", "experiments/bench_inputs/llamafactory_lora_sft.yaml"],
    ["--model", "llama-3.2-3b", "--train", "lora", "--training-args",
     "experiments/bench_inputs/training_args.json"],
])
def test_config_files_are_read_without_transformers(files, tmp_path):
    argv = ["predict", *(str(ROOT / a) if a.startswith("experiments/") else a for a in files),
            "--gpu", "a100-40gb", "--json"]
    environ = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", NO_HEAVY, *argv], cwd=tmp_path, env=environ,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    answer, _, tail = proc.stdout.rstrip().rpartition("\n")
    assert json.loads(tail) == {"rc": 0, "heavy": []}
    # every key of both files is a field of TrainingArguments or the launcher's: no warning
    assert json.loads(answer)["job"]["warnings"] == []
