"""The CLI layer: option names, JSON contract, one-line errors with exit 2, plot output.

The estimator is replaced by a stub here so these tests check the CLI alone; the tiers have
their own tests (and tests/test_predict_e2e.py runs the real analytic tier end to end).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import importlib

predict_mod = importlib.import_module("hybridmem.predict")  # the package re-exports the function under the same name
from hybridmem.categories import CATEGORIES
from hybridmem.cli import main
from hybridmem.gpus import GPUS, GiB
from hybridmem.prediction import ModuleMemory, Peak, Prediction

CALLS: list = []


def _stub(spec, **options):
    """A fake tier: device peak grows 1 GiB per sample on top of 10 GiB."""
    CALLS.append((spec, options))
    device = (10 + spec.micro_batch) * GiB
    breakdown = dict.fromkeys(CATEGORIES, 0)
    breakdown["param"] = 10 * GiB
    breakdown["activation"] = spec.micro_batch * GiB
    mods = (ModuleMemory(name="language_model", params=5, trainable_params=5, param=10 * GiB,
                         grad=0, optimizer=0, activation=spec.micro_batch * GiB),)
    return Prediction(model=spec.model, method="stub", params_total=5, params_trainable=5,
                      peak=Peak(allocated_bytes=device, reserved_bytes=device, device_bytes=device,
                                phase="forward", iteration=0),
                      breakdown=breakdown, modules=mods, notes=("stub",))


@pytest.fixture(autouse=True)
def stub_tier(monkeypatch):
    CALLS.clear()
    monkeypatch.setattr(predict_mod, "estimator", lambda method: _stub)


def test_json_contract(capsys):
    assert main(["predict", "--model", "tiny-llava", "--micro-batch", "3", "--json",
                 "--gpu", "a100-40gb"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"model", "method", "params", "peak", "breakdown", "modules", "gpu",
                        "fits", "headroom_bytes", "max_micro_batch"}
    assert out["peak"]["device_bytes"] == 13 * GiB
    assert sum(out["breakdown"].values()) == out["peak"]["device_bytes"]
    assert out["gpu"] == {"name": "a100-40gb", "memory_bytes": GPUS["a100-40gb"].memory_bytes}
    assert out["fits"] is True
    assert out["headroom_bytes"] == GPUS["a100-40gb"].memory_bytes - 13 * GiB


def test_options_reach_the_spec(capsys):
    main(["predict", "--model", "tiny-llava", "--micro-batch", "2", "--seq-len", "64",
          "--images-per-sample", "2", "--image-size", "30", "--precision", "bf16-master",
          "--optimizer", "sgd-momentum", "--grad-ckpt", "--train", "lora", "--lora-r", "4",
          "--lora-alpha", "8", "--lora-targets", "q_proj,v_proj", "--attn", "eager", "--json"])
    spec, _ = CALLS[-1]
    assert (spec.micro_batch, spec.seq_len, spec.images_per_sample, spec.image_size) == (2, 64, 2, 30)
    assert (spec.precision, spec.optimizer, spec.grad_ckpt, spec.attn) == (
        "bf16-master", "sgd-momentum", True, "eager")
    assert spec.lora.r == 4 and spec.lora.alpha == 8 and spec.lora.targets == ("q_proj", "v_proj")


def test_find_max_batch(capsys):
    # stub: device = (10 + B) GiB; a 40 GiB (--gpu-mem 40) GPU fits B <= 30 by hand.
    assert main(["predict", "--model", "tiny-llava", "--gpu-mem", "40", "--find-max-batch",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["max_micro_batch"] == 30


def test_table_output(capsys):
    assert main(["predict", "--model", "tiny-llava", "--gpu", "h100-80gb"]) == 0
    out = capsys.readouterr().out
    assert "language_model" in out and "FITS on h100-80gb" in out and "forward phase" in out


def test_plot(tmp_path, capsys):
    path = tmp_path / "mem.png"
    assert main(["predict", "--model", "tiny-llava", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv,match", [
    (["--micro-batch", "-1"], "error: micro_batch=-1: must be a positive integer"),
    (["--precision", "fp8"], "error: precision='fp8' is not valid (valid: fp32,"),
    (["--gpu", "tpu"], "error: gpu='tpu' is not valid (valid: a100-40gb"),
    (["--gpu-mem", "-2"], "error: gpu_mem=-2.0: must be > 0 GiB"),
    (["--lora-r", "4"], "error: train='full': --lora-* options need --train lora"),
    (["--find-max-batch"], "error: find_max_batch=True: needs a GPU"),
    (["--timeline", "t.json"], "error: timeline='t.json': --timeline needs --method trace"),
])
def test_bad_input_one_line_exit_2(argv, match, capsys):
    assert main(["predict", "--model", "tiny-llava", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(match)
    assert err.count("\n") == 1 and "Traceback" not in err


def test_console_script_exit_code():
    """The installed entry point really exits 2 with one line (a fresh process, no stub)."""
    proc = subprocess.run([sys.executable, "-m", "hybridmem.cli", "predict", "--model",
                           "no-such-model"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: model='no-such-model': unknown preset")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv, tier", [
    (["--model", "tiny-llama"], "analytic"),
    (["--model", "tiny-llama", "--train", "lora", "--grad-ckpt", "--grad-ckpt-policy", "ops"],
     "trace"),
    (["--model", "tiny-mixtral", "--precision", "bf16"], "analytic"),
    (["--model", "tiny-mixtral", "--precision", "bf16", "--train", "lora"], "trace"),
])
def test_cli_and_api_choose_the_same_tier(argv, tier, capsys, monkeypatch):
    """One chooser (`predict.choose_method`): the CLI and `predict(spec)` take the same tier,
    with the same reason and notes (no calibrated learned model here: the analytic default)."""
    import hybridmem.learned.predictor as learned

    monkeypatch.setattr(learned, "default_method", lambda **_: "analytic")
    picked = []
    monkeypatch.setattr(predict_mod, "estimator", lambda m: picked.append(m) or _stub)
    assert main(["predict", *argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    spec, _ = CALLS[-1]
    api = predict_mod.predict(spec)
    assert picked == [tier, tier]
    assert out["method_reason"] == api.extras["method_reason"]
    assert out["notes"] == list(api.notes)
    assert any(n.startswith("method: trace chosen because") for n in api.notes) == (
        tier == "trace")


# --- --peft-config --------------------------------------------------------------

def _adapter(tmp_path, **cfg) -> str:
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("cfg, train, method", [
    ({"peft_type": "LORA", "r": 16, "target_modules": ["q_proj", "v_proj"]}, "lora", None),
    ({"peft_type": "LORA", "r": 16, "target_modules": ["q_proj"], "use_dora": True,
      "modules_to_save": ["lm_head"]}, "lora", None),
    ({"peft_type": "IA3", "target_modules": ["k_proj", "v_proj", "down_proj"],
      "feedforward_modules": ["down_proj"]}, "peft", "trace"),
])
def test_peft_config_reaches_the_spec_and_picks_the_tier(cfg, train, method, tmp_path, capsys,
                                                         monkeypatch):
    picked = []
    monkeypatch.setattr(predict_mod, "estimator", lambda m: picked.append(m) or _stub)
    assert main(["predict", "--model", "tiny-llama", "--peft-config",
                 _adapter(tmp_path, **cfg), "--json"]) == 0
    spec, _ = CALLS[-1]
    assert spec.train == train
    out = json.loads(capsys.readouterr().out)
    if train == "lora":
        assert (spec.lora.r, spec.lora.use_dora) == (16, bool(cfg.get("use_dora")))
        assert spec.lora.modules_to_save == tuple(cfg.get("modules_to_save", ()))
        assert picked != ["trace"] or method == "trace"
    else:
        assert json.loads(spec.peft_config)["peft_type"] == "IA3"
        assert picked == [method]
        assert any(n.startswith("method: trace chosen because the analytic tier refuses "
                                "train='peft': IA3") for n in out["notes"])


@pytest.mark.parametrize("content, match", [
    (None, "error: peft_config='{path}': no such file"),
    ("{not json", "error: peft_config='{path}': malformed JSON at line 1"),
    ('{"r": 8}', "error: peft_config.peft_type=None: an adapter_config.json names its method"),
])
def test_bad_peft_config_one_line_exit_2(content, match, tmp_path, capsys):
    path = tmp_path / "adapter_config.json"
    if content is not None:
        path.write_text(content)
    assert main(["predict", "--model", "tiny-llama", "--peft-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(match.format(path=path))
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("cfg, argv, match", [
    ({"peft_type": "NOPE_TUNING"}, [], "error: peft_config.peft_type='NOPE_TUNING': peft "),
    ({"peft_type": "IA3", "target_modules": ["k_proj"], "feedforward_modules": []},
     ["--method", "analytic"], "error: train='peft': IA3 adapters have no closed form"),
])
def test_peft_methods_the_tiers_refuse_exit_2(cfg, argv, match, tmp_path):
    """Real tiers (a fresh process, no stub): one line naming the method, exit 2."""
    proc = subprocess.run([sys.executable, "-m", "hybridmem.cli", "predict", "--model",
                           "tiny-llama", "--seq-len", "32", "--peft-config",
                           _adapter(tmp_path, **cfg), *argv], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(match)
    assert proc.stderr.count("\n") == 1
