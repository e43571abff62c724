"""Every recorded job field (hybridmem/job/recorded.py) is a dataset column with the spec's
default, a sweep axis, documented in datasets/README.md, and round-trips through a sweep item."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from hybridmem.harness.schema import ADDED_COLUMNS, COLUMNS
from hybridmem.harness.sweep import AXES, PARALLEL_AXES, SPEC_AXES
from hybridmem.job.parallel import ParallelSpec
from hybridmem.job.recorded import PARALLEL_RECORDED, RECORDED, recorded_fields, recorded_values
from hybridmem.job.spec import TrainingSpec

ROOT = Path(__file__).resolve().parents[1]


def test_each_recorded_field_is_a_column_an_axis_and_documented():
    doc = (ROOT / "datasets" / "README.md").read_text()
    defaults = {f.name: f.default for f in fields(TrainingSpec)}
    # the model-parallel layout's recorded fields live on the spec's ParallelSpec
    defaults |= {f.name: f.default for f in fields(ParallelSpec) if f.name in PARALLEL_RECORDED}
    for name, (dtype, default) in RECORDED.items():
        assert COLUMNS[name] == dtype and ADDED_COLUMNS[name] == default
        assert defaults[name] == default  # older parts read back as the spec's own default
        assert AXES[name] == [default]
        assert name in (PARALLEL_AXES if name in PARALLEL_RECORDED else SPEC_AXES)
        # a row of its own, or one row for several columns of one dtype (`tp`, `cp`, ...)
        rows = [r.split("|") for r in doc.splitlines() if r.startswith("| `")]
        assert any(f"`{name}`" in [c.strip() for c in r[1].split(",")]
                   for r in rows if len(r) > 2 and r[2].strip() == dtype), name


def test_values_are_typed_and_whole_numbers_become_floats():
    spec = TrainingSpec(model="tiny-llama", max_grad_norm=1, liger=True, chunked_ce=0)
    values = recorded_values(spec)
    assert values["max_grad_norm"] == 1.0 and isinstance(values["max_grad_norm"], float)
    assert values["liger"] is True
    combo = {name: default for name, (_, default) in RECORDED.items()} | {"max_grad_norm": 1}
    assert isinstance(recorded_fields(combo)["max_grad_norm"], float)
    assert recorded_fields(combo | {"liger": "yes"})["liger"] == "yes"  # left to the spec's check
