"""`hybridmem models`: every shipped preset, its family and tiers, read from the presets and the
family registry (so the list cannot go stale as the README's did)."""

from __future__ import annotations

import json

from hybridmem.cli import main
from hybridmem.families import family
from hybridmem.models.loader import preset_names


def test_models_lists_every_preset_with_its_tiers(capsys):
    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == set(preset_names())
    for r in rows.values():
        fam = family(r["model_type"])
        analytic = fam is not None
        assert (r["params"] is not None) == analytic and ("analytic" in r["tiers"]) == analytic
        assert r["kind"] == fam.kind
        # shipped by the folder that declares its model_type (hybridmem/families/<family>/)
        folder = __import__(f"hybridmem.families.{r['family']}", fromlist=["FAMILIES"])
        assert r["model_type"] in {f.model_type for f in folder.FAMILIES}
    # hand derivation (tiny-llama.json): embed 128x64 + lm_head 128x64 + final norm 64 + 2
    # layers x (q 64x64 + k, v 32x64 + o 64x64 + gate, up, down 128x64 + 2 norms 64) = 90432
    assert rows["tiny-llama"]["params"] == 2 * 8192 + 64 + 2 * (4096 + 2 * 2048 + 4096
                                                                 + 3 * 8192 + 128)


def test_models_table_names_the_generic_path(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "llava-1.5-7b" in out and "--model path/to/config.json (trace tier)" in out


def test_the_docs_name_every_declared_family():
    """README's `--model` row and docs/trace.md's "Which models" name each family the registry
    declares (they went stale as families were added)."""
    from pathlib import Path

    from hybridmem.families import REGISTRY

    root = Path(__file__).resolve().parents[1]
    readme = next(l for l in (root / "README.md").read_text().splitlines()
                  if l.startswith("| `--model`"))
    which = (root / "docs" / "trace.md").read_text().split("## Which models")[1].split("\n\n")[1]
    for model_type in REGISTRY:
        assert f"`{model_type}`" in readme, model_type
        assert f"`{model_type}`" in which, model_type
