"""HxW image sizes through the CUDA harness: sweep axis, dataset row, spec read back, features.

Old datasets (an int64 `image_size`, no `image_width`) must still load and dedup as before, and
square sizes keep their spec hash (docs: datasets/README.md, datasets/sweeps/README.md).
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

from hybridmem.harness import store
from hybridmem.harness.collection import make_row
from hybridmem.harness.image_columns import image_columns
from hybridmem.harness.schema import COLUMNS, spec_from_row
from hybridmem.harness.sweep import load_sweep

SWEEP = """
[sweep]
name = "hxw"
[[block]]
model = ["tiny-qwen2.5-vl", "tiny-mistral3", "tiny-llava"]
image_size = ["56x84", "56x56", 56]
micro_batch = [2]
seq_len = [64]
precision = ["fp32"]
"""


def _sweep(tmp_path, text=SWEEP):
    path = tmp_path / "s.toml"
    path.write_text(text)
    return load_sweep(path)


def _items(sweep) -> dict:
    return {(it.label, it.spec.image_size): it for it in sweep.items}


def test_an_hxw_axis_plans_with_the_family_token_counts(tmp_path):
    sweep = _sweep(tmp_path)
    items = _items(sweep)
    # "56x56" and 56 are one axis value (the spec's stored form of a square is the int)
    assert {k for k in items if k[0] != "tiny-llava"} == {
        ("tiny-mistral3", 56), ("tiny-mistral3", "56x84"),
        ("tiny-qwen2.5-vl", 56), ("tiny-qwen2.5-vl", "56x84")}
    assert len(sweep.items) == len(items)
    # hand counts: Qwen2.5-VL smart_resize keeps 56x84 (multiples of 28) -> 4 x 6 patches,
    # 2 x 2 merged -> 2 x 3 = 6 tokens; Pixtral (14 px patches, 2 x 2 merge, longest edge 112
    # not reached) -> 2 rows x 3 cols = 6 [IMG] tokens
    assert items[("tiny-qwen2.5-vl", "56x84")].image_tokens == 6
    assert items[("tiny-mistral3", "56x84")].image_tokens == 6
    # LLaVA-1.5 builds its CLIP tower square: the HxW combination is dropped, counted
    assert ("tiny-llava", "56x84") not in items
    assert any(k.startswith("image_size: HxW needs a family") for k in sweep.dropped)


def test_square_sizes_keep_their_spec_hash(tmp_path):
    items = _items(_sweep(tmp_path))
    # pinned: spec_hash of this item computed by the sweep of main at 055e86d (before HxW
    # rows) from this block at image_size = [56] (main could not plan Qwen-VL models: its
    # run-time estimate read a `num_hidden_layers` their towers do not have)
    assert items[("tiny-mistral3", 56)].spec_hash == (
        "da5cfc33e5facab7f3b1fc64fd8b45281a3781d2ed09a8d9450af5dd778d181b")
    assert items[("tiny-mistral3", 56)].spec.to_dict()["image_size"] == 56  # an int, as before


def test_bad_hxw_axis_value_names_the_block(tmp_path):
    from hybridmem.errors import SpecError

    with pytest.raises(SpecError, match=r"block\[0\]\.image_size"):
        _sweep(tmp_path, SWEEP.replace('"56x84"', '"56by84"'))


def _fake_row(item, sweep):
    """A collect row for `item` with made-up peaks (what is checked is the spec columns)."""
    result = {"outcome": "ok", "peak_allocated_bytes": 100, "peak_reserved_bytes": 200,
              "peak_device_bytes": 300, "iteration_seconds": [1.0, 1.0, 1.0]}
    env = {"gpu_name": "NVIDIA H200", "gpu_memory_bytes": 1, "torch_version": "2.13.0",
           "cuda_version": "12.8", "transformers_version": "5.24", "driver_version": "",
           "alloc_conf": "", "hostname": "h"}
    return make_row(item, result, env, "cuda", sweep, 1.0)


def test_the_row_records_hxw_and_reads_back_the_same_spec(tmp_path):
    sweep = _sweep(tmp_path)
    item = _items(sweep)[("tiny-qwen2.5-vl", "56x84")]
    store.append_rows(tmp_path / "data", [_fake_row(item, sweep)])
    row = store.load_dataset(tmp_path / "data").iloc[0]
    assert (row["image_size"], row["image_width"]) == (56, 84)  # height, width
    back = spec_from_row(row)
    assert back.image_size == "56x84"
    assert back.with_(model="m") == item.spec.with_(model="m")
    assert json.loads(row["spec_json"])["image_size"] == "56x84"


def _old_part(tmp_path, rows) -> None:
    """A part file as the harness wrote it before HxW: no `image_width`, int64 `image_size`."""
    df = store.rows_frame(rows).drop(columns=["image_width"])
    assert df["image_size"].dtype == "int64" and set(COLUMNS) - set(df) == {"image_width"}
    tmp_path.mkdir(parents=True, exist_ok=True)
    df.to_parquet(tmp_path / "part-20260101T000000000000-old-00000000.parquet", index=False)


def test_an_old_int_dataset_loads_and_dedups_as_before(tmp_path):
    sweep = _sweep(tmp_path)
    items = _items(sweep)
    square = _fake_row(items[("tiny-mistral3", 56)], sweep)
    old = {**square, "collected_at": "2026-01-01T00:00:00.000000Z"}
    del old["image_width"]
    data = tmp_path / "data"
    _old_part(data, [old])
    # re-measured now (same spec, same env key) plus one new HxW row
    store.append_rows(data, [square, _fake_row(items[("tiny-mistral3", "56x84")], sweep)])
    df = store.load_dataset(data)
    assert len(df) == 2  # the old and new square rows are one measurement, the newest kept
    assert df["image_size"].dtype == "int64" and df["image_width"].dtype == "int64"
    by = df.set_index("spec_hash")
    assert by.loc[square["spec_hash"], "collected_at"] == square["collected_at"]
    assert list(df.sort_values("image_width")[["image_size", "image_width"]].itertuples(
        index=False, name=None)) == [(56, 56), (56, 84)]
    assert len(store.measured_keys(data)) == 2
    store.compact(data)  # the merged file keeps the same rows (columns in schema order)
    assert store.load_dataset(data).equals(df.reindex(columns=list(COLUMNS)))


def test_old_rows_alone_read_as_squares_and_as_their_spec(tmp_path):
    sweep = _sweep(tmp_path)
    row = _fake_row(_items(sweep)[("tiny-qwen2.5-vl", 56)], sweep)
    del row["image_width"]
    _old_part(tmp_path / "data", [row])
    back = store.load_dataset(tmp_path / "data").iloc[0]
    assert (back["image_size"], back["image_width"]) == (56, 56)
    assert spec_from_row(back).image_size == 56


def test_rows_without_images_or_width_fill_from_image_size(tmp_path):
    sweep = _sweep(tmp_path)
    row = _fake_row(_items(sweep)[("tiny-qwen2.5-vl", 56)], sweep)
    del row["image_width"]
    # the published importer's rows set image_size 0 and no image_width
    df = store.rows_frame([{**row, "image_size": 0}, {**row, **image_columns("448x672")}])
    assert list(df["image_width"]) == [0, 672] and list(df["image_size"]) == [0, 448]
    assert image_columns(None) == {"image_size": 0, "image_width": 0}


def test_features_take_an_hxw_size():
    from hybridmem.learned.features import spec_features
    from hybridmem.models.loader import load_config_dict
    from hybridmem.job.spec import TrainingSpec

    _, cfg = load_config_dict("tiny-mistral3")
    hxw = spec_features(TrainingSpec(model="tiny-mistral3", image_size="56x84"), cfg)
    square = spec_features(TrainingSpec(model="tiny-mistral3", image_size=56), cfg)
    # hand: round(sqrt(56 * 84)) = round(68.59) = 69; (56 / 14) x (84 / 14) = 24 patches
    assert (hxw["image_size"], hxw["image_tokens"]) == (69, 24)
    assert (square["image_size"], square["image_tokens"]) == (56, 16)  # 4 x 4 patches


def test_the_learned_reader_and_table_take_hxw_rows(tmp_path):
    from hybridmem.learned import dataset
    from hybridmem.learned.features import build_table

    sweep = _sweep(tmp_path)
    items = _items(sweep)
    rows = [_fake_row(items[k], sweep) for k in [("tiny-qwen2.5-vl", "56x84"),
                                                 ("tiny-mistral3", "56x84")]]
    store.append_rows(tmp_path / "data", rows)
    df = dataset.load(tmp_path / "data")
    table = build_table(df)
    assert not table.dropped, table.dropped
    assert list(table.X["image_size"]) == [69, 69]  # round(sqrt(56 * 84)), as above


def _collect_on_cpu(tmp_path, monkeypatch, models: str, sizes: str):
    """`collect --backend cuda` through the CPU stand-in probe (the CUDA runner's build and
    batch at the HxW size); checks every row is `ok`, records its size and reads back as the
    planned spec, and returns the rows."""
    from hybridmem.harness import collect

    monkeypatch.setenv("HYBRIDMEM_PROBE", "hybridmem.harness.probe:CpuProbe")
    text = SWEEP.replace('"tiny-qwen2.5-vl", "tiny-mistral3", "tiny-llava"', models)
    (tmp_path / "s.toml").write_text(text.replace('"56x84", "56x56", 56', sizes))
    collect(tmp_path / "s.toml", out=tmp_path / "data", backend="cuda", mlflow=False)
    df = store.load_dataset(tmp_path / "data")
    assert set(df["outcome"]) == {"ok"}, df["error"].tolist()
    planned = {it.spec_hash: it for it in load_sweep(tmp_path / "s.toml").items}
    assert sorted(df["spec_hash"]) == sorted(planned)
    for row in df.to_dict("records"):
        spec = planned[row["spec_hash"]].spec
        assert f'{row["image_size"]}x{row["image_width"]}' == spec.image_size
        assert spec_from_row(row).with_(model="m") == spec.with_(model="m")
        assert row["image_tokens"] == 6  # 2 x 3 merged tokens either way round (hand, above)
    return df


def test_an_hxw_sweep_runs_on_the_cpu_stand_in(tmp_path, monkeypatch):
    """Qwen2.5-VL: its patch grid (and pixel rows) follow the HxW size (~13 s, one process)."""
    assert len(_collect_on_cpu(tmp_path, monkeypatch, '"tiny-qwen2.5-vl"', '"56x84"')) == 1


@pytest.mark.slow  # ~50 s: one fresh CPU process per config
def test_both_orientations_of_both_families_run_on_the_cpu_stand_in(tmp_path, monkeypatch):
    df = _collect_on_cpu(tmp_path, monkeypatch, '"tiny-qwen2.5-vl", "tiny-mistral3"',
                         '"56x84", "84x56"')
    assert len(df) == 4


@pytest.mark.slow  # builds two real-sized graphs (~5 s)
def test_the_documented_gpu_sweep_plans(tmp_path):
    """datasets/sweeps/README.md's example: the sizes GPU owners sweep."""
    sweep = _sweep(tmp_path, """
[[block]]
model = ["qwen2.5-vl-7b-instruct", "mistral-small-3.1-24b-instruct-2503"]
image_size = ["448x672", "1024x768"]
seq_len = [4096]
""")
    tokens = {k: it.image_tokens for k, it in _items(sweep).items()}
    # hand: Qwen2.5-VL smart_resize keeps 448x672 (multiples of 28) -> 16 x 24 merged tokens;
    # Pixtral (longest edge 1540 not reached) ceils 1024 / 28 = 36.6 -> 37, 768 / 28 -> 28
    assert tokens[("qwen2.5-vl-7b-instruct", "448x672")] == 16 * 24
    assert tokens[("mistral-small-3.1-24b-instruct-2503", "1024x768")] == 37 * 28
    assert not sweep.dropped and len(tokens) == 4
