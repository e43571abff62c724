"""`hybridmem serve`: the API answers what `hybridmem predict --json` answers, refuses paths and
bad input in the CLI's words, keeps its limits (body, time, trace pool), caches, and the page
renders an answer in a real browser."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from hybridmem.cli import main  # noqa: E402
from hybridmem.serve.app import Settings, create_app  # noqa: E402
from hybridmem.serve.pool import AnswerPool  # noqa: E402

README_JOB = {"model": "llava-1.5-7b", "micro_batch": 8, "seq_len": 2048,
              "train": "llm+projector", "grad_ckpt": True, "precision": "bf16-master",
              "gpu": "h100-80gb"}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    app = create_app(Settings(workers=0, trace_workers=0, workdir=tmp_path_factory.mktemp("serve")))
    with TestClient(app) as c:
        yield c


def cli_json(capsys, *args: str) -> dict:
    assert main(["predict", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def cli_error(capsys, *args: str) -> str:
    assert main(["predict", *args]) == 2
    return capsys.readouterr().err.strip().removeprefix("error: ")


# (API body, the same job as `hybridmem predict` flags): the analytic tier, a LoRA job with the
# fit advice of a sharded run, a largest-micro-batch search
PARITY = [
    (README_JOB, ["--model", "llava-1.5-7b", "--micro-batch", "8", "--seq-len", "2048",
                  "--train", "llm+projector", "--grad-ckpt", "--precision", "bf16-master",
                  "--gpu", "h100-80gb"]),
    ({"model": "meta-llama/Llama-3.2-1B", "train": "lora", "lora": {"r": 16, "alpha": 32.0},
      "micro_batch": 2, "seq_len": 512, "world_size": 2, "strategy": "zero3",
      "gpu": "rtx-4090", "method": "analytic"},
     ["--model", "meta-llama/Llama-3.2-1B", "--train", "lora", "--lora-r", "16",
      "--lora-alpha", "32", "--micro-batch", "2", "--seq-len", "512", "--world-size", "2",
      "--strategy", "zero3", "--gpu", "rtx-4090", "--method", "analytic"]),
    ({"model": "tiny-llava", "micro_batch": 1, "seq_len": 256, "gpu_mem": 1.0,
      "find_max_batch": True, "optimizer": "adamw-8bit"},
     ["--model", "tiny-llava", "--micro-batch", "1", "--seq-len", "256", "--gpu-mem", "1",
      "--find-max-batch", "--optimizer", "adamw-8bit"]),
]


@pytest.mark.parametrize("body,flags", PARITY, ids=["readme", "lora-zero3", "max-batch"])
def test_api_answers_what_the_cli_answers(client, capsys, body, flags):
    r = client.post("/v1/predict", json=body)
    assert r.status_code == 200, r.text
    assert r.json() == cli_json(capsys, *flags)


def test_the_answer_s_job_posts_back_to_the_same_answer(client):
    first = client.post("/v1/predict", json=README_JOB).json()
    again = client.post("/v1/predict", json={**first["job"], "gpu": "h100-80gb"}).json()
    assert again["peak"] == first["peak"] and again["fit"] == first["fit"]


def test_identical_jobs_come_from_the_cache(client):
    body = {"model": "tiny-llava", "micro_batch": 3, "seq_len": 128}
    assert client.post("/v1/predict", json=body).headers["x-cache"] == "miss"
    # the same job spelled with a default given explicitly: the resolved job is the key
    r = client.post("/v1/predict", json={**body, "grad_accum": 1})
    assert r.headers["x-cache"] == "hit"
    assert r.json() == client.post("/v1/predict", json=body).json()


LLAMAFACTORY_YAML = """\
model_name_or_path: meta-llama/Llama-3.2-1B
stage: sft
finetuning_type: lora
lora_rank: 8
cutoff_len: 512
per_device_train_batch_size: 2
gradient_acumulation_steps: 4
bf16: true
output_dir: saves/llama3-1b/lora/sft
"""


def test_launcher_config_text_is_read_as_config_reads_it(client, capsys, tmp_path):
    r = client.post("/v1/predict", json={"config": LLAMAFACTORY_YAML, "gpu": "rtx-4090"})
    assert r.status_code == 200, r.text
    job = r.json()["job"]
    assert (job["micro_batch"], job["seq_len"], job["train"]) == (2, 512, "lora")
    assert job["sources"]["micro_batch"] == "config.yaml: per_device_train_batch_size"
    # the misspelled key is a warning naming the nearest known key
    assert any("gradient_acumulation_steps" in w and "gradient_accumulation_steps" in w
               for w in job["warnings"]), job["warnings"]
    # the same file given to the CLI prices the same job
    path = tmp_path / "config.yaml"
    path.write_text(LLAMAFACTORY_YAML)
    cli = cli_json(capsys, "--config", str(path), "--gpu", "rtx-4090")
    assert r.json()["peak"] == cli["peak"]
    # a field of the body overrides the file, as a flag does
    r = client.post("/v1/predict", json={"config": LLAMAFACTORY_YAML, "micro_batch": 1})
    assert r.json()["job"]["micro_batch"] == 1


def test_training_arguments_json_text(client):
    text = json.dumps({"per_device_train_batch_size": 4, "gradient_checkpointing": True,
                       "bf16": True, "lerning_rate": 1e-5})
    r = client.post("/v1/predict", json={"model": "llama-3.2-1b", "config": text})
    assert r.status_code == 200, r.text
    job = r.json()["job"]
    assert job["micro_batch"] == 4 and job["grad_ckpt"] is True
    assert any("lerning_rate" in w for w in job["warnings"])


@pytest.mark.parametrize("args", [
    ["--precision", "bf17"],
    ["--micro-batch", "0"],
    ["--strategy", "zero9"],
])
def test_bad_input_is_422_with_the_cli_s_line(client, capsys, args):
    body = {"model": "llava-1.5-7b", args[0][2:].replace("-", "_"):
            int(args[1]) if args[1].isdigit() else args[1]}
    r = client.post("/v1/predict", json=body)
    assert r.status_code == 422
    assert r.json()["detail"] == cli_error(capsys, "--model", "llava-1.5-7b", *args)


def test_422_names_the_field_the_value_and_the_choices(client):
    r = client.post("/v1/predict", json={"model": "llava-1.5-7b", "gpu": "h1000"})
    assert r.status_code == 422
    out = r.json()
    assert out["field"] == "gpu" and out["value"] == "h1000" and "h100-80gb" in out["choices"]
    r = client.post("/v1/predict", json={"model": "llava-1.5-7b", "micro_btch": 2})
    assert r.status_code == 422 and "micro_batch" in r.json()["detail"]
    r = client.post("/v1/predict", json={"model": "llava-1.5-7b", "micro_batch": "8"})
    assert r.status_code == 422 and "integer" in r.json()["detail"]
    r = client.post("/v1/predict", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and "malformed JSON" in r.json()["detail"]


@pytest.mark.parametrize("body", [
    {"model": "/etc/passwd"},
    {"model": "../x"},
    {"model": "hybridmem/families/llava/presets/tiny-llava.json"},
    {"config": "model_name_or_path: /etc/passwd\nfinetuning_type: lora\ncutoff_len: 512\n"},
    {"config": "base_model: ../x\nadapter: lora\n"},
    {"config": "model_name_or_path: llama-3.2-1b\nfinetuning_type: lora\ncutoff_len: 512\n"
               "deepspeed: /etc/passwd\n"},
    {"model": "llama-3.2-1b", "training_args": {"deepspeed": "../ds.json"}},
    {"model": "llama-3.2-1b", "deepspeed": "/etc/passwd"},
    {"model": "llama-3.2-1b", "train": "peft", "peft_config": "/etc/passwd"},
])
def test_no_path_is_read_from_a_request(client, body):
    r = client.post("/v1/predict", json=body)
    assert r.status_code == 422, r.text
    assert "path" in r.json()["detail"], r.json()


def test_inline_config_json_is_priced_as_its_preset(client):
    from hybridmem.models.loader import load_config_dict

    _, data = load_config_dict("tiny-llava")
    inline = client.post("/v1/predict", json={"model": data, "seq_len": 128}).json()
    preset = client.post("/v1/predict", json={"model": "tiny-llava", "seq_len": 128}).json()
    assert inline["peak"] == preset["peak"]
    assert inline["job"]["model"] == "config.json (inline)"


def test_body_size_limit(tmp_path):
    app = create_app(Settings(workers=0, trace_workers=0, max_body_bytes=1000, workdir=tmp_path))
    with TestClient(app) as c:
        r = c.post("/v1/predict", json={"model": "tiny-llava", "config": "#" * 2000})
        assert r.status_code == 413


class Gate:
    """A trace job that waits until released (a stand-in for a long trace)."""

    def __init__(self):
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, resolved, warnings, gpu, *rest):
        self.started.set()
        self.release.wait(30)
        from hybridmem.answer import answer

        return answer(resolved, warnings, gpu, method="analytic").to_dict()


def test_trace_pool_full_is_429_and_health_stays_up(tmp_path):
    gate = Gate()
    pool = AnswerPool(1, 0, in_thread=True, job=gate)
    app = create_app(Settings(workers=0, pool=pool, workdir=tmp_path))
    trace = {"model": "tiny-llava", "seq_len": 64, "method": "trace"}
    with TestClient(app) as c:
        first: dict = {}
        worker = threading.Thread(target=lambda: first.update(r=c.post("/v1/predict", json=trace)))
        worker.start()
        assert gate.started.wait(30)
        t0 = time.monotonic()
        assert c.get("/healthz").status_code == 200
        assert time.monotonic() - t0 < 5  # generous: the point is it answers while a trace runs
        # an analytic answer is not held up by the trace either
        assert c.post("/v1/predict", json={"model": "tiny-llava", "seq_len": 64}).status_code == 200
        busy = c.post("/v1/predict", json={**trace, "seq_len": 32})
        assert busy.status_code == 429, busy.text
        gate.release.set()
        worker.join(30)
        assert first["r"].status_code == 200


@pytest.fixture(scope="module")
def trace_client(tmp_path_factory):
    """A server whose trace worker is a thread of its own (a spawned process would import
    torch again: seconds of CPU for nothing the test checks); analytic jobs in its threads."""
    pool = AnswerPool(1, 2, in_thread=True)
    app = create_app(Settings(workers=0, pool=pool, workdir=tmp_path_factory.mktemp("serve-trace")))
    with TestClient(app) as c:
        yield c


TINY_TRACE = {"model": "tiny-llava", "micro_batch": 1, "seq_len": 64, "method": "trace",
              "gpu_mem": 1.0}


def test_trace_answer_carries_the_cli_s_timeline(trace_client, capsys, tmp_path):
    from hybridmem.serve.respond import TIMELINE_POINTS
    from hybridmem.trace.timeline import thinned

    r = trace_client.post("/v1/predict", json={**TINY_TRACE, "timeline": True})
    assert r.status_code == 200, r.text
    ans = r.json()
    tl = ans["timeline"]
    assert 0 < len(tl["event"]) == len(tl["allocated"]) == len(tl["reserved"]) <= TIMELINE_POINTS
    assert [m["phase"] for m in tl["phases"]][:3] == ["forward", "backward", "optimizer"]
    # the thinning keeps each bucket's max: the curve's top is the answer's peak
    assert max(tl["allocated"]) == ans["peak"]["allocated_bytes"] == tl["peak"]["allocated"]
    # the same data the CLI's --timeline FILE.json writes for the same job, thinned
    path = tmp_path / "timeline.json"
    cli = cli_json(capsys, "--model", "tiny-llava", "--micro-batch", "1", "--seq-len", "64",
                   "--method", "trace", "--gpu-mem", "1", "--timeline", str(path))
    assert cli["timeline"] == str(path)
    assert tl == thinned(json.loads(path.read_text()), TIMELINE_POINTS)
    # opt-in: without the flag the answer is the CLI's object, no timeline in it
    plain = trace_client.post("/v1/predict", json=TINY_TRACE).json()
    assert "timeline" not in plain and plain["peak"] == ans["peak"]


def test_timeline_is_left_out_by_the_analytic_tier(client):
    r = client.post("/v1/predict", json={"model": "tiny-llava", "seq_len": 64, "timeline": True})
    assert r.status_code == 200 and "timeline" not in r.json()
    r = client.post("/v1/predict", json={"model": "tiny-llava", "timeline": "yes"})
    assert r.status_code == 422 and r.json()["field"] == "timeline"


def test_thinned_keeps_each_bucket_s_max():
    from hybridmem.trace.timeline import thinned

    data = {"event": list(range(10)), "allocated": [1, 5, 2, 2, 9, 1, 0, 3, 3, 4],
            "phases": [{"event": 0, "phase": "forward", "iteration": 0}], "peak": {}}
    out = thinned(data, 4)  # buckets of ceil(10 / 4) = 3 points: by hand
    assert out["event"] == [0, 3, 6, 9] and out["allocated"] == [5, 9, 3, 4]
    assert out["phases"] == data["phases"] and "reserved" not in out


def test_every_gpu_verdict_is_that_gpu_s_answer(client, capsys):
    from hybridmem.gpus import GPUS

    # llama-3.2-1b, micro-batch 4 x 1024: fits an A100-40GB, on a V100-32GB only after the
    # allocator's retries (its replay within 32 GiB), not on 24 GB cards
    body = {"model": "llama-3.2-1b", "micro_batch": 4, "seq_len": 1024, "gpu": "rtx-4090",
            "every_gpu": True}
    ans = client.post("/v1/predict", json=body).json()
    rows = {row["gpu"]: row for row in ans["every_gpu"]}
    assert list(rows) == list(GPUS) and {r["by"] for r in rows.values()} == {"replay"}
    assert rows["rtx-4090"]["fit"] == ans["fit"]
    for name in GPUS:
        cli = cli_json(capsys, "--model", "llama-3.2-1b", "--micro-batch", "4", "--seq-len",
                       "1024", "--gpu", name)
        assert (rows[name]["fit"], rows[name]["headroom_bytes"]) == (cli["fit"],
                                                                     cli["headroom_bytes"]), name
    assert {r["fit"] for r in rows.values()} == {"yes", "after-retry", "no"}
    # opt-in: without the flag, the CLI's object
    assert "every_gpu" not in client.post("/v1/predict", json={**body, "every_gpu": False}).json()


def test_every_gpu_of_a_trace_is_by_peak(trace_client):
    from hybridmem.gpus import GPUS

    ans = trace_client.post("/v1/predict", json={**TINY_TRACE, "every_gpu": True}).json()
    device = ans["peak"]["device_bytes"] - ans["paged_bytes"]
    for row in ans["every_gpu"]:  # no catalogue GPU asked for (gpu_mem): every row by peak
        assert row["by"] == "peak"
        assert row["fit"] == ("yes" if device <= GPUS[row["gpu"]].memory_bytes else "no")
        assert row["headroom_bytes"] == GPUS[row["gpu"]].memory_bytes - ans["peak"]["device_bytes"]


def test_trace_off_is_503(client):
    r = client.post("/v1/predict", json={"model": "tiny-llava", "seq_len": 64, "method": "trace"})
    assert r.status_code == 503


def test_time_limit_is_504(tmp_path):
    gate = Gate()
    pool = AnswerPool(1, 1, in_thread=True, job=gate)
    app = create_app(Settings(workers=0, pool=pool, timeout_s=0.5, workdir=tmp_path))
    with TestClient(app) as c:
        r = c.post("/v1/predict", json={"model": "tiny-llava", "seq_len": 64, "method": "trace"})
        gate.release.set()
        assert r.status_code == 504


def test_listings_schema_and_docs(client):
    from hybridmem.gpus import GPUS
    from hybridmem.job.schema import FIELDS

    assert client.get("/healthz").json() == {"status": "ok"}
    assert [g["name"] for g in client.get("/v1/gpus").json()] == list(GPUS)
    schema = client.get("/v1/schema").json()
    assert [f["key"] for f in schema["fields"]] == [m.key for m in FIELDS]
    precision = next(f for f in schema["fields"] if f["key"] == "precision")
    assert "bf16-master" in precision["choices"] and precision["group"] == "precision"
    assert client.get("/docs").status_code == 200
    body = client.get("/openapi.json").json()["paths"]["/v1/predict"]["post"]["requestBody"]
    assert "micro_batch" in body["content"]["application/json"]["schema"]["properties"]


def test_the_page_is_self_contained(client):
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    html = page.text
    # no CDN, no build: no external script, style or font
    assert "src=\"http" not in html and "href=\"http" not in html and "@import" not in html
    for endpoint in ("/v1/schema", "/v1/gpus", "/v1/predict"):
        assert endpoint in html
    # it asks for the timeline and the per-GPU verdicts, and draws the timeline as SVG
    assert "body.timeline = true" in html and "body.every_gpu = true" in html
    assert 'id="timeline"' in html and "tl-${name}" in html and 'id="tl-limit"' in html


def test_serve_without_fastapi_fails_in_one_line(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "uvicorn", None)
    assert main(["serve"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "hybridmem[serve]" in err


def test_serve_binds_localhost_by_default():
    from typer.testing import CliRunner

    from hybridmem.cli import build_app

    out = CliRunner().invoke(build_app(("serve",)), ["serve", "--help"])
    assert "127.0.0.1" in out.output


# ---------------------------------------------------------------- the page in Chromium

def _browser():
    selenium = pytest.importorskip("selenium", reason="selenium is not installed")
    del selenium
    chrome = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if chrome is None or driver is None:
        pytest.skip("no Chromium with its chromedriver (Debian: apt-get install chromium "
                    "chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chrome
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1600",
                "--disable-dev-shm-usage"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


@pytest.fixture
def live_server(tmp_path):
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pool = AnswerPool(1, 1, in_thread=True)  # as trace_client
    server = uvicorn.Server(uvicorn.Config(create_app(Settings(workers=0, pool=pool, workdir=tmp_path)),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_page_in_chromium(live_server, tmp_path, capsys):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    browser = _browser()
    try:
        wait = WebDriverWait(browser, 60)
        # a shared URL renders its answer on load
        browser.get(f"{live_server}/?model=llava-1.5-7b&micro_batch=8&seq_len=2048"
                    "&train=llm%2Bprojector&grad_ckpt=true&precision=bf16-master&gpu=h100-80gb")
        wait.until(lambda b: b.find_elements(By.ID, "verdict"))
        verdict = browser.find_element(By.ID, "verdict")
        cli = cli_json(capsys, "--model", "llava-1.5-7b", "--micro-batch", "8", "--seq-len",
                       "2048", "--train", "llm+projector", "--grad-ckpt", "--precision",
                       "bf16-master", "--gpu", "h100-80gb")
        assert verdict.get_attribute("data-fit") == cli["fit"]
        assert verdict.text.startswith("h100-80gb: ")
        browser.save_screenshot(str(tmp_path / "shared-url.png"))
        # fill the form and submit: a LoRA job on a 24 GB card
        browser.find_element(By.ID, "model").clear()
        browser.find_element(By.ID, "model").send_keys("llama-3.2-1b")
        Select(browser.find_element(By.ID, "train")).select_by_value("lora")
        Select(browser.find_element(By.ID, "precision")).select_by_value("bf16")
        Select(browser.find_element(By.ID, "gpu")).select_by_value("rtx-4090")
        browser.find_element(By.ID, "micro_batch").clear()
        browser.find_element(By.ID, "micro_batch").send_keys("2")
        browser.find_element(By.ID, "go").click()
        wait.until(lambda b: "rtx-4090" in b.find_element(By.ID, "verdict").text)
        cli = cli_json(capsys, "--model", "llama-3.2-1b", "--micro-batch", "2", "--seq-len",
                       "2048", "--train", "lora", "--grad-ckpt", "--precision", "bf16",
                       "--gpu", "rtx-4090")
        assert browser.find_element(By.ID, "verdict").get_attribute("data-fit") == cli["fit"]
        assert "model=llama-3.2-1b" in browser.current_url  # the shareable URL follows the form
        rows = browser.find_elements(By.CSS_SELECTOR, "#gpus tr")
        assert len(rows) == 1 + len(client_gpus())
        browser.save_screenshot(str(tmp_path / "form.png"))
        # a trace-tier job: its timeline is drawn as SVG (allocated, reserved, and the GPU's
        # allocator capacity: 0.6 GiB minus the 512 MiB CUDA context, near the ~70 MB curve)
        browser.get(f"{live_server}/?model=tiny-llava&micro_batch=1&seq_len=64&method=trace"
                    "&gpu_mem=0.6")
        wait.until(lambda b: b.find_elements(By.ID, "timeline"))
        for line in ("tl-allocated", "tl-reserved", "tl-limit"):
            assert browser.find_elements(By.CSS_SELECTOR, f"#timeline #{line}"), line
        points = browser.find_element(By.ID, "tl-allocated").get_attribute("points").split()
        assert len(points) > 10
        browser.save_screenshot(str(tmp_path / "trace.png"))
    finally:
        browser.quit()


def client_gpus() -> list[str]:
    from hybridmem.gpus import GPUS

    return list(GPUS)
