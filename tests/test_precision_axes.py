"""Precision as axes (weights dtype, autocast, master weights, adapter dtype): the shorthands
name the same jobs, the axes override them, unpriced combinations are one-line errors, and
half-precision adapters are priced as a real CPU run of the same step holds them."""

from __future__ import annotations

import pytest

from hybridmem.errors import SpecError
from hybridmem.job.precision import AXES, in_words
from hybridmem.job.schema import job_dict, spec_from_job
from hybridmem.job.spec import TrainingSpec


def spec(**kw) -> TrainingSpec:
    return TrainingSpec(**{"model": "tiny-llama", "micro_batch": 2, "seq_len": 64, **kw})


@pytest.mark.parametrize("name", list(AXES))
def test_each_shorthand_is_its_axes(name):
    a = AXES[name]
    by_axes = spec(weights_dtype=a.weights_dtype, autocast=a.autocast,
                   master_weights=a.master_weights)
    assert by_axes.precision == name
    # the same job, the same serialised form (spec_hash): the axes are not stored twice
    assert by_axes.to_dict() == spec(precision=name).to_dict()


@pytest.mark.parametrize("kw, name", [
    (dict(weights_dtype="bf16"), "bf16"),               # loaded with torch_dtype=bfloat16
    (dict(weights_dtype="bf16", autocast="bf16"), "bf16-autocast"),  # ... and Trainer bf16=True
    (dict(precision="bf16", autocast="bf16"), "bf16-autocast"),
    (dict(autocast="bf16"), "bf16-mixed"),              # torch.amp over fp32 weights
    (dict(autocast="fp16"), "fp16-mixed"),
    (dict(precision="bf16", master_weights=True), "bf16-master"),
    (dict(precision="bf16-mixed", autocast="none"), "fp32"),   # an axis overrides the shorthand's
    (dict(precision="bf16-master", master_weights=False), "bf16"),
    (dict(precision="fp32", weights_dtype="fp16"), "fp16"),
])
def test_axes_complete_and_override(kw, name):
    assert spec(**kw).precision == name


@pytest.mark.parametrize("kw, field", [
    (dict(weights_dtype="bf16", autocast="fp16"), "autocast"),
    (dict(precision="bf16-mixed", master_weights=True), "master_weights"),
    (dict(precision="fp16", autocast="bf16"), "autocast"),
    (dict(weights_dtype="fp8"), "weights_dtype"),
    (dict(autocast="fp32"), "autocast"),
])
def test_unpriced_combination_is_one_line(kw, field):
    with pytest.raises(SpecError) as err:
        spec(**kw)
    assert str(err.value).startswith(field) and "\n" not in str(err.value)


@pytest.mark.parametrize("kw", [
    dict(precision="bf16-mixed", train="lora", adapter_dtype="bf16"),  # autocast: fp32 weights
    dict(precision="bf16", train="lora", adapter_dtype="fp16"),        # not the weights' dtype
    dict(precision="bf16", train="full", adapter_dtype="bf16"),        # no adapters
    dict(precision="bf16", train="lora", adapter_dtype="bf16", quantize="nf4"),
])
def test_half_adapters_only_in_their_weights_dtype(kw):
    with pytest.raises(SpecError, match="^adapter_dtype"):
        spec(**kw)


def test_job_carries_the_axes_and_reads_back():
    s = spec(precision="bf16", train="lora", adapter_dtype="bf16")
    job = job_dict(s)
    assert (job["weights_dtype"], job["autocast"], job["master_weights"],
            job["adapter_dtype"]) == ("bf16", "none", False, "bf16")
    assert spec_from_job(job) == s
    assert job_dict(spec(precision="bf16-mixed"))["weights_dtype"] == "fp32"
    assert "adapters bf16" in in_words("bf16", "lora", adapter_dtype="bf16")


def test_half_adapters_halve_their_states_in_both_tiers():
    from hybridmem.analytic import estimate as analytic

    trace = pytest.importorskip("hybridmem.trace")
    full, half = (spec(precision="bf16", attn="sdpa", train="lora", adapter_dtype=d)
                  for d in ("fp32", "bf16"))
    a32, a16, t16 = analytic(full), analytic(half), trace.estimate(half)
    # AdamW keeps exp_avg and exp_avg_sq in the parameter's dtype (torch.optim.adamw
    # `zeros_like(p)`): 2 states x adapters x 2 B against 4 B
    assert a16.breakdown["optimizer"] * 2 == a32.breakdown["optimizer"]
    assert a16.params_trainable == a32.params_trainable
    assert a16.breakdown["param"] < a32.breakdown["param"]
    assert a16.breakdown["param"] == t16.breakdown["param"]
    assert a16.breakdown["optimizer"] == t16.breakdown["optimizer"]
    ta = a16.peak.allocated_bytes - a16.breakdown["workspace"]
    tt = t16.peak.allocated_bytes - t16.breakdown["workspace"]
    assert abs(ta - tt) / tt <= 0.05  # the analytic-vs-trace tolerance (test_analytic_vs_trace)


@pytest.mark.parametrize("kw", [dict(), dict(grad_ckpt=True)])
def test_half_adapters_trace_equals_real_cpu_run(kw):
    torch = pytest.importorskip("torch")
    from test_trace import real_cpu_peak

    from hybridmem.models import load_config
    from hybridmem.trace import runner

    s = spec(precision="bf16", attn="sdpa", train="lora", adapter_dtype="bf16", **kw)
    job = runner.prepare(s, load_config(s.model))
    dtypes = {p.dtype for n, p in job.model.named_parameters() if "lora_" in n}
    assert dtypes == {torch.bfloat16}  # peft autocast_adapter_dtype=False: the base's dtype
    tracker, _ = runner.trace(s, load_config(s.model))
    assert int(tracker.live_curve(device_only=False).max()) == real_cpu_peak(s)


def test_harness_builds_half_adapters_and_steps():
    """The CUDA harness's job (run here on the CPU): peft with autocast_adapter_dtype=False
    leaves the adapters in the base's bf16, and AdamW's state follows them."""
    torch = pytest.importorskip("torch")
    from hybridmem.harness import workload
    from hybridmem.models import load_config

    s = spec(precision="bf16", attn="sdpa", train="lora", adapter_dtype="bf16")
    device = torch.device("cpu")
    job = workload.prepare(s, load_config(s.model), device)
    lora = {n: p for n, p in job.model.named_parameters() if "lora_" in n}
    assert lora and {p.dtype for p in lora.values()} == {torch.bfloat16}
    workload.backward(job, workload.forward(job, s, device), s)
    workload.optimizer_step(job, s)
    states = [t for st in job.optimizer.state.values() for t in st.values()
              if isinstance(t, torch.Tensor) and t.dim() > 0]
    assert states and {t.dtype for t in states} == {torch.bfloat16}


def test_an_axis_flag_over_a_file_names_its_source(tmp_path):
    from hybridmem.intake.merge import resolve_inputs

    args = tmp_path / "args.json"
    args.write_text('{"bf16": true, "per_device_train_batch_size": 2}')
    # TrainingArguments bf16=True is autocast over fp32 weights; --autocast none drops it
    r = resolve_inputs(training_args=str(args), overrides={"model": "tiny-llama",
                                                           "autocast": "none"})
    assert r.spec.precision == "fp32"
    assert r.sources["precision"] == f"flag --autocast over {args}: bf16"


def test_every_precision_choice_has_its_axes():
    """The schema's `precision` choices and the one AXES table name the same shorthands (a
    choice without axes would have no bytes per element: POLICIES is derived from AXES)."""
    from hybridmem.job.precision import AXES, POLICIES
    from hybridmem.job.spec import PRECISIONS

    assert set(PRECISIONS) == set(AXES) == set(POLICIES)
