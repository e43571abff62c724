"""The accuracy numbers README.md and docs/accuracy.md quote cannot go stale.

`experiments/published_accuracy.py` writes docs/accuracy-published.json and the markdown table
in both files; here the table must be exactly the JSON's, and the JSON's analytic and hybrid
rows must be what the code answers today on the committed published rows (the trace rows take
~10 minutes to recompute: they carry the tier fingerprint they were computed with).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from hybridmem.learned.accuracy import markdown

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "datasets" / "published"
NUMBERS = ROOT / "docs" / "accuracy-published.json"
BLOCK = re.compile(r"<!-- accuracy:published:start -->\n(.*?)\n<!-- accuracy:published:end -->", re.S)


def committed() -> pd.DataFrame:
    return pd.DataFrame(json.loads(NUMBERS.read_text())["table"])


@pytest.mark.parametrize("doc", ["README.md", "docs/accuracy.md"])
def test_docs_show_exactly_the_scripts_numbers(doc):
    found = BLOCK.search((ROOT / doc).read_text())
    assert found, f"{doc} has no accuracy:published block"
    assert found.group(1) == markdown(committed())


@pytest.fixture(scope="module")
def today(tmp_path_factory):
    from hybridmem.learned.compare import tier_accuracy

    return tier_accuracy(DATA, tiers=("analytic",), use_cache=False).table


@pytest.mark.parametrize("tier", ["analytic", "hybrid"])
def test_committed_numbers_are_todays(today, tier):
    old = committed()
    old, new = (t[t["tier"] == tier].set_index(["figure", "lengths", "group"]).sort_index()
                for t in (old, today))
    assert list(old.index) == list(new.index)
    cols = ["n", "median_signed", "median_ape", "p95_ape", "max_ape", "within_3pct", "under_share"]
    # analytic: deterministic closed forms; hybrid: LightGBM is deterministic for fixed data
    pd.testing.assert_frame_equal(old[cols], new[cols], atol=0.01, check_dtype=False)


def test_evaluate_cli_reports_tiers_by_group_and_figure(tmp_path):
    import typer

    from hybridmem.cli import evaluate, train

    app = typer.Typer()
    train.register(app)
    evaluate.register(app)
    csv = tmp_path / "errors.csv"
    out = CliRunner().invoke(app, ["evaluate", "--data", str(DATA), "--tiers", "analytic",
                                   "--errors-csv", str(csv)])
    assert out.exit_code == 0, out.output
    assert "reserved peak: error vs real GPUs" in out.output
    assert "allocated after the step: error vs real GPUs" in out.output
    for group in ("full", "lora", "dora"):
        assert group in out.output
    # the MetaMathQA rows' 768 is a cap (datasets/published/README.md): shown apart, with the need
    assert "upper bound" in out.output and "--lengths FILE" in out.output
    errors = pd.read_csv(csv)
    # every ok row of the committed dataset (165 + 24, datasets/published/README.md) per figure
    assert (errors.groupby(["figure", "tier"]).size() == 165 + 24).all()
    assert set(errors["tier"]) == {"analytic", "hybrid"}


def test_models_readme_describes_the_committed_model():
    meta = json.loads((ROOT / "models" / "published" / "metadata.json").read_text())
    text = (ROOT / "models" / "README.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `published`"))
    assert f"the {meta['dataset']['rows_used']} " in row
    # reserved peak from the peft-metamathqa rows, device figure from the qwen-profiling rows
    assert meta["calibrated_to_gpu"] is True and meta["targets"] == ["device", "reserved"]
    for torch_version in meta["torch_versions"]:
        assert torch_version.split("+")[0] in row
    for optimizer in meta["domain"]["optimizer"]:
        assert optimizer in row
    cv = meta["metrics"]["reserved"]
    assert f"MAPE {cv['hybrid']['mape']:.1f} % held out vs {cv['analytic']['mape']:.1f} %" in row


def test_models_readme_states_the_committed_trust_decisions():
    meta = json.loads((ROOT / "models" / "published" / "metadata.json").read_text())
    text = (ROOT / "models" / "README.md").read_text()
    names = {"lora": "LoRA", "dora": "DoRA", "full": "full"}
    for group, dec in meta["trust"]["reserved"].items():
        row = next(line for line in text.splitlines()
                   if line.startswith(f"| reserved | {names[group]} |"))
        cv = dec["evidence"]["cv"]
        assert f"{cv['rows']}, {cv['residual_mape']:.1f} % vs {cv['base_mape']:.1f} %" in row
        assert row.rstrip(" |").split("| ")[-1].startswith("yes" if dec["apply"] else "no")
