"""estimate_per_rank (per-rank Prediction from any single-GPU tier) and smallest_fitting_setup."""

from __future__ import annotations

import pytest

from hybridmem.analytic import estimate as analytic
from hybridmem.categories import empty_breakdown
from hybridmem.gpus import GPU, gpu_by_name
from hybridmem.parallel.estimate import (
    NCCL_BYTES, analytic_points, estimate_per_rank, rank_fragmentation,
)
from hybridmem.parallel.fit import smallest_fitting_setup
from hybridmem.intake.merge import spec_from_inputs
from hybridmem.parallel.sharding import replicated
from hybridmem.job.parallel import ParallelSpec
from hybridmem.parallel.states import model_tensors
from hybridmem.prediction import Peak, Prediction
from hybridmem.job.spec import TrainingSpec

GiB = 2**30
ACT, TEMP, WS, CTX, FRAG, OPT_TEMP = 3 * GiB, GiB // 2, 64 << 20, 500 << 20, 100 << 20, 2 * GiB


class Stub:
    """A single-GPU tier with known numbers: full replicated states + fixed activation side.
    With `step_peak`, its peak is in the optimizer step (no activations in that breakdown)."""

    def __init__(self, step_peak: bool = False, master_step_peak: bool = False):
        self.step_peak = step_peak
        self.master_step_peak = master_step_peak  # SGD still peaks in the step under bf16-master
        self.calls: list[TrainingSpec] = []

    def __call__(self, spec: TrainingSpec) -> Prediction:
        self.calls.append(spec)
        r = replicated(spec, model_tensors(spec))
        b = empty_breakdown()
        step = self.step_peak and (spec.optimizer != "sgd" or (
            self.master_step_peak and spec.precision == "bf16-master"))
        b.update(param=r.param, grad=r.grad, optimizer=r.optimizer,
                 activation=0 if step else ACT, temporary=OPT_TEMP if step else TEMP,
                 workspace=WS, context=CTX, fragmentation=FRAG)
        alloc = sum(b[c] for c in ("param", "grad", "optimizer", "activation", "temporary"))
        return Prediction(model=spec.model, method="stub", params_total=1, params_trainable=1,
                          peak=Peak(allocated_bytes=alloc + WS, reserved_bytes=alloc + WS + FRAG,
                                    device_bytes=sum(b.values()),
                                    phase="optimizer" if step else "backward", iteration=1),
                          breakdown=b, modules=())


def _spec(strategy="zero3", n=8, **kw) -> TrainingSpec:
    kw.setdefault("precision", "bf16-master")
    return TrainingSpec(model="llama-3.2-3b", parallel=ParallelSpec(world_size=n, strategy=strategy),
                        **kw)


def test_per_rank_replaces_states_keeps_activation_side():
    spec = _spec("zero3", 8)
    pred = estimate_per_rank(spec, Stub())
    mt = model_tensors(spec)
    b = pred.breakdown
    assert sum(b.values()) == pred.peak.device_bytes
    assert pred.peak.allocated_bytes <= pred.peak.reserved_bytes <= pred.peak.device_bytes
    assert b["activation"] == ACT and b["workspace"] == WS
    # fragmentation is the rank's own replay (hybridmem.parallel.stream), not the tier's FRAG
    assert b["fragmentation"] == rank_fragmentation(spec, None).fragmentation
    assert b["context"] == CTX + NCCL_BYTES
    # K = 12 bytes per trainable param over 8 ranks (ZeRO P_os+g+p), all params train
    assert b["optimizer"] == 12 * -(-mt.trainable // 8)
    assert pred.extras["world_size"] == 8 and pred.extras["strategy"] == "zero3"
    assert pred.extras["per_rank"] is True
    assert pred.to_dict()["per_rank"] is True  # extras reach the --json object


def test_single_gpu_tier_sees_one_gpu():
    stub = Stub()
    estimate_per_rank(_spec("zero2", 4), stub)
    assert all(s.parallel == ParallelSpec() for s in stub.calls)


def test_step_peak_falls_back_to_sgd_for_activations():
    stub = Stub(step_peak=True)
    pred = estimate_per_rank(_spec("zero2", 8), stub)
    assert [s.optimizer for s in stub.calls] == ["adamw", "sgd"]
    fwd = pred.extras["phases"]["backward"]
    assert fwd["activation"] == ACT  # taken from the SGD estimate


def test_step_peak_falls_back_to_pure_bf16_twin():
    stub = Stub(step_peak=True, master_step_peak=True)
    pred = estimate_per_rank(_spec("zero3", 8), stub)
    assert [(s.optimizer, s.precision) for s in stub.calls] == [
        ("adamw", "bf16-master"), ("sgd", "bf16-master"), ("sgd", "bf16")]
    assert pred.extras["phases"]["backward"]["activation"] == ACT


def test_predict_dispatches_parallel_specs_per_rank():
    from hybridmem.predict import predict

    spec = TrainingSpec(model="tiny-llava", precision="bf16-master",
                        parallel=ParallelSpec(world_size=4, strategy="zero2"))
    pred = predict(spec, gpu=gpu_by_name("a100-40gb"), find_max_batch=True)
    assert pred.extras["per_rank"] is True and pred.extras["world_size"] == 4
    assert pred.max_micro_batch and pred.max_micro_batch > 1
    assert predict(spec.with_(parallel=ParallelSpec())).extras.get("per_rank") is None


def test_sharding_lowers_the_peak_and_more_gpus_never_raise_it():
    stub = Stub()
    peaks = [estimate_per_rank(_spec(s, 8), stub).peak.device_bytes
             for s in ("ddp", "zero1", "zero2", "zero3")]
    assert peaks[1] < peaks[0] and peaks[2] < peaks[1] and peaks[3] < peaks[2]
    by_n = [estimate_per_rank(_spec("zero3", n), stub).peak.device_bytes for n in (2, 4, 8, 16)]
    assert by_n == sorted(by_n, reverse=True)


def test_ddp_costs_more_than_one_gpu():
    stub = Stub()
    pred = estimate_per_rank(_spec("ddp", 2, precision="bf16-mixed"), stub)
    one = stub(_spec("none", 1, precision="bf16-mixed"))
    # backward: + a second copy of the fp32 grads in the reducer's buckets, + NCCL
    bwd = sum(pred.extras["phases"]["backward"].values())
    # (fragmentation: the rank's own replay instead of the one-GPU tier's)
    frag = rank_fragmentation(_spec("ddp", 2, precision="bf16-mixed"), None).fragmentation
    assert bwd - one.peak.device_bytes == (one.breakdown["grad"] + NCCL_BYTES
                                           + frag - one.breakdown["fragmentation"])
    # step: fp32 params 4 + grads 4 + buckets 4 + Adam 8 + one foreach temporary 4 per param,
    # over Llama-3.2-3B's 3,212,749,824 params (meta-device count, tied lm_head; test_trace.py)
    step = pred.extras["phases"]["optimizer"]
    assert step["param"] + step["grad"] + step["optimizer"] + step["temporary"] == 24 * 3_212_749_824


def test_fit_advice_matches_brute_force():
    stub = Stub()
    est = lambda s: estimate_per_rank(s, stub) if s.parallel.strategy != "none" else stub(s)  # noqa: E731
    spec = _spec("zero3", 2)
    gpu = GPU(name="test-16g", memory_bytes=16 * GiB, arch="unknown", source="test")
    advice = smallest_fitting_setup(spec, gpu, est)
    assert advice["fits_as_is"] is False
    fits = [n for n in range(2, 65) if est(_spec("zero3", n)).peak.device_bytes <= gpu.memory_bytes]
    assert advice["world_size"]["world_size"] == fits[0]
    assert advice["world_size"]["headroom_bytes"] >= 0


def test_fit_zero_stage_and_checkpointing():
    stub = Stub()
    est = lambda s: estimate_per_rank(s, stub)  # noqa: E731
    z1, z2 = (est(_spec(s, 8)).peak.device_bytes for s in ("zero1", "zero2"))
    assert z2 < z1
    gpu = GPU(name="t", memory_bytes=z2, arch="unknown", source="test")
    advice = smallest_fitting_setup(_spec("zero1", 8), gpu, est)
    assert advice["zero_stage"]["strategy"] == "zero2" and advice["zero_stage"]["headroom_bytes"] == 0
    assert advice["grad_ckpt"] is None  # the stub's activations do not depend on checkpointing


def test_llava_finetune_recipe_on_a100_40gb():
    """The README example: per-GPU answer for the official finetune recipe on 8x A100-40GB."""
    spec = spec_from_inputs(recipe="llava-1.5-finetune", overrides={"model": "llava-1.5-7b"})
    pred = estimate_per_rank(spec, analytic)
    single = analytic(spec.with_(parallel=ParallelSpec()))
    assert pred.extras["world_size"] == 8 and pred.extras["strategy"] == "zero3"
    # ZeRO-3 over 8 GPUs: model states shrink ~8x; 7B x (2 + 2 + 12) B = 113 GB on one GPU.
    # K = 12 B per trainable param: 7,063,427,072 (meta-device count) - the frozen CLIP tower's
    # 303,507,456 = 6,759,919,616 (test_parallel_formulas.test_model_tensors_count_matches_meta_count)
    assert pred.peak.device_bytes < single.peak.device_bytes / 2
    assert pred.breakdown["optimizer"] == pytest.approx(12 * 6_759_919_616 / 8, rel=1e-6)
    advice = smallest_fitting_setup(spec, gpu_by_name("a100-40gb"),
                                    lambda s: estimate_per_rank(s, analytic))
    assert advice["fits_as_is"] == (pred.peak.device_bytes <= gpu_by_name("a100-40gb").memory_bytes)


def test_analytic_timeline_points():
    spec = spec_from_inputs(recipe="llava-1.5-finetune", overrides={"model": "llava-1.5-7b"})
    points = analytic_points(spec)
    assert points[0].phase == "forward" and points[0].grad_fraction == 0
    assert max(p.grad_fraction for p in points) == 1.0
    # every point is considered, so the peak can only be at least the one-point answer
    full = estimate_per_rank(spec, analytic, analytic_points)
    one = estimate_per_rank(spec, analytic)
    assert full.peak.device_bytes >= one.peak.device_bytes
    assert sum(full.breakdown.values()) == full.peak.device_bytes
