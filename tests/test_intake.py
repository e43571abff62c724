"""The intake package's registries: the launcher dialects are found by module, and the inputs
that are not job fields are declared once for the CLI and the HTTP API."""

from __future__ import annotations

import pytest

import pkgutil

import hybridmem.intake.dialects as dialects
from hybridmem.intake.dialects.protocol import REQUIRED
from hybridmem.job.options import API_FIELDS, CLI_OPTIONS, OPTIONS
from hybridmem.job.spec import TrainingSpec

SHARED = {"common", "protocol"}
"""Modules of `intake/dialects/` that are not a launcher."""


def test_every_dialect_module_is_registered_with_the_protocol():
    # a launcher module missing a protocol name would be skipped by the registry, unseen
    modules = {m.name for m in pkgutil.iter_modules(dialects.__path__)} - SHARED
    assert modules == set(dialects.DIALECTS)
    for name, module in dialects.DIALECTS.items():
        assert all(hasattr(module, attr) for attr in REQUIRED), name
        assert module.SOURCE == name


def test_detect_tries_the_dialects_in_their_declared_order():
    orders = [m.DETECT_ORDER for m in dialects.DIALECTS.values()]
    assert orders == sorted(orders)
    # an axolotl file naming a torchtune-style model component is torchtune's (tried first)
    cfg = {"base_model": "x", "model": {"_component_": "torchtune.models.llama3_2.lora_llama3_2_1b"}}
    assert dialects.detect(cfg, "x.yaml") == "torchtune"


def test_non_job_options_are_declared_once_for_both_front_doors():
    from hybridmem.cli.predict import OTHER_OPTIONS
    from hybridmem.serve.request import REQUEST_FIELDS

    assert OTHER_OPTIONS == CLI_OPTIONS and REQUEST_FIELDS is API_FIELDS
    names = [o.name for o in OPTIONS]
    assert len(names) == len(set(names))
    # the GPU, the tier and every config file reach both front doors
    both = {o.name for o in OPTIONS if o.decls and o.api}
    assert {"gpu", "gpu_mem", "method", "find_max_batch", "recipe", "config", "config_format",
            "deepspeed", "training_args", "peft_config", "quantization_config"} <= both


def test_a_job_is_resolved_and_its_tier_chosen_once_per_answer(monkeypatch, stub_tier):
    """The CLI's and the service's answer (`answer.answer`) resolves the defaults and picks the
    tier once, on the spec with its defaults filled in, and hands the job on."""
    import hybridmem.intake.resolve as resolve
    from hybridmem.answer import answer, resolve_job

    calls = {"choose": [], "defaults": 0}
    choose, defaults = resolve.choose_method, resolve.resolve_defaults

    def counted_choose(spec, method=None):
        calls["choose"].append(spec)
        return choose(spec, method)

    def counted_defaults(spec):
        calls["defaults"] += 1
        return defaults(spec)

    monkeypatch.setattr(resolve, "choose_method", counted_choose)
    monkeypatch.setattr(resolve, "resolve_defaults", counted_defaults)
    resolved, warnings = resolve_job({"model": "tiny-llama", "micro_batch": 2})
    out = answer(resolved, warnings, gpu=None)
    assert len(calls["choose"]) == 1 and calls["defaults"] == 1
    # the chooser saw the model's defaults (tiny-llama leaves attn and precision open)
    assert resolved.spec.attn is None and calls["choose"][0].attn == "sdpa"
    assert out.result.job["defaults"].keys() >= {"attn", "precision"}


def test_the_tiers_take_the_resolved_job_and_never_resolve_it_again(monkeypatch):
    """A whole answer with a GPU (the tier, the per-rank wrapper, the micro-batch search) fills
    the model's defaults once: below `resolve_once` every function gets a `Job`,
    whose type says its `attn` and `precision` are decided (`job/resolved.py`)."""
    import hybridmem.families.defaults as defaults
    import hybridmem.intake.resolve as resolve
    from hybridmem.answer import answer, resolve_gpu, resolve_job
    from hybridmem.job.resolved import Job

    calls = []
    real = defaults.resolve_defaults

    def counted(spec):
        calls.append(type(spec).__name__)
        return real(spec)

    monkeypatch.setattr(defaults, "resolve_defaults", counted)
    monkeypatch.setattr(resolve, "resolve_defaults", counted)
    resolved, warnings = resolve_job({"model": "tiny-llama", "micro_batch": 2})
    job = resolve.resolve_once(resolved, "analytic")
    assert isinstance(job.spec, Job) and not isinstance(job.given, Job)
    assert isinstance(job.spec.with_(micro_batch=3), Job)  # a copy keeps the decided values
    calls.clear()
    out = answer(job, warnings, gpu=resolve_gpu(None, 0.8), find_max_batch=True)
    assert out.result.fits and out.result.max_micro_batch > 2  # the search probed larger jobs
    assert calls == [], calls  # the job came resolved: nothing below resolves it again
    # the fit advice prices other jobs (more GPUs, a ZeRO stage: the precision defaults anew),
    # each resolved once as a new job by `predict`
    out = answer(job, warnings, gpu=resolve_gpu(None, 0.6))
    assert not out.result.fits and out.advice is not None
    assert calls and set(calls) == {"TrainingSpec"}  # never a Job resolved again


def test_a_job_has_its_defaults_decided():
    from hybridmem.job.resolved import Job

    with pytest.raises(AssertionError, match="precision"):
        Job.of(TrainingSpec(model="tiny-llama", attn="sdpa"))
    assert Job.of(TrainingSpec(model="tiny-llama", attn="eager", precision="fp32")).attn == "eager"
