"""`--cut-cross-entropy`: hand-derived bytes of the CCE loss, analytic vs trace, the emulation's
allocations, clashes, the CLI flag and the recorded column."""

from __future__ import annotations

import pytest
import torch

from hybridmem.allocator.alloc import t
from hybridmem.analytic import estimate as analytic
from hybridmem.analytic.estimate import timeline
from hybridmem.errors import SpecError
from hybridmem.techniques import cce
from hybridmem.job.recorded import recorded_values
from hybridmem.job.spec import LoraSpec, TrainingSpec
from hybridmem.trace import estimate as trace_estimate
from hybridmem.trace.tracker import StorageTracker


def tiny(**kw) -> TrainingSpec:
    return TrainingSpec(**{"model": "tiny-llama", "micro_batch": 2, "seq_len": 128,
                           "precision": "bf16", "cut_cross_entropy": True, **kw})


def _head(spec: TrainingSpec):
    _, priced, _ = timeline(spec)
    return next(p.step.acts for p in priced if p.layer.kind == "lm_head")


def test_cce_head_bytes_by_hand():
    # tiny-llama (hybridmem/families/decoders/presets/tiny-llama.json): hidden 64, vocab 128; b 2 x s 128,
    # bf16 full fine-tune. Shift 1 (utils.py `_build_flat_valids`): N = 2 x 127 = 254 counted
    # tokens. Saved (cce.py `save_for_backward`): e = the final norm's output 256 x 64 bf16 =
    # 32768 B; valids int64 254 -> 2032 -> 2048 (512-byte blocks); lse fp32 254 -> 1016 -> 1024;
    # logit_avg fp32 128 -> 512 (cce_lse_forward_kernel, filter_eps "auto").
    head = _head(tiny())
    assert head.parts == (32768, 2048, 1024, 512)
    # forward top: nonzero's int64 (254 x 2) = 4064 -> 4096 beside its int32 cast 2032 -> 2048
    assert head.fwd_parts == (4096, 2048)
    # backward (cce_backward_kernel): sort_logit_avg int32 128 -> 512; de = zeros_like(e)
    # 32768; de_locks int32 cdiv(254, 128) x cdiv(64, 64) = 2 -> 512; dc_locks int32
    # cdiv(128, 128) x 1 -> 512; dc (the weight's grad, 128 x 64 bf16) is the step's grad
    assert head.bwd_parts == (512, 32768, 512, 512)
    # no logits anywhere: HF's head keeps the fp32 (256 x 128) log_softmax output
    assert t(256 * 128, 4) in _head(tiny(cut_cross_entropy=False)).parts
    assert all(x < t(256 * 128, 4) for x in (*head.parts[1:], *head.fwd_parts))


def test_lora_frozen_head_makes_no_weight_grad_locks():
    # lm_head frozen: dc and dc_locks are None in cce_backward_kernel (c.requires_grad False)
    head = _head(tiny(train="lora"))
    assert head.bwd_parts == (512, 32768, 512)


def test_emulation_allocates_what_the_kernels_do():
    # the emulated autograd.Function on real CPU tensors, every storage recorded
    b, s, h, v = 2, 128, 64, 128
    e = torch.zeros(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    c = torch.zeros(v, h, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.zeros(b, s, dtype=torch.int64)
    with StorageTracker() as tk:
        loss = cce.linear_cross_entropy(e, c, labels)
        loss.backward()
    sizes = sorted(st.nbytes for st in tk.storages)
    n = b * (s - 1)
    for nbytes in (n * 8 * 2, n * 4 * 2, n * 8, n * 4, v * 4, v * 8, b * s * h * 2, v * h * 2):
        assert nbytes in sizes, nbytes  # nonzero, its int32 cast, valids, lse, logit_avg,
        # argsort's int64, de, dc
    assert b * s * v * 2 not in sizes and b * (s - 1) * v * 4 not in sizes  # no logits


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-llava"])
@pytest.mark.parametrize("kw", [dict(), dict(train="lora"), dict(grad_ckpt=True),
                                dict(train="lora", grad_ckpt=True)],
                         ids=["full", "lora", "full-ckpt", "lora-ckpt"])
def test_analytic_within_3_percent_of_trace(model, kw):
    # tests/test_loss.py's tolerance for Liger; bf16 (CCE refuses fp32 weights: bf16-mixed)
    spec = tiny(model=model, seq_len=128 if model == "tiny-llama" else 256, **kw)
    a, tr = analytic(spec), trace_estimate(spec)
    ta = a.peak.allocated_bytes - a.breakdown["workspace"]
    tt = tr.peak.allocated_bytes - tr.breakdown["workspace"]
    assert abs(ta - tt) <= 0.03 * tt


def test_cce_lowers_the_peak_of_a_full_fine_tune():
    on, off = trace_estimate(tiny()), trace_estimate(tiny(cut_cross_entropy=False))
    assert on.peak.allocated_bytes < off.peak.allocated_bytes


@pytest.mark.parametrize("kw, field", [
    (dict(liger=True), "loss"),  # one loss replacement at a time (hybridmem.techniques)
    (dict(chunked_ce=4), "loss"),
    (dict(precision="bf16-mixed"), "precision"),
    (dict(precision="fp32"), "precision"),
    (dict(train="lora", lora=LoraSpec(targets=("q_proj", "lm_head"))), "cut_cross_entropy"),
    (dict(train="lora", lora=LoraSpec(modules_to_save=("lm_head",))), "cut_cross_entropy"),
])
def test_clashes_are_one_line_spec_errors(kw, field):
    with pytest.raises(SpecError) as err:
        tiny(**kw)
    assert err.value.field == field and "\n" not in str(err.value)


def test_model_the_patch_does_not_handle_is_refused():
    from hybridmem.families import target

    with pytest.raises(SpecError, match="gemma2") as err:
        cce.check_model(target("gemma2"))
    assert "model_type llava" in str(err.value)  # the records that list cce are the choices
    cce.check_model(target("llava", "llama"))  # handled: no error
    with pytest.raises(SpecError, match="gemma2"):  # LLaVA is patched through its LM
        cce.check_model(target("llava", "gemma2"))


def test_cli_flag_and_clash_exit_2(capsys):
    from hybridmem.cli import main

    code = main(["predict", "--model", "tiny-llama", "--precision", "bf16",
                 "--cut-cross-entropy", "--method", "analytic", "--json"])
    out = capsys.readouterr().out
    assert code == 0 and '"cut_cross_entropy": true' in out
    code = main(["predict", "--model", "tiny-llama", "--precision", "bf16",
                 "--cut-cross-entropy", "--liger", "--method", "analytic"])
    err = capsys.readouterr().err
    assert code == 2 and "--cut-cross-entropy" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_recorded_column_and_old_rows(tmp_path):
    from hybridmem.harness import store

    assert recorded_values(tiny())["cut_cross_entropy"] is True
    # at the default the spec serialises as before the field existed: same spec_hash
    off = TrainingSpec(model="tiny-llama")
    assert "cut_cross_entropy" not in off.to_dict()
    assert "cut_cross_entropy" in tiny().to_dict()
    # a part written before the column existed reads back with the default
    path = tmp_path / "old.parquet"
    from test_harness_store import _row

    store.rows_frame([_row("a", "2026-01-01T00:00:00Z")]).drop(
        columns=["cut_cross_entropy"]).to_parquet(path)
    df = store._read([path])
    assert df["cut_cross_entropy"].tolist() == [False]


def test_harness_cpu_stand_in_runs_the_emulation():
    from hybridmem.harness import workload
    from hybridmem.models import load_config

    spec = tiny(micro_batch=1, seq_len=32)
    job = workload.prepare(spec, load_config(spec.model), torch.device("cpu"))
    out = job.model(**job.batch)
    out.loss.backward()
    assert out.logits is None and job.model.lm_head.weight.grad is not None


def test_real_cce_missing_is_one_line():
    try:
        import cut_cross_entropy  # noqa: F401
        pytest.skip("cut-cross-entropy installed")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="pip install cut-cross-entropy"):
        cce.apply_cce(torch.nn.Linear(1, 1))


@pytest.mark.parametrize("kw", [dict(), dict(train="lora", grad_ckpt=True, loop="custom")],
                         ids=["full", "lora-ckpt-custom"])
def test_trace_equals_real_cpu_run(kw):
    # the meta-backend trace of the emulation == the same step on real CPU tensors (every
    # label counted in both: `build_flat_valids` sizes nonzero's output so)
    from test_trace import real_cpu_peak

    from hybridmem.models import load_config
    from hybridmem.trace import runner

    spec = tiny(seq_len=64, **kw)
    tracker, _ = runner.trace(spec, load_config(spec.model), backend="meta")
    assert int(tracker.live_curve(device_only=False).max()) == real_cpu_peak(spec)
