"""The job schema's bounds: every integer field has one, declared on the field, and the CLI and
the API refuse a value above it in one line before any work; the micro-batch search is
bounded in probes; a lengths file of any content is one line, never quoted back."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest

from hybridmem.cli import main
from hybridmem.errors import SpecError
from hybridmem.job import schema
from hybridmem.job.field import UNIT_MAXIMA, job_field
from hybridmem.job.spec import TrainingSpec


def _integer(key: str) -> bool:
    import typing

    tp = schema.TYPES[key]
    return schema.value_type(tp) is int or int in typing.get_args(tp)


def test_every_integer_field_has_a_bound():
    unbounded = [m.key for m in schema.FIELDS if _integer(m.key) and m.maximum is None]
    assert not unbounded, f"declare maximum= (or a unit of UNIT_MAXIMA) for {unbounded}"
    # the bound is every default's and then some: no shipped default is refused
    for m in schema.FIELDS:
        if m.maximum is not None and isinstance(m.default, (int, float)):
            assert m.default <= m.maximum, m.key


def test_a_new_field_with_a_unit_is_bounded_for_free():
    import dataclasses

    field = job_field(2, help="x", group="parallel", unit="GPUs")
    assert field.metadata["job"].maximum == UNIT_MAXIMA["GPUs"]
    explicit = job_field(2, help="x", group="parallel", unit="GPUs", maximum=8)
    assert explicit.metadata["job"].maximum == 8
    assert isinstance(field, dataclasses.Field)


@pytest.mark.parametrize("kwargs, words", [
    ({"micro_batch": 10**400}, "micro_batch='10000000...(401 digits)': above 65536 samples"),
    ({"micro_batch": 10**20}, "micro_batch=100000000000000000000: above 65536"),
    ({"seq_len": 1 << 30}, "seq_len=1073741824: above 16777216 tokens"),
    ({"image_size": "64x100000"}, "image_size=100000: above 32768 pixels"),
    ({"max_grad_norm": math.inf}, "max_grad_norm=inf: must be a finite number"),
])
def test_spec_refuses_above_the_bound(kwargs, words):
    t0 = time.perf_counter()
    with pytest.raises(SpecError) as err:
        TrainingSpec(model="tiny-llama", **kwargs)
    assert words in str(err.value) and "\n" not in str(err.value)
    assert time.perf_counter() - t0 < 1.0


def test_world_size_bound_names_the_parallel_field():
    from hybridmem.job.parallel import ParallelSpec

    with pytest.raises(SpecError, match=r"parallel.world_size=1000000000: above 1048576 GPUs"):
        ParallelSpec(world_size=10**9, strategy="zero3")


def test_cli_refuses_a_huge_micro_batch_at_once(capsys):
    # before the bound: `--micro-batch 10**20 --gpu rtx-4090` ran for minutes (issue 36)
    t0 = time.perf_counter()
    code = main(["predict", "--model", "llama-3.1-8b", "--train", "lora", "--micro-batch",
                 str(10**20), "--gpu", "rtx-4090"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: micro_batch=100000000000000000000: above 65536")
    assert "\n" not in err and time.perf_counter() - t0 < 5


def test_max_batch_search_is_bounded_in_probes():
    from hybridmem.predict import MAX_SEARCH_BATCH, search_max

    assert MAX_SEARCH_BATCH == schema.BY_KEY["micro_batch"].maximum
    probes = []
    fits = lambda b: probes.append(b) or True  # noqa: E731 - everything fits: the worst case
    assert search_max(fits) == MAX_SEARCH_BATCH
    assert len(probes) <= 2 * math.log2(MAX_SEARCH_BATCH) + 2 and max(probes) <= MAX_SEARCH_BATCH
    probes.clear()
    assert search_max(fits, guess=3) == MAX_SEARCH_BATCH
    assert len(probes) <= 2 * math.log2(MAX_SEARCH_BATCH) + 2


# ---------------------------------------------------------------- lengths files of any content

SECRET = "hunter2-do-not-echo"


@pytest.mark.parametrize("name, content", [
    ("ls", None),  # /bin/ls: a binary (issue 37: a UnicodeDecodeError traceback)
    ("a.txt", b"\xff\xfe\x00garbage" + SECRET.encode()),
    ("a.txt", f"12\n{SECRET}\n".encode()),
    ("a.txt", ("9" * 5000 + "\n").encode()),  # more digits than int() parses
    ("a.txt", b"99999999999999999999999\n"),  # past int64
    ("a.csv", f"length\n{SECRET}\n".encode()),
    ("a.jsonl", f'{{"length": "{SECRET}"}}\n'.encode()),
    ("a.jsonl", b"\x00\x01\x02" + SECRET.encode()),
    ("a.parquet", b"PAR1" + SECRET.encode()),
    ("a.csv", b""),
], ids=["bin-ls", "not-utf8", "a-word", "5000-digits", "past-int64", "csv-word", "jsonl-word",
        "jsonl-binary", "parquet-garbage", "csv-empty"])
def test_any_lengths_file_is_one_line_without_its_content(tmp_path, capsys, name, content):
    import shutil

    if content is None:
        path = shutil.which("ls")
    else:
        path = tmp_path / name
        path.write_bytes(content)
    code = main(["predict", "--model", "llama-3.1-8b", "--train", "lora", "--seq-len", "512",
                 "--lengths", str(path)])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error: lengths=") and "\n" not in err, err
    assert SECRET not in err and "Traceback" not in err


def test_lengths_cli_in_a_subprocess_has_no_traceback(tmp_path):
    """The issue's command as a user runs it: exit 2, one line."""
    bad = tmp_path / "bin"
    bad.write_bytes(bytes(range(256)) * 4)
    run = subprocess.run([sys.executable, "-m", "hybridmem", "predict", "--model",
                          "llama-3.1-8b", "--train", "lora", "--lengths", str(bad)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "not text" in run.stderr


def test_docs_table_states_each_bound():
    """docs/serve.md's bounds table gives every bounded field its bound (a row naming the
    field, a `prefix_*` of it, or "any field in UNIT")."""
    import fnmatch
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "serve.md").read_text()
    block = text.split("<!-- bounds:start -->")[1].split("<!-- bounds:end -->")[0]
    rows = [r for r in block.splitlines() if r.startswith("| `")]
    for m in schema.FIELDS:
        if m.maximum is None:
            continue
        name = f"lora.{m.name}" if m.owner == "lora" else m.key
        row = next((r for r in rows
                    if any(fnmatch.fnmatch(name, g) for g in r.split("|")[1].replace("`", "")
                           .replace("(", ",").replace(")", ",").replace(" ", "").split(","))
                    or (m.unit and f"any field in {m.unit}" in r.split("|")[1])), None)
        assert row is not None, f"docs/serve.md: no bounds row for {name}"
        assert f" {m.maximum} " in row, (name, m.maximum, row)


def test_fit_advice_is_bounded_in_probes():
    """The worst case: nothing ever fits, at the largest micro-batch the schema allows."""
    from types import SimpleNamespace

    from hybridmem.gpus import gpu_by_name
    from hybridmem.parallel.fit import (MAX_COMBINED_PROBES, MAX_WORLD_SIZE,
                                        smallest_fitting_setup)

    calls = []

    def never_fits(spec):
        calls.append(spec)
        return SimpleNamespace(peak=SimpleNamespace(device_bytes=1), verdict_bytes=1,
                               fits_within=lambda _: False)

    biggest = schema.BY_KEY["micro_batch"].maximum
    out = smallest_fitting_setup(TrainingSpec(model="tiny-llama", micro_batch=biggest),
                                 gpu_by_name("rtx-4090"), never_fits)
    assert out["fits_as_is"] is False and out["micro_batch"] is None
    # as is, doubling the world size to its cap, bisecting the micro-batch, checkpointing,
    # then the combined search (savers x micro-batch x GPU count) under its own cap
    bound = 1 + math.log2(MAX_WORLD_SIZE) + math.ceil(math.log2(biggest)) + 1 \
        + MAX_COMBINED_PROBES
    assert len(calls) <= bound, len(calls)
