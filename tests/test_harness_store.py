"""The dataset store: atomic part files, newest row per key, resume keys, compaction, schema."""

from __future__ import annotations

import pandas as pd
import pytest

from hybridmem.errors import SpecError
from hybridmem.harness import store
from hybridmem.harness.schema import COLUMNS, SCHEMA_VERSION, spec_hash


def _row(h: str, at: str, **kw) -> dict:
    row = {"schema_version": SCHEMA_VERSION, "spec_hash": h, "collected_at": at,
           "source": "cuda", "outcome": "ok", "gpu_name": "NVIDIA H200", "torch_version": "2.11.0",
           "micro_batch": 1, "seq_len": 8, "images_per_sample": 0, "image_size": 0,
           "image_tokens": 0, "grad_ckpt": False, "lora_r": 0, "world_size": 1,
           "iterations": 3, "gpu_memory_bytes": 0, "peak_allocated_bytes": 100}
    row.update(kw)
    return row


def test_rows_round_trip_with_the_schema_types(tmp_path):
    store.append_rows(tmp_path, [_row("a", "2026-01-01T00:00:00Z")])
    store.append_rows(tmp_path, [_row("b", "2026-01-01T00:00:01Z", outcome="oom",
                                      peak_allocated_bytes=None)])
    df = store.load_dataset(tmp_path)
    assert list(df.columns) == list(COLUMNS)
    assert list(df["spec_hash"]) == ["a", "b"]
    assert df["peak_allocated_bytes"].dtype == "Int64"
    assert df.loc[1, "peak_allocated_bytes"] is pd.NA  # an oom row has no peak


def test_temporary_files_of_a_killed_writer_are_ignored(tmp_path):
    store.append_rows(tmp_path, [_row("a", "2026-01-01T00:00:00Z")])
    (tmp_path / ".part-x.parquet.123.tmp").write_bytes(b"half a parquet file")
    assert list(store.load_dataset(tmp_path)["spec_hash"]) == ["a"]


def test_newest_row_per_key_wins_and_compaction_keeps_it(tmp_path):
    store.append_rows(tmp_path, [_row("a", "2026-01-01T00:00:00Z", peak_allocated_bytes=1)])
    store.append_rows(tmp_path, [_row("a", "2026-01-02T00:00:00Z", peak_allocated_bytes=2)])
    store.append_rows(tmp_path, [_row("a", "2026-01-03T00:00:00Z", gpu_name="NVIDIA A100")])
    df = store.load_dataset(tmp_path)
    assert sorted(df["gpu_name"]) == ["NVIDIA A100", "NVIDIA H200"]  # other environment: kept
    assert int(df.loc[df.gpu_name == "NVIDIA H200", "peak_allocated_bytes"].iloc[0]) == 2
    merged = store.compact(tmp_path)
    assert store.part_files(tmp_path) == [merged]
    pd.testing.assert_frame_equal(store.load_dataset(tmp_path), df)


def test_measured_keys_are_hash_and_environment(tmp_path):
    assert store.measured_keys(tmp_path / "missing") == set()
    store.append_rows(tmp_path, [_row("a", "2026-01-01T00:00:00Z")])
    assert store.measured_keys(tmp_path) == {("a", "NVIDIA H200", "2.11.0", "cuda")}


def test_a_newer_schema_is_refused(tmp_path):
    store.append_rows(tmp_path, [_row("a", "x", schema_version=SCHEMA_VERSION + 1)])
    with pytest.raises(SpecError, match="schema_version=.*newer harness"):
        store.load_dataset(tmp_path)


def test_spec_hash_ignores_the_label_but_not_the_config():
    spec = {"model": "label-1", "micro_batch": 1}
    cfg = {"model_type": "llama", "hidden_size": 64}
    assert spec_hash(spec, cfg) == spec_hash({**spec, "model": "label-2"}, cfg)
    assert spec_hash(spec, cfg) != spec_hash(spec, {**cfg, "hidden_size": 128})
    assert spec_hash(spec, cfg) != spec_hash({**spec, "micro_batch": 2}, cfg)
