"""`hybridmem doctor`, the supported-version floors, and the versions `--json` records."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json

import pytest

from hybridmem import environment
from hybridmem.cli import doctor, main


def _fake_versions(monkeypatch, **fake: str | None) -> None:
    """Make `environment.installed` see `fake` (None: not installed), the rest as installed."""
    real = importlib.metadata.version

    def version(dist: str) -> str:
        if dist in fake:
            if fake[dist] is None:
                raise importlib.metadata.PackageNotFoundError(dist)
            return fake[dist]
        return real(dist)
    monkeypatch.setattr(environment, "version", version)


def _check(name: str) -> dict:
    return next(c for c in doctor.report()["checks"] if c["name"].startswith(name))


@pytest.mark.compat
def test_report_names_the_installed_versions():
    env = doctor.report()["environment"]
    for dist in ("torch", "transformers", "peft"):  # read back from the metadata, not the code
        assert env[dist] == importlib.metadata.version(dist)


def test_a_missing_package_is_a_no_with_the_pip_command(monkeypatch):
    _fake_versions(monkeypatch, deepspeed=None, fastapi=None)
    assert _check("deepspeed") == {"name": "deepspeed (collect, strategy zero*)", "ok": False,
                                   "detail": "not installed: deepspeed (pip install deepspeed)"}
    serve = _check("serve extra")
    assert not serve["ok"] and "fastapi" in serve["detail"] and "uvicorn" not in serve["detail"]


def test_an_installed_package_that_cannot_be_imported(monkeypatch):
    _fake_versions(monkeypatch, **{"liger-kernel": "0.8.5"})
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "liger_kernel" else real(name, *a))
    liger = _check("liger-kernel")
    assert not liger["ok"] and "liger_kernel cannot be imported" in liger["detail"]


def test_learned_tier_without_its_libraries(monkeypatch):
    _fake_versions(monkeypatch, lightgbm=None)
    learned = _check("learned tier")
    assert not learned["ok"] and "lightgbm" in learned["detail"]


def test_learned_tier_without_a_model(monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRIDMEM_MODELS", str(tmp_path))
    learned = _check("learned tier")
    assert not learned["ok"] and "no trained model" in learned["detail"]


@pytest.mark.compat
def test_trace_tier_below_the_floor_is_refused_naming_the_version(monkeypatch, capsys):
    _fake_versions(monkeypatch, transformers="4.51.3")
    trace = _check("trace tier")
    need = f"transformers>={environment.TRACE_FLOORS['transformers']}"
    assert not trace["ok"] and need in trace["detail"] and "4.51.3" in trace["detail"]
    # the same refusal from predict: one line, exit 2, before any of that code runs
    assert main(["predict", "--model", "tiny-llava", "--method", "trace"]) == 2
    err = capsys.readouterr().err
    assert need in err and err.count("\n") == 1 and "Traceback" not in err


def test_trace_tier_without_peft(monkeypatch):
    _fake_versions(monkeypatch, peft=None)
    assert "peft is not installed" in _check("trace tier")["detail"]


@pytest.mark.parametrize("text, release", [
    ("4.57.1", (4, 57, 1)), ("2.13.0+cpu", (2, 13, 0)), ("5.0.0rc1", (5, 0, 0)),
    ("0.17.1.dev0", (0, 17, 1)), ("4.57", (4, 57)),
])
def test_release_numbers(text, release):
    assert environment.release(text) == release


def test_doctor_cli_json_and_console(capsys):
    assert main(["doctor", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {c["name"].split(" ")[0] for c in out["checks"]} >= {
        "analytic", "trace", "learned", "bitsandbytes", "liger-kernel", "cut-cross-entropy",
        "deepspeed", "ray", "serve"}
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("environment: python ")
    assert any(line.split()[:3] == ["ok", "analytic", "tier"] for line in lines)


@pytest.mark.compat
def test_predict_json_records_the_versions_it_priced_with(capsys):
    assert main(["predict", "--model", "llava-1.5-7b", "--json"]) == 0
    env = json.loads(capsys.readouterr().out)["environment"]
    assert env == {"python": env["python"],
                   **{d: environment.installed(d) for d in ("torch", "transformers", "peft", "trl")}}
