"""`hybridmem import`: published measurements -> dataset rows."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from hybridmem.cli import main
from hybridmem.harness import store
from hybridmem.harness.schema import spec_from_row

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = Path("/work/shared/data/published/peft-metamathqa.jsonl")
QWEN = Path("/work/shared/data/published/qwen-profiling.jsonl")
COMMITTED = ROOT / "datasets" / "published"
MiB = 1024**2

# Real records (ids of lines of PUBLISHED), copied into the tests' own file below.
FULL = "peft-metamathqa-full-finetuning--llama-3.2-3B-lr_0.00001-2025-06-20T180243"
LORAFA = "peft-metamathqa-lora--llama-3.2-3B-rank32-lorafa-2025-06-17T112817"
ADALORA = "peft-metamathqa-adalora--llama-3.2-3B-rank32-2025-06-17T180254"
RERUN = ("peft-metamathqa-lora--llama-3.2-3B-rank32-2025-06-17T133058",
         "peft-metamathqa-lora--llama-3.2-3B-rank32-2025-06-19T191535")  # same spec, same torch


def _records() -> dict[str, dict]:
    if not PUBLISHED.exists():
        pytest.skip(f"{PUBLISHED} not present")
    recs = [json.loads(line) for line in PUBLISHED.read_text().splitlines() if line.strip()]
    return {r["id"]: r for r in recs}


def _loraplus(rec: dict) -> dict:
    """A record derived from a real one (not published): the LoRA-FA run relabelled as peft's
    `lora+` optimizer, which has no spec optimizer - the importer's exclusion path."""
    return {**rec, "id": rec["id"] + "-derived-loraplus", "optimizer": "lora+"}


@pytest.fixture
def records() -> list[dict]:
    by_id = _records()
    return [by_id[FULL], by_id[LORAFA], by_id[ADALORA], *(by_id[i] for i in RERUN),
            _loraplus(by_id[LORAFA])]


@pytest.fixture
def jsonl(tmp_path, records) -> Path:
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _import(path, out, capsys, source="peft-metamathqa") -> tuple[int, str, str]:
    rc = main(["import", "--from", source, str(path), "--out", str(out)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_import_counts_reasons_and_is_idempotent(jsonl, records, tmp_path, capsys):
    out = tmp_path / "data"
    rc, text, _ = _import(jsonl, out, capsys)
    assert rc == 0
    assert "added 6 rows" in text and "(5 ok, 1 excluded)" in text
    assert "excluded 1: optimizer 'lora+'" in text
    rc, text, _ = _import(jsonl, out, capsys)  # the same file again: nothing new
    assert rc == 0 and "added 0 rows" in text and "already present: 6" in text
    assert len(store.part_files(out)) == 1
    df = store.load_dataset(out)
    assert sorted(df["measurement_id"]) == sorted(r["id"] for r in records)
    # two published re-runs share a spec, a GPU and a torch but stay two measurements
    rerun = df[df["measurement_id"].isin(RERUN)]
    assert rerun["spec_hash"].nunique() == 1 and len(rerun) == 2


def test_rows_keep_figures_provenance_and_spec(jsonl, records, tmp_path, capsys):
    out = tmp_path / "data"
    assert _import(jsonl, out, capsys)[0] == 0
    df = store.load_dataset(out).set_index("measurement_id")
    for rec in records:
        row = df.loc[rec["id"]]
        assert row["source"] == "published"
        assert int(row["published_value_bytes"]) == rec["value"]  # exactly as published
        assert int(row["peak_reserved_bytes"]) == rec["value"] + 2 * MiB  # + the init segment
        assert pd.isna(row["peak_device_bytes"]) and pd.isna(row["peak_allocated_bytes"])
        for col in ("source_repo", "source_commit", "source_url"):
            assert row[col] == rec[col]
        paths = rec["source_path"] if isinstance(rec["source_path"], list) else [rec["source_path"]]
        assert json.loads(row["source_path"]) == paths
        assert row["gpu_name"] == rec["gpu"] and row["torch_version"] == rec["torch_version"]
        assert row["cuda_version"] == {"124": "12.4", "126": "12.6", "128": "12.8"}[
            rec["torch_version"].split("+cu")[1]]
        assert row["experiment"] == rec["experiment_name"] and row["seq_len_kind"] == "upper-bound"
        assert row["steady_allocated_bytes"] == rec["extra_metrics"][
            "mem_allocated_avg_over_run (mean of per-250-step window averages)"]
        assert row["empty_cache_every_n_steps"] == rec["measurement_semantics"]["empty_cache_every_n_steps"]
        assert row["gpu_memory_bytes"] > 0
    full, lorafa = df.loc[FULL], df.loc[LORAFA]
    assert full["group"] == "full" and full["outcome"] == "ok"
    spec = spec_from_row(full)
    assert (spec.train, spec.precision, spec.optimizer, spec.loop, spec.max_grad_norm,
            spec.micro_batch, spec.seq_len, spec.attn) == ("full", "bf16", "adamw", "custom",
                                                            1.0, 4, 768, "sdpa")
    # LoRA-FA (peft create_lorafa_optimizer) is the spec's optimizer `lora-fa` now
    assert lorafa["outcome"] == "ok" and lorafa["excluded_reason"] == ""
    spec = spec_from_row(lorafa)
    assert lorafa["group"] == "lora" and lorafa["optimizer"] == spec.optimizer == "lora-fa"
    assert (spec.lora.r, spec.lora.alpha, spec.lora.targets) == (32, 64.0, ("q_proj", "v_proj"))
    plus = df.loc[LORAFA + "-derived-loraplus"]
    assert plus["outcome"] == "excluded" and "lora+" in plus["excluded_reason"]
    assert plus["group"] == "lora" and plus["spec_json"] == ""
    lora = df.loc[RERUN[0]]
    assert lora["group"] == "lora" and spec_from_row(lora).lora.r == lora["lora_r"] == 32
    ada = df.loc[ADALORA]
    assert ada["group"] == "other-peft" and spec_from_row(ada).train == "peft"
    assert json.loads(spec_from_row(ada).peft_config)["peft_type"] == "ADALORA"


def test_learned_tier_reads_published_rows_as_real(jsonl, tmp_path, capsys):
    from hybridmem.learned import dataset
    from hybridmem.learned.train import is_calibrated, pick_sources

    out = tmp_path / "data"
    assert _import(jsonl, out, capsys)[0] == 0
    df = dataset.load(out)
    assert pick_sources(df) == ("published",) and is_calibrated(("published",))
    usable = dataset.usable_rows(df, ("published",), ("reserved",))
    assert set(usable["outcome"]) == {"ok"} and len(usable) == 5  # the excluded row is skipped
    trace = df.assign(source="trace")
    assert pick_sources(pd.concat([df, trace])) == ("published",)  # trace never counts
    assert not is_calibrated(("trace",))


def test_killed_import_leaves_no_partial_rows(jsonl, tmp_path, capsys):
    out = tmp_path / "data"
    out.mkdir()
    (out / ".part-x.parquet.123.tmp").write_bytes(b"half a file")  # a writer killed mid-write
    rc, text, _ = _import(jsonl, out, capsys)
    assert rc == 0 and "added 6 rows" in text
    assert len(store.load_dataset(out)) == 6


@pytest.mark.parametrize("case, message", [
    ("missing", "no such file"),
    ("malformed", "malformed JSON line"),
    ("unknown", "unknown source of published figures"),
])
def test_bad_input_exits_2_with_one_line(case, message, tmp_path, capsys):
    path = tmp_path / "in.jsonl"
    if case == "malformed":
        path.write_text('{"id": "a"}\n{not json\n')
    elif case == "unknown":
        path.write_text('{"id": "a"}\n')
    rc, text, err = _import(path, tmp_path / "data", capsys,
                            source="nope" if case == "unknown" else "peft-metamathqa")
    assert rc == 2 and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "data").exists()  # nothing written


def test_not_a_record_of_the_source_is_bad_input(tmp_path, capsys):
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "a"}\n')
    rc, _, err = _import(path, tmp_path / "data", capsys)
    assert rc == 2 and "not a peft-metamathqa record" in err and "Traceback" not in err


def test_committed_dataset_holds_every_published_record_once():
    # 165 + 24 rows: datasets/published/README.md and /work/shared/data/published/README.md
    df = store.load_dataset(COMMITTED)
    raw = store._read(store.part_files(COMMITTED))
    assert len(df) == len(raw) == 165 + 24
    assert df["measurement_id"].is_unique and (df["source"] == "published").all()
    assert df["sweep_name"].value_counts().to_dict() == {"peft-metamathqa": 165,
                                                         "qwen-profiling": 24}
    if PUBLISHED.exists():
        mine = df.loc[df["sweep_name"] == "peft-metamathqa", "measurement_id"]
        assert set(mine) == set(_records())
    if QWEN.exists():
        mine = df.loc[df["sweep_name"] == "qwen-profiling", "measurement_id"]
        assert set(mine) == {r["id"] for r in _qwen_records()}
    assert set(df["outcome"]) <= {"ok", "excluded"}
    assert (df["excluded_reason"] != "").sum() == (df["outcome"] == "excluded").sum()


def test_parts_written_before_the_new_columns_still_read(jsonl, tmp_path, capsys):
    from hybridmem.harness.schema import ADDED_COLUMNS

    out = tmp_path / "data"
    assert _import(jsonl, out, capsys)[0] == 0
    new = [c for c in ADDED_COLUMNS if c not in ("strategy", "rank_peaks_json")]
    old = store.load_dataset(out).drop(columns=new).assign(source="cuda", outcome="ok")
    old_dir = tmp_path / "old"
    old_dir.mkdir()
    old.to_parquet(old_dir / "part-old.parquet", index=False)
    df = store.load_dataset(old_dir)
    assert set(df["measurement_id"]) == {""}  # old rows have no id: one row per old key
    assert len(df) == len(old.drop_duplicates(list(store.KEY))) == len(old) - 1  # the re-run pair
    assert df["published_value_bytes"].isna().all() and (df["seq_len_kind"] == "exact").all()
    assert str(df["empty_cache_every_n_steps"].dtype) == "Int64"


# ---- qwen-profiling: the second source (QwenLM/Qwen README profiling, 24 rows) ----


def _qwen_records() -> list[dict]:
    if not QWEN.exists():
        pytest.skip(f"{QWEN} not present")
    return [json.loads(line) for line in QWEN.read_text().splitlines() if line.strip()]


def test_qwen_profiling_imports_24_rows_priced_as_the_qwen2_proxy(tmp_path, capsys):
    from hybridmem.published.qwen_profiling import BYTES_PER_GB, PRESETS

    records = {r["id"]: r for r in _qwen_records()}
    rc, out, err = _import(QWEN, tmp_path / "data", capsys, source="qwen-profiling")
    assert rc == 0, err
    assert "24 records" in out and "added 24 rows" in out and "24 ok, 0 excluded" in out
    df = store.load_dataset(tmp_path / "data")
    assert len(df) == 24 and (df["source"] == "published").all() and (df["outcome"] == "ok").all()
    for row in df.to_dict("records"):
        rec = records[row["measurement_id"]]
        # the figure as published, read as the device peak in units of 10^9 bytes (assumed)
        assert row["peak_device_bytes"] == round(rec["value"] * BYTES_PER_GB)
        assert pd.isna(row["peak_reserved_bytes"]) and pd.isna(row["peak_allocated_bytes"])
        assert (row["torch_version"], row["cuda_version"]) == ("2.0", "11.8")
        assert row["gpu_name"] == "NVIDIA A100-SXM4-80GB"
        assert row["source_repo"] == "QwenLM/Qwen" and row["source_commit"] == rec["source_commit"]
        published = json.loads(row["published_json"])
        assert published["quote"] == rec["quote"] and published["value"] == rec["value"]
        # the proxy is recorded in the row
        assert published["priced_as"]["preset"] == PRESETS[rec["model_id"]] == row["model_name"]
        assert "Qwen2ForCausalLM" in published["priced_as"]["class"]
        spec = spec_from_row(row)
        cfg = json.loads(row["model_config"])
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                    "intermediate_size", "num_key_value_heads"):
            assert cfg[key] == rec["model_config"][key], key
        assert cfg["model_type"] == "qwen2" and spec.seq_len == rec["seq_len"]
        assert (spec.micro_batch, spec.grad_accum, spec.grad_ckpt) == (1, 8, True)
        assert spec.train == "lora" and spec.lora.r == 64 and spec.lora.alpha == 16
        # c_attn -> q/k/v_proj, c_proj -> o_proj + down_proj, w1 / w2 -> up / gate_proj
        assert set(spec.lora.targets) == {"q_proj", "k_proj", "v_proj", "o_proj", "down_proj",
                                          "up_proj", "gate_proj"}
        saved = rec["adapter_config"].get("modules_to_save")
        assert spec.lora.modules_to_save == (("embed_tokens", "lm_head") if saved else ())


def test_a_qwen_record_whose_shape_differs_from_the_proxy_is_excluded(tmp_path, capsys):
    rec = _qwen_records()[0]
    # derived (not published): the 1.8B record with another hidden size
    bad = {**rec, "id": rec["id"] + "-derived", "model_config": {**rec["model_config"],
                                                                 "hidden_size": 4096}}
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(bad) + "\n")
    rc, out, _ = _import(path, tmp_path / "data", capsys, source="qwen-profiling")
    assert rc == 0 and "1 excluded" in out
    row = store.load_dataset(tmp_path / "data").iloc[0]
    assert row["outcome"] == "excluded"
    assert "hidden_size=4096 differs from proxy preset qwen-1_8b (2048)" in row["excluded_reason"]
