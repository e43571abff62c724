"""`hybridmem serve` against hostile requests: no file opened on a request's say, lengths only
inline, the time limit stops the work (the worker is killed, the core is free), shutdown leaves
no process, `POST /v1/predict/batch`, and a hypothesis fuzz over the request schema."""

from __future__ import annotations

import builtins
import io
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")

from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from hybridmem.cli import main  # noqa: E402
from hybridmem.serve.app import Settings, create_app  # noqa: E402
from hybridmem import workers as pools  # noqa: E402

LENGTHS = [512, 1024, 300, 2048, 77] * 8
JOB = {"model": "llama-3.2-1b", "train": "lora", "seq_len": 2048, "gpu": "rtx-4090",
       "method": "analytic"}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """Analytic jobs in the server's threads: what the tests patch is what the server runs."""
    app = create_app(Settings(workers=0, trace_workers=0,
                              workdir=tmp_path_factory.mktemp("serve-limits")))
    with TestClient(app) as c:
        yield c


LIMIT_S = 5.0
"""The process client's time limit: room for an ordinary answer on a loaded 2-core runner."""


@pytest.fixture(scope="module")
def process_client(tmp_path_factory):
    """Two analytic worker processes and a short time limit: the server as `serve` runs it."""
    app = create_app(Settings(workers=2, trace_workers=0, timeout_s=LIMIT_S,
                              workdir=tmp_path_factory.mktemp("serve-procs")))
    with TestClient(app) as c:
        yield c, app.state.service


# ---------------------------------------------------------------- lengths inline, no path

def test_inline_lengths_answer_as_the_cli_s_file(client, capsys, tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("".join(f"{n}\n" for n in LENGTHS))
    assert main(["predict", "--model", "llama-3.2-1b", "--train", "lora", "--seq-len", "2048",
                 "--gpu", "rtx-4090", "--method", "analytic", "--lengths", str(path),
                 "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    counts = {}
    for n in LENGTHS:
        counts[str(n)] = counts.get(str(n), 0) + 1
    for given in (LENGTHS, path.read_text(), ", ".join(map(str, LENGTHS))):
        ans = client.post("/v1/predict", json={**JOB, "lengths": given})
        assert ans.status_code == 200, ans.text
        ans = ans.json()
        assert ans["peak"] == cli["peak"] and ans["lengths"]["steps"] == cli["lengths"]["steps"]
        assert ans["job"]["lengths"] == "lengths (inline)"
    # a histogram: the same samples, shortest first (so the same batches under `sequential`)
    seq = {**JOB, "sampler": "sequential"}
    hist = client.post("/v1/predict", json={**seq, "lengths": counts}).json()
    ordered = client.post("/v1/predict", json={**seq, "lengths": sorted(LENGTHS)}).json()
    assert hist["peak"] == ordered["peak"]


@pytest.mark.parametrize("value, words", [
    ("/etc/passwd", "reads no path"),
    ("/proc/self/environ", "reads no path"),
    ("lengths.txt", "reads no path"),
    ("512\nabc\n", "reads no path"),
    ([512, -1], "token counts from 1"),
    ([512, True], "token counts from 1"),
    ({"512": 1 << 30}, "more than"),
    ({"x": 3}, "histogram"),
    (12, "must be a list"),
])
def test_lengths_that_are_not_counts_are_422(client, value, words):
    r = client.post("/v1/predict", json={**JOB, "lengths": value})
    assert r.status_code == 422 and words in r.json()["detail"], r.text


class Opened:
    """Every path opened through builtins.open, io.open, os.open and pathlib while active."""

    def __init__(self, monkeypatch):
        self.paths: list[str] = []
        for owner, name in ((builtins, "open"), (io, "open"), (os, "open")):
            real = getattr(owner, name)
            monkeypatch.setattr(owner, name, self._spy(real))
        for name in ("open", "read_text", "read_bytes"):
            real = getattr(pathlib.Path, name)
            monkeypatch.setattr(pathlib.Path, name, self._spy(real))

    def _spy(self, real):
        def spy(target, *args, **kwargs):
            if isinstance(target, (str, bytes, os.PathLike)):
                self.paths.append(os.fsdecode(target))
            return real(target, *args, **kwargs)
        return spy


def test_no_request_makes_the_server_open_a_file(client, monkeypatch, tmp_path):
    """Real files (valid JSON, a valid lengths file) at every place a request could name a path
    (every body key, every config key a reader follows: docs/serve.md's audit)."""
    secret = tmp_path / "secret"
    secret.mkdir()
    ds = secret / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 3}}')
    (secret / "lengths.txt").write_text("512\n")
    (secret / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    (secret / "config.json").write_text('{"model_type": "llama"}')
    s = str(secret)
    yaml_model = f"model_name_or_path: llama-3.2-1b\nfinetuning_type: lora\ncutoff_len: 512\n"
    bodies = [
        {**JOB, "lengths": f"{s}/lengths.txt"},
        {"model": s},
        {"model": f"{s}/config.json"},
        {"model": "llama-3.2-1b", "deepspeed": str(ds)},
        {"model": "llama-3.2-1b", "training_args": {"deepspeed": str(ds)}},
        {"model": "llama-3.2-1b", "training_args": {"fsdp_config": str(ds)}},
        {"model": "llama-3.2-1b", "train": "peft", "peft_config": s},
        {"model": "llama-3.2-1b", "train": "lora", "quantize": "nf4",
         "quantization_config": f"{s}/config.json"},
        {"config": yaml_model + f"deepspeed: {ds}\n"},
        {"config": f"model_name_or_path: {s}\nfinetuning_type: lora\n"},
        {"config": f"base_model: {s}\nadapter: lora\ndeepspeed: {ds}\n"},
        {"model": "llama-3.2-1b", "config": "compute_environment: LOCAL_MACHINE\n"
         "distributed_type: DEEPSPEED\nnum_processes: 2\n"
         f"deepspeed_config:\n  deepspeed_config_file: {ds}\n", "config_format": "accelerate"},
        {"model": "llama-3.2-1b", "config": json.dumps({"deepspeed": str(ds)}),
         "config_format": "training_args"},
        {"model": "llama-3.2-1b", "recipe": s},
    ]
    spy = Opened(monkeypatch)
    statuses = [client.post("/v1/predict", json=b).status_code for b in bodies]
    monkeypatch.undo()
    assert all(code == 422 for code in statuses), statuses
    assert not [p for p in spy.paths if s in p], spy.paths


# ---------------------------------------------------------------- the time limit, the pool

SLOW = {**JOB, "micro_batch": 1 << 16, "seq_len": 1 << 24}
"""At every bound, yet far more than `LIMIT_S` of analytic work (`micro_batch` 4096 at 2**20
tokens already takes more than 5 s)."""


def _cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def test_504_kills_the_worker_and_frees_the_core(process_client):
    c, service = process_client
    assert c.post("/v1/predict", json=JOB).status_code == 200  # both workers are up
    before = set(service.analytic.pids())
    t0 = time.perf_counter()
    r = c.post("/v1/predict", json=SLOW)
    assert r.status_code == 504, r.text
    assert time.perf_counter() - t0 < LIMIT_S + 2.5
    killed = before - set(service.analytic.pids())
    assert len(killed) == 1 and not any(psutil.pid_exists(p) and psutil.Process(p).status()
                                        != psutil.STATUS_ZOMBIE for p in killed)
    # the workers that saw the slow job go are idle: nothing of it left running (the fresh
    # replacement is left out: it is busy importing the tier as it warms up)
    alive = [p for p in service.analytic.pids() if p in before]
    used = _cpu(alive)
    time.sleep(0.5)
    assert _cpu(alive) - used < 0.2
    assert c.post("/v1/predict", json={**JOB, "micro_batch": 2}).status_code == 200  # a new one


def test_batch_in_order_with_each_job_s_error(process_client, client):
    c, _ = process_client
    jobs = [{**JOB, "micro_batch": 1}, {"model": "nope"}, {**JOB, "micro_batch": 10**20},
            {**JOB, "micro_batch": 2, "seq_len": 1024}, SLOW]
    rows = c.post("/v1/predict/batch", json={"jobs": jobs}).json()["results"]
    assert [r["status"] for r in rows] == [200, 422, 422, 200, 504]
    assert "above 65536" in rows[2]["detail"]
    for row, job in zip(rows, jobs):  # each answer is the single endpoint's (no cache there)
        if row["status"] == 200:
            single = client.post("/v1/predict", json=job).json()
            assert row["answer"]["peak"] == single["peak"]
    bare = c.post("/v1/predict/batch", json=[jobs[0]]).json()["results"]  # a bare list too
    assert bare[0]["answer"]["peak"] == rows[0]["answer"]["peak"]
    assert c.post("/v1/predict/batch", json={"jobs": [JOB], "x": 1}).status_code == 422
    assert c.post("/v1/predict/batch", json={"jobs": [JOB] * 1001}).status_code == 422


def test_batch_body_cap(tmp_path):
    app = create_app(Settings(workers=0, trace_workers=0, max_body_bytes=1000, workdir=tmp_path))
    with TestClient(app) as c:
        assert c.post("/v1/predict/batch", json={"jobs": [JOB] * 20}).status_code == 413


def test_workers_kill_at_the_deadline_and_shut_down_clean():
    pool = pools.Workers(1, 0)
    assert pool.run(sum, range(10), deadline=time.monotonic() + 60) == 45
    pid = pool.pids()[0]
    with pytest.raises(TimeoutError):  # a CPU-bound job past its deadline
        pool.run(sum, range(10**13), deadline=time.monotonic() + 0.5)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    full = pools.Workers(1, 0, in_thread=True)  # one slot, no queue: a second job is refused
    import threading

    first = threading.Thread(target=full.run, args=(time.sleep, 1.0))
    first.start()
    time.sleep(0.2)
    with pytest.raises(pools.Busy):
        full.run(sum, range(3))
    first.join()
    assert pool.run(sum, range(4), deadline=time.monotonic() + 60) == 6  # a fresh worker
    rows = pool.map(int, [("5",), ("x",), ("7",)], timeout=60)  # many jobs, in order
    assert rows[0] == (True, 5) and rows[2] == (True, 7)
    assert not rows[1][0] and isinstance(rows[1][1], pools.JobFailed) and "ValueError" in \
        str(rows[1][1])
    last = pool.pids()
    pool.shutdown()  # (the resource tracker stops with the last open pool: the SIGTERM test)
    full.shutdown()
    assert not [p for p in last if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    with pytest.raises(pools.Unavailable):
        pool.run(sum, range(3))


def test_a_worker_leaves_when_its_parent_is_killed(tmp_path):
    script = textwrap.dedent("""
        import sys, time
        from hybridmem.workers import Workers
        if __name__ == "__main__":
            pool = Workers(1, 0)
            pool.start()
            print(pool.pids()[0], flush=True)
            time.sleep(120)
    """)
    (tmp_path / "owner.py").write_text(script)
    owner = subprocess.Popen([sys.executable, str(tmp_path / "owner.py")],
                             stdout=subprocess.PIPE, text=True)
    worker = psutil.Process(int(owner.stdout.readline()))
    owner.kill()  # SIGKILL: no shutdown ran
    owner.wait(10)
    worker.wait(pools.POLL_S + 5)  # psutil.TimeoutExpired if it outlived its parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_leaves_no_process():
    import httpx

    port = _port()
    server = subprocess.Popen([sys.executable, "-m", "hybridmem", "serve", "--port", str(port),
                               "--workers", "1"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/predict", json=JOB, timeout=60)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.3)
        assert r.status_code == 200
        tree = psutil.Process(server.pid).children(recursive=True)
        assert tree  # the worker (and multiprocessing's resource tracker)
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises it once stopped
        gone, alive = psutil.wait_procs(tree, timeout=5)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if server.poll() is None:
            server.kill()


# ---------------------------------------------------------------- fuzz over the request schema

def _field_values(meta) -> st.SearchStrategy:
    from hybridmem.job import schema

    plain = schema.value_type(schema.TYPES[meta.key])
    choices = [st.sampled_from(list(meta.choices))] if meta.choices else []
    numbers = [st.integers(-3, 70000), st.sampled_from([0, 1, 2**31, 10**20, 10**400])]
    kinds = {bool: [st.booleans()], int: numbers,
             float: [st.floats(allow_nan=True, allow_infinity=True), *numbers]}.get(
        plain, [st.text(max_size=12)])
    return st.one_of(*choices, *kinds, st.none(), st.sampled_from(["/etc/passwd", "", [1]]))


def _requests() -> st.SearchStrategy:
    from hybridmem.job import schema

    skip = {"model", "lengths", "peft_config", "training_args", "deepspeed", "recipe"}
    fields = {m.key: _field_values(m) for m in schema.FIELDS
              if m.owner != "lora" and m.key not in skip}
    extra = {"gpu": st.sampled_from(["rtx-4090", "h100-80gb", "nope", 3]),
             "gpu_mem": st.one_of(st.floats(allow_nan=True), st.integers(-1, 10**30)),
             "find_max_batch": st.booleans(), "every_gpu": st.booleans(),
             "lengths": st.one_of(st.lists(st.integers(-2, 5000), max_size=20),
                                  st.text(max_size=20), st.sampled_from(["/etc/passwd"])),
             "lora": st.dictionaries(st.sampled_from(["r", "alpha", "dropout", "x"]),
                                     st.one_of(st.integers(-1, 10**20), st.floats()), max_size=2)}
    keys = sorted(fields) + sorted(extra)
    pick = st.lists(st.sampled_from(keys), max_size=5, unique=True)
    return st.tuples(st.sampled_from(["tiny-llama", "llama-3.2-1b", "tiny-llava"]), pick).flatmap(
        lambda mp: st.fixed_dictionaries(
            {"model": st.just(mp[0]), "method": st.just("analytic"),
             **{k: fields[k] if k in fields else extra[k] for k in mp[1]}}))


FUZZ_CASES = 60
STATUSES: list[int] = []


@settings(max_examples=FUZZ_CASES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(body=_requests())
def test_fuzz_no_500_no_traceback_no_request_over_its_limit(process_client, body):
    c, service = process_client
    text = json.dumps(body)  # NaN and Infinity as Python's json writes them (it reads them)
    t0 = time.perf_counter()
    r = c.post("/v1/predict", content=text, headers={"content-type": "application/json"})
    took = time.perf_counter() - t0
    STATUSES.append(r.status_code)
    assert r.status_code in (200, 422, 504), (body, r.status_code, r.text)
    assert "Traceback" not in r.text
    if r.status_code != 200:
        assert "\n" not in r.json()["detail"]
    assert took < service.settings.timeout_s + 3.0, (body, took)


def test_fuzz_leaves_the_cores_idle(process_client):
    """After the fuzz (run before this test in file order), no worker is computing; some of
    its requests were answered, not all refused."""
    _, service = process_client
    assert STATUSES.count(200) >= 5, STATUSES
    print("fuzz statuses", {c: STATUSES.count(c) for c in set(STATUSES)})
    alive = service.analytic.pids()
    used = _cpu(alive)
    time.sleep(0.5)
    assert _cpu(alive) - used < 0.2
