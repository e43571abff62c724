"""The page for people: the 8 fields first, a pasted config fills the form, /docs offline.

The API halves run through FastAPI's TestClient; the browser half drives Debian's Chromium
(skipped without it) against a live server, with the helpers of tests/test_serve.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from hybridmem.serve.app import Settings, create_app  # noqa: E402
from tests.test_serve import _browser, cli_json, live_server  # noqa: E402,F401 (a fixture)

LLAMAFACTORY = """model_name_or_path: meta-llama/Llama-3.2-1B
stage: sft
finetuning_type: lora
lora_rank: 16
cutoff_len: 1024
per_device_train_batch_size: 4
bf16: true
"""
"""A LLaMA-Factory train YAML (its examples/train_lora/*.yaml keys)."""
MAIN_FIELDS = ("model", "gpu", "train", "micro_batch", "seq_len", "precision", "grad_ckpt",
               "world_size", "strategy")
"""The fields the page shows first (the issue's 8: GPUs and strategy are two controls)."""


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    return TestClient(create_app(Settings(trace_workers=0,
                                          workdir=tmp_path_factory.mktemp("page"))))


def test_config_endpoint_gives_what_predict_config_reads(client, tmp_path, capsys):
    r = client.post("/v1/config", json={"config": LLAMAFACTORY})
    assert r.status_code == 200, r.text
    values = r.json()["values"]
    (tmp_path / "train.yaml").write_text(LLAMAFACTORY)
    job = cli_json(capsys, "--config", str(tmp_path / "train.yaml"))["job"]
    assert values["model"] == job["model"] == "llama-3.2-1b"  # the hub id names its preset
    for key in ("micro_batch", "seq_len", "train", "precision", "grad_ckpt"):
        assert values[key] == job[key], key
    assert values["lora_r"] == job["lora"]["r"] == 16


def test_config_endpoint_needs_a_model_when_the_config_names_none(client):
    accelerate = "distributed_type: MULTI_GPU\nnum_processes: 4\nmixed_precision: bf16\n"
    r = client.post("/v1/config", json={"config": accelerate})
    assert r.status_code == 422 and r.json()["field"] == "model"
    r = client.post("/v1/config", json={"config": accelerate, "model": "llama-3.2-1b"})
    assert r.json()["values"] == {"precision": "bf16-mixed", "world_size": 4, "strategy": "ddp"}
    r = client.post("/v1/config", json={"config": accelerate, "path": "/etc/passwd"})
    assert r.status_code == 422 and "path" in r.json()["detail"]


def test_docs_load_no_asset_from_the_network(client):
    pytest.importorskip("fastapi_offline", reason="fastapi-offline (the serve extra) is not "
                        "installed: /docs stays FastAPI's CDN page")
    html = client.get("/docs").text
    assert "cdn." not in html and "/static-docs/swagger-ui-bundle.js" in html
    assert client.get("/static-docs/swagger-ui-bundle.js").status_code == 200
    assert client.get("/static-docs/swagger-ui.css").status_code == 200


def test_page_main_fields_and_pasted_config_in_chromium(live_server, capsys):  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    browser = _browser()
    try:
        wait = WebDriverWait(browser, 60)
        browser.get(live_server)
        wait.until(lambda b: b.find_elements(By.ID, "go"))
        main = [e.get_attribute("id") for e in
                browser.find_elements(By.CSS_SELECTOR, ".main-fields select, .main-fields input")]
        assert tuple(main) == MAIN_FIELDS
        # everything else is folded away under Advanced
        assert browser.find_element(By.ID, "advanced").get_attribute("open") is None
        assert not browser.find_element(By.ID, "quant_storage").is_displayed()
        # the 8 fields, filled as a user would
        browser.find_element(By.ID, "model").send_keys("llama-3.2-3b")
        Select(browser.find_element(By.ID, "gpu")).select_by_value("a100-40gb")
        Select(browser.find_element(By.ID, "train")).select_by_value("full")
        browser.find_element(By.ID, "micro_batch").send_keys("4")
        browser.find_element(By.ID, "seq_len").send_keys("1024")
        Select(browser.find_element(By.ID, "precision")).select_by_value("bf16-mixed")
        Select(browser.find_element(By.ID, "grad_ckpt")).select_by_value("true")
        browser.find_element(By.ID, "world_size").send_keys("2")
        Select(browser.find_element(By.ID, "strategy")).select_by_value("zero3")
        browser.find_element(By.ID, "go").click()
        wait.until(lambda b: "a100-40gb" in b.find_element(By.ID, "verdict").text)
        cli = cli_json(capsys, "--model", "llama-3.2-3b", "--gpu", "a100-40gb", "--train",
                       "full", "--micro-batch", "4", "--seq-len", "1024", "--precision",
                       "bf16-mixed", "--grad-ckpt", "--world-size", "2", "--strategy", "zero3")
        assert browser.find_element(By.ID, "verdict").get_attribute("data-fit") == cli["fit"]
        table = browser.find_element(By.ID, "job-table").text
        assert "this form" in table and "flag --" not in table
        # the module table's last row is the device peak, as the CLI's
        last = browser.find_elements(By.CSS_SELECTOR, "#modules tr")[-1].text
        assert last.endswith(f"{cli['peak']['device_bytes'] / 2**30:.2f}"), last
        # a pasted LLaMA-Factory YAML fills the form
        browser.find_element(By.CSS_SELECTOR, "#paste summary").click()
        browser.find_element(By.ID, "config_text").send_keys(LLAMAFACTORY)
        browser.find_element(By.ID, "fill").click()
        wait.until(lambda b: b.find_element(By.ID, "filled").get_attribute("data-count"))
        values = {key: browser.find_element(By.ID, key).get_attribute("value")
                  for key in ("model", "micro_batch", "seq_len", "train", "lora_r")}
        assert values == {"model": "llama-3.2-1b", "micro_batch": "4", "seq_len": "1024",
                          "train": "lora", "lora_r": "16"}
    finally:
        browser.quit()

