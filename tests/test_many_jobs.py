"""Many jobs at once: `predict --jobs FILE.jsonl`, `hybridmem plan`, and the engine under both
(`hybridmem.fanout.price_many`)."""

from __future__ import annotations

import json
import os

import pytest

from hybridmem.cli import main
from hybridmem.fanout import price_many

JOBS = [
    {"model": "llama-3.2-1b", "micro_batch": 4, "seq_len": 1024},
    {"model": "llama-3.2-1b", "micro_batch": -1},
    {"model": "llama-3.2-3b", "micro_batch": 2, "world_size": 4, "strategy": "zero3",
     "gpu": "a100-40gb"},
    {"model": "tiny-llama", "train": "lora", "lora": {"r": 4}, "microbatch": 2},
]


def _jsonl(path, jobs, extra=()):
    path.write_text("".join(json.dumps(j) + "\n" for j in jobs) + "".join(extra))
    return path


def _rows(capsys, argv):
    capsys.readouterr()
    assert main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def _single(capsys, *flags):
    capsys.readouterr()
    assert main(["predict", *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _no_sources(answer):
    return {**answer, "job": {k: v for k, v in answer["job"].items() if k != "sources"}}


def test_jobs_answer_in_order_with_each_error_in_its_row(tmp_path, capsys):
    path = _jsonl(tmp_path / "q.jsonl", JOBS, ["# a comment\n", "\n", "not json\n"])
    rows = _rows(capsys, ["predict", "--jobs", str(path), "--gpu", "h100-80gb", "--json",
                          "--workers", "2"])
    assert [r["line"] for r in rows] == [1, 2, 3, 4, 7]
    assert "micro_batch=-1" in rows[1]["error"]
    assert "did you mean 'micro_batch'" in rows[3]["error"]
    assert "not JSON" in rows[4]["error"]
    # each answer is the single call's (the line's GPU replaces the command line's)
    first = _single(capsys, "--model", "llama-3.2-1b", "--micro-batch", "4", "--seq-len", "1024",
                    "--gpu", "h100-80gb")
    assert _no_sources({k: v for k, v in rows[0].items() if k != "line"}) == _no_sources(first)
    third = _single(capsys, "--model", "llama-3.2-3b", "--micro-batch", "2", "--world-size", "4",
                    "--strategy", "zero3", "--gpu", "a100-40gb")
    assert rows[2]["fit"] == third["fit"] and rows[2]["peak"] == third["peak"]
    assert rows[2]["job"]["sources"]["micro_batch"] == "q.jsonl line 3: micro_batch"


def test_an_answers_job_is_a_valid_line(tmp_path, capsys):
    answer = _single(capsys, "--model", "tiny-llama", "--train", "lora", "--lora-r", "4",
                     "--micro-batch", "2", "--seq-len", "64")
    rows = _rows(capsys, ["predict", "--jobs", str(_jsonl(tmp_path / "a.jsonl",
                                                        [answer["job"]])), "--json"])
    # the same answer; only `job.defaults` (why the model chose a value) is gone, as the line
    # now states every value
    again = _no_sources({k: v for k, v in rows[0].items() if k != "line"})
    assert "defaults" not in again["job"] and answer["job"].pop("defaults")
    assert again == _no_sources(answer)


def test_jobs_file_errors_are_one_line_exit_2(tmp_path, capsys):
    assert main(["predict", "--jobs", str(tmp_path / "missing.jsonl")]) == 2
    assert "jobs=" in capsys.readouterr().err
    assert main(["predict", "--model", "tiny-llama", "--workers", "2"]) == 2
    assert "needs --jobs" in capsys.readouterr().err


def _explode(item):
    if item == "die":
        os._exit(3)  # a worker killed mid-chunk (out of memory, a signal)
    if item == "bad":
        raise ValueError("bad item")
    return {"item": item}


def test_price_many_keeps_order_and_survives_a_dead_worker():
    items = [str(i) for i in range(9)]
    assert price_many(_explode, items, workers=2) == [{"item": i} for i in items]
    out = price_many(_explode, ["a", "bad", "c"], workers=1)
    assert out[1] == {"error": "ValueError: bad item"} and out[2] == {"item": "c"}
    out = price_many(_explode, ["a", "die", "c", "d"], workers=2)
    assert any("worker process died" in r.get("error", "") for r in out)
    assert len(out) == 4


def test_plan_lists_the_cheapest_fitting_first(capsys):
    capsys.readouterr()
    assert main(["plan", "--model", "llama-3.2-1b", "--gpus", "rtx-4090,a100-80gb",
                 "--gpu-counts", "1,2", "--micro-batches", "1,8", "--strategies", "ddp,zero3",
                 "--workers", "1", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # 2 GPUs x (1 GPU: no strategy + 2 GPUs: 2 strategies) x 2 micro-batches
    assert plan["points"] == 2 * (1 + 2) * 2 == plan["priced"] + len(plan["refused"])
    cheapest = plan["cheapest"]
    assert cheapest and all(r["fit"] in ("yes", "after-retry") for r in cheapest)
    bought = [r["gpu_memory_bought_bytes"] for r in cheapest]
    assert bought == sorted(bought)
    # a point the table calls the cheapest is what `predict` says of the same job
    top = cheapest[0]
    flags = ["--model", "llama-3.2-1b", "--gpu", top["gpu"], "--micro-batch",
             str(top["micro_batch"]), "--world-size", str(top["gpu_count"]), "--strategy",
             top["strategy"]]
    single = _single(capsys, *flags)
    assert (single["fit"], single["peak"]["device_bytes"]) == (top["fit"], top["device_bytes"])


def test_plan_refuses_an_unknown_gpu_in_one_line(capsys):
    assert main(["plan", "--model", "llama-3.2-1b", "--gpus", "h100-80gb,nope"]) == 2
    assert "gpu='nope'" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--micro-batches", "1,x"), ("--gpu-counts", "0")])
def test_plan_axis_values_are_checked(capsys, flag, value):
    assert main(["plan", "--model", "llama-3.2-1b", flag, value]) == 2
    assert flag in capsys.readouterr().err
