"""One answer that never contradicts itself (issue 37): the verdict, `fits`, `allocator.oom`,
the notes and the advice agree over random jobs with and without `--lengths`; headroom inside
the tier's stated error says so; "largest micro-batch: 0" is said as none; the module table
reconciles with the peak; a quantised job's checkpointing default says where it comes from.

All jobs here are tiny-llama on the analytic tier (milliseconds each), on GPUs sized around the
job's own unlimited peak so that every outcome occurs. Lengths files are SYNTHETIC (drawn by
hypothesis), no dataset's distribution.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridmem.answer import answer, resolve_job
from hybridmem.gpus import GiB, custom_gpu
from hybridmem.prediction import FIT_OUTCOMES, TIER_ERROR
from hybridmem.predict import predict
from test_front_door import consistent

MODEL = "tiny-llama"


def agree(found) -> None:
    """`test_front_door.consistent`, plus: the advice exists exactly when the job does not fit
    and every option it gives fits; `within_error` only for a job that fits, said by its note."""
    pred, advice = found.result, found.advice
    consistent(pred)
    says_within = any(n.startswith("fits only within the error") for n in pred.notes)
    assert says_within == bool(pred.within_error)
    if pred.within_error:
        assert pred.fits and pred.error_bytes > 0
    if pred.fits:
        assert advice is None
    else:
        assert advice is not None and advice["fits_as_is"] is False
        assert advice["current"]["headroom_bytes"] == pred.headroom_bytes
        options = [advice[k] for k in ("world_size", "zero_stage", "grad_ckpt", "micro_batch")
                   if advice[k] is not None] + list(advice["combined"])
        assert all(o["headroom_bytes"] >= 0 for o in options), options
    out = found.to_dict()
    assert out["fit"] in FIT_OUTCOMES and out["within_error"] == pred.within_error
    if "lengths" in out and out.get("allocator") is not None:
        assert out["lengths"]["oom"] <= out["allocator"]["oom"]


jobs = st.fixed_dictionaries({
    "micro_batch": st.integers(1, 6),
    "seq_len": st.sampled_from([64, 128, 256, 512]),
    "grad_ckpt": st.booleans(),
    "train": st.sampled_from(["full", "lora"]),
})


def _answer(job: dict, scale: float, lengths: list[int] | None, tmp_path):
    """The job's answer on a GPU whose memory above the CUDA context is `scale` x the job's
    own unlimited device peak above it (so fits, fits after retries and does not fit occur)."""
    from hybridmem.allocator.overheads import CUDA_CONTEXT_DEFAULT

    values = {"model": MODEL, **job}
    if lengths is not None:
        path = tmp_path / "lengths.txt"
        path.write_text("".join(f"{n}\n" for n in lengths))
        values["lengths"] = str(path)
    resolved, warnings = resolve_job(values)
    unlimited = predict(resolved.spec, method="analytic").peak.device_bytes
    memory = CUDA_CONTEXT_DEFAULT + (unlimited - CUDA_CONTEXT_DEFAULT) * scale
    return answer(resolved, warnings, custom_gpu(memory / GiB), method="analytic")


FEW = settings(max_examples=25, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.function_scoped_fixture])


@FEW
@given(job=jobs, scale=st.floats(0.6, 1.3))
def test_verdict_fits_oom_notes_and_advice_agree(job, scale, tmp_path):
    agree(_answer(job, scale, None, tmp_path))


@settings(FEW, max_examples=6)
@given(job=jobs, scale=st.floats(0.6, 1.3),
       lengths=st.lists(st.sampled_from([16, 40, 100, 200, 300, 512]), min_size=4,
                        max_size=16))
def test_with_lengths_the_run_decides_and_every_part_agrees(job, scale, lengths, tmp_path):
    """With a lengths file the run's replay decides the allocator's outcome; the notes, the
    verdict and the advice follow it (issue 37: `allocator.oom: false` beside `fit: "no"`)."""
    agree(_answer(job, scale, lengths, tmp_path))


def test_lengths_run_that_runs_out_says_so_everywhere(tmp_path):
    """The issue's case in small: each shape alone fits, the run of changing shapes does not.
    A capacity just above the longest shape's own unlimited reserved peak, shapes alternating
    short / long: whatever the replay decides, the answer's parts say the same."""
    path = tmp_path / "lengths.txt"
    path.write_text("".join(f"{n}\n" for n in [512, 40, 300, 64, 512, 128, 480, 32] * 4))
    resolved, warnings = resolve_job({"model": MODEL, "micro_batch": 2, "seq_len": 512,
                                      "lengths": str(path), "sampler": "sequential"})
    alone = predict(resolved.spec.with_(lengths=None), method="analytic")
    for extra in (0, 1 << 20, 4 << 20, 16 << 20):
        gpu = custom_gpu((alone.peak.device_bytes + extra) / GiB)
        found = answer(resolved, warnings, gpu, method="analytic")
        agree(found)
        notes = found.result.notes
        assert sum(n.startswith(("does not fit", "fits only after")) for n in notes) <= 1


def test_tier_error_is_the_published_median_device_error():
    """`TIER_ERROR` is each tier's median absolute device-peak error in
    docs/accuracy-published.json (written by experiments/published_accuracy.py)."""
    from pathlib import Path

    table = json.loads((Path(__file__).parents[1] / "docs/accuracy-published.json").read_text())
    for row in table["table"]:
        if row["figure"] == "device" and row["group"] == "all":
            assert TIER_ERROR[row["tier"]] == pytest.approx(row["median_ape"] / 100, abs=5e-4)


def test_headroom_inside_the_error_is_not_a_plain_fits():
    from hybridmem.report import verdict

    base = predict(predict_spec(), method="analytic")
    peak = base.peak.device_bytes
    margin = int(TIER_ERROR["analytic"] * peak)
    inside = predict(predict_spec(), method="analytic",
                     gpu=custom_gpu((peak + margin // 4) / GiB))
    outside = predict(predict_spec(), method="analytic",
                      gpu=custom_gpu((peak + 4 * margin) / GiB))
    assert inside.fits and inside.within_error
    assert verdict(inside).startswith("FITS ONLY WITHIN THE ERROR")
    assert "expect OOM risk" in verdict(inside)
    assert outside.fits and not outside.within_error
    assert verdict(outside).startswith("FITS on ")


def predict_spec():
    return resolve_job({"model": "llama-3.2-1b", "train": "lora"})[0].spec


def test_no_micro_batch_fits_is_said_as_none(capsys):
    from hybridmem.cli import main

    args = ["predict", "--model", "llama-3.2-1b", "--gpu-mem", "1", "--find-max-batch"]
    assert main(args) == 0
    assert "largest micro-batch that fits: none: micro-batch 1 does not fit" in \
        capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_micro_batch"] == 0
    assert any("none, micro-batch 1 does not fit" in n for n in out["notes"])


def test_module_table_sums_to_the_device_peak():
    from hybridmem.report import module_table

    for spec in (predict_spec(), predict_spec().with_(grad_ckpt=True, micro_batch=4)):
        pred = predict(spec, method="analytic")
        table = module_table(pred)
        rows = table["rows"]
        assert rows[-1]["total"] == pred.peak.device_bytes
        assert sum(r["total"] for r in rows[:-1]) == pred.peak.device_bytes
        assert table["columns"]["activation"] == "saved for backward"


def test_quantised_default_checkpointing_follows_peft_and_says_so():
    """peft `prepare_model_for_kbit_training(model)`: use_gradient_checkpointing=True by
    default (peft/utils/other.py); `kbit_prep` (default on) says the user's script calls it."""
    from hybridmem.techniques.quantize import KBIT_CHECKPOINTING

    base = {"model": "llama-3.2-1b", "train": "lora", "quantize": "nf4"}
    on, _ = resolve_job(base)
    assert on.spec.grad_ckpt and on.sources["grad_ckpt"] == KBIT_CHECKPOINTING
    off, _ = resolve_job({**base, "grad_ckpt": False})
    assert not off.spec.grad_ckpt
    unprepared, _ = resolve_job({**base, "kbit_prep": False})
    assert not unprepared.spec.grad_ckpt
    plain, _ = resolve_job({"model": "llama-3.2-1b", "train": "lora"})
    assert not plain.spec.grad_ckpt


def test_advice_searches_savers_with_the_micro_batch():
    """The issue's QLoRA case: no single change fits, checkpointing with a smaller micro-batch
    (and the other savers) does."""
    resolved, warnings = resolve_job({"model": "llama-3.1-8b", "train": "lora",
                                      "quantize": "nf4", "seq_len": 2048, "micro_batch": 4,
                                      "grad_ckpt": False})
    from hybridmem.gpus import gpu_by_name

    found = answer(resolved, warnings, gpu_by_name("rtx-4090"), method="analytic")
    agree(found)
    combined = found.advice["combined"]
    assert combined and combined[0]["grad_ckpt"] and combined[0]["micro_batch"] < 4
    assert combined[0]["changes"].startswith("checkpointing + micro-batch")


def test_images_are_echoed_as_priced():
    out = predict(resolve_job({"model": "tiny-llava"})[0].spec, method="analytic").job
    assert out["images_per_sample"] == 1 and isinstance(out["image_size"], int)
    assert "images_per_sample" in out["defaults"] and "image_size" in out["defaults"]
    text = predict(resolve_job({"model": MODEL})[0].spec, method="analytic").job
    assert text["images_per_sample"] is None and text["image_size"] is None


def test_qwen_vl_pixel_range_from_the_checkpoint(tmp_path):
    """A preset ships its checkpoint's preprocessor limits; a local folder's
    preprocessor_config.json is read; without one the processor class's defaults stand."""
    import shutil

    from hybridmem.families.qwen_vl.resize import QWEN_MAX_PIXELS
    from hybridmem.models.loader import load_config_dict, preset_folder

    _, data = load_config_dict("qwen2.5-vl-7b-instruct")
    assert data["preprocessor_pixels"] == [3136, 12845056]
    assert "preprocessor_pixels" not in load_config_dict("tiny-qwen2.5-vl")[1]
    from hybridmem.models.loader import _presets

    shutil.copy(_presets()["qwen2.5-vl-7b-instruct"][1], tmp_path / "config.json")
    assert preset_folder("qwen2.5-vl-7b-instruct") == "qwen_vl"

    def tokens(model):
        spec = resolve_job({"model": model, "train": "lora", "image_size": "2048x2048",
                            "seq_len": 8192})[0].spec
        return predict(spec, method="analytic").extras["analytic"]["image_tokens"]

    # smart_resize(2048, 2048, factor 28): 2044 x 2044 within 12,845,056 pixels -> 73^2 tokens;
    # within the class default 28*28*1280 pixels it shrinks to 980 x 980 -> 35^2
    assert tokens("qwen2.5-vl-7b-instruct") == 73 * 73
    assert tokens(str(tmp_path)) == 35 * 35  # no preprocessor_config.json beside it
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"min_pixels": 3136, "max_pixels": 12845056}))
    assert tokens(str(tmp_path)) == 73 * 73
    assert QWEN_MAX_PIXELS == 28 * 28 * 1280
