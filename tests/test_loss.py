"""`--liger` and `--chunked-ce N`: hand-derived changes of the loss region, trace == a real CPU
run of the same (emulated) step, analytic close to trace, TrainingArguments reading, clashes."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from hybridmem.analytic import estimate as analytic
from hybridmem.allocator.alloc import t
from hybridmem.analytic.estimate import timeline
from hybridmem.errors import SpecError
from hybridmem.techniques import liger_kernels as L
from hybridmem.techniques.kernels import flce_chunk_size, torch_chunks
from hybridmem.models import load_config
from hybridmem.intake.resolve import spec_from_cli
from hybridmem.job.spec import LoraSpec, TrainingSpec
from hybridmem.trace import estimate as trace_estimate, runner

from test_trace import real_cpu_peak

# llama-3.2-3b preset (hybridmem/families/decoders/presets/llama-3.2-3b.json): hidden 3072, vocab 128256,
# tied embeddings; micro-batch 4 x seq 2048 = 8192 tokens
H, V, TOKENS = 3072, 128256, 4 * 2048


def _head(spec: TrainingSpec):
    _, priced, _ = timeline(spec)
    return next(p.step.acts for p in priced if p.layer.kind == "lm_head")


def test_flce_chunk_rule_by_hand():
    # fused_linear_cross_entropy.py: inc_factor = cdiv(128256, 3072) = 42,
    # cdiv(8192, 42) = 196 -> next power of 2 = 256 rows per chunk
    assert flce_chunk_size(TOKENS, H, V) == 256
    # the source's own example: BT = 4096*4, V = 32000, H = 4096 -> chunk_size 2048
    assert flce_chunk_size(4096 * 4, 4096, 32000) == 2048
    assert torch_chunks(10, 4) == [3, 3, 3, 1]  # torch.chunk docs: the last chunk is smaller


def test_liger_removes_the_fp32_logits_by_hand():
    base = TrainingSpec(model="llama-3.2-3b", micro_batch=4, seq_len=2048)
    hf, lg = _head(base), _head(base.with_(liger=True))
    logits32 = t(TOKENS * V, 4)
    # HF ForCausalLMLoss: log_softmax's fp32 output saved, logits + their fp32 upcast in forward
    assert logits32 in hf.parts and logits32 in hf.fwd_parts
    # nll_loss's grad and log_softmax's grad input: the first stage of the head's two-stage
    # backward, before its weight grad exists (common.decoder_acts.lm_head, docs/families.md)
    assert hf.bwd_mlp >= 2 * logits32
    # Liger: nothing of B x V size anywhere; saved = grad_input (B x H, fp32 stream) +
    # grad_weight (V x H, fp32 weight: the tied embedding trains)
    assert all(x < t(TOKENS * V, 2) for x in (*lg.parts, *lg.fwd_parts, *lg.bwd_parts))
    assert lg.saved == t(TOKENS * H, 4) + t(V * H, 4)
    assert lg.grad_in_saved == t(V * H, 4)
    # the chunk working set under autocast: 256-row bf16 logits, the cached and the uncached
    # bf16 weight casts, the input chunk's cast
    for part in (t(256 * V, 2), t(V * H, 2), t(256 * H, 2)):
        assert part in lg.fwd_parts
    assert lg.bwd_extra == 512  # the 0-dim torch.tensor(1.0) of the backward's comparison


def test_liger_moves_the_peak_to_the_forward():
    base = TrainingSpec(model="llama-3.2-3b", micro_batch=4, seq_len=2048)
    hf, lg = analytic(base), analytic(base.with_(liger=True))
    # HF: the loss backward's fp32 B x V tensors on top of every saved activation; with them
    # gone the top is the end of the forward (all activations saved, Liger's grads made)
    assert (hf.peak.phase, lg.peak.phase) == ("backward", "forward")
    drop = hf.peak.allocated_bytes - lg.peak.allocated_bytes
    assert drop > 2 * t(TOKENS * V, 4)  # at least the two fp32 B x V tensors of HF's backward


def test_chunked_ce_upcasts_one_chunk_by_hand():
    spec = TrainingSpec(model="llama-3.2-3b", micro_batch=4, seq_len=2048, chunked_ce=8)
    hf, ch = _head(spec.with_(chunked_ce=0)), _head(spec)
    chunk = 4 * 256  # 2048 / 8 positions x 4 samples
    # forward: the 8 bf16 logits chunks and one fp32 upcast instead of the whole fp32 copy
    assert ch.fwd_extra == 8 * t(chunk * V, 2) + t(chunk * V, 4)
    assert hf.fwd_extra == t(TOKENS * V, 2) + t(TOKENS * V, 4)
    # the log_softmax outputs are still all saved (fp32), one per chunk
    assert ch.parts.count(t(chunk * V, 4)) == 8
    # backward: the last chunk's two fp32 grads, not two B x V ones
    assert ch.bwd_extra == 2 * t(chunk * V, 4)


def tiny(**kw) -> TrainingSpec:
    return TrainingSpec(**{"model": "tiny-llama", "micro_batch": 2, "seq_len": 64, **kw})


def _real(spec: TrainingSpec) -> int:
    with L.rope_patched("llama") if spec.liger else contextlib.nullcontext():
        return real_cpu_peak(spec)


@pytest.mark.parametrize("kw", [
    dict(liger=True, precision="bf16-mixed"),
    dict(liger=True, precision="bf16", train="lora", grad_ckpt=True, grad_accum=2,
         loop="custom"),
    dict(chunked_ce=4, precision="bf16-mixed"),
    dict(chunked_ce=3, precision="fp32", train="lora", grad_ckpt=True, loop="custom"),
], ids=["liger-mixed", "liger-lora-ckpt-accum-custom", "chunked-mixed", "chunked3-lora-custom"])
def test_trace_equals_real_cpu_run(kw):
    spec = tiny(**kw)
    tracker, _ = runner.trace(spec, load_config(spec.model), backend="meta")
    assert int(tracker.live_curve(device_only=False).max()) == _real(spec)


def test_liger_emulation_runs_no_lm_head_and_no_logits():
    spec = tiny(liger=True, precision="fp32")
    with L.rope_patched("llama"):
        job = runner.prepare(spec, load_config(spec.model))
        calls = []
        job.model.lm_head.register_forward_hook(lambda *a: calls.append(1))
        out = job.model(**job.batch, use_cache=False)
        out.loss.backward()
    assert out.logits is None and calls == []
    assert job.model.lm_head.weight.grad is not None  # grad_weight made in the forward


def _tensor_peak(p) -> int:
    return p.peak.allocated_bytes - p.breakdown["workspace"]


@pytest.mark.parametrize("kw", [
    dict(liger=True, precision="bf16-mixed"),
    dict(liger=True, precision="bf16", train="lora"),
    dict(liger=True, precision="bf16-mixed", grad_ckpt=True),
    dict(chunked_ce=4, precision="bf16-mixed"),
    dict(chunked_ce=4, precision="bf16", train="lora"),
])
def test_analytic_within_3_percent_of_trace_tiny(kw):
    spec = tiny(**{"seq_len": 128, **kw})
    a, tr = analytic(spec), trace_estimate(spec)
    assert abs(_tensor_peak(a) - _tensor_peak(tr)) / _tensor_peak(tr) <= 0.03


def test_analytic_within_3_percent_of_trace_llama_3b_liger():
    spec = TrainingSpec(model="llama-3.2-3b", micro_batch=4, seq_len=2048, liger=True)
    a, tr = analytic(spec), trace_estimate(spec)
    assert abs(a.peak.allocated_bytes - tr.peak.allocated_bytes) <= 0.03 * tr.peak.allocated_bytes
    assert a.peak.phase == tr.peak.phase == "forward"


def test_training_args_use_liger_kernel_equals_the_flag():
    from transformers import TrainingArguments

    args = json.loads(TrainingArguments(output_dir="/tmp/hm-liger", use_liger_kernel=True,
                                        report_to=[]).to_json_string())
    off = {**args, "use_liger_kernel": False}
    via_file = spec_from_cli(model="tiny-llama", training_args=args)
    via_flag = spec_from_cli(model="tiny-llama", training_args=off, liger=True)
    assert via_file.liger and via_file == via_flag
    # TRL's SFTConfig subclasses TrainingArguments (trl/trainer/sft_config.py): its JSON carries
    # the same field, next to SFT-only ones the reader leaves alone
    sft = {"use_liger_kernel": True, "liger_kernel_config": {"rope": True}, "max_length": 1024,
           "packing": False, "per_device_train_batch_size": 2}
    spec = spec_from_cli(model="tiny-llama", training_args=sft, seq_len=64)
    assert spec.liger and analytic(spec).peak == analytic(spec.with_(liger=True)).peak


@pytest.mark.parametrize("kw, field", [
    (dict(liger=True, chunked_ce=4), "loss"),  # one loss replacement (hybridmem.techniques)
    (dict(chunked_ce=-1), "chunked_ce"),
    (dict(liger=True, train="lora", lora=LoraSpec(targets=("q_proj", "lm_head"))), "liger"),
    (dict(liger=True, train="lora", lora=LoraSpec(modules_to_save=("lm_head",))), "liger"),
])
def test_clashes_are_one_line_spec_errors(kw, field):
    with pytest.raises(SpecError) as err:
        tiny(**kw)
    assert err.value.field == field and "\n" not in str(err.value)


def test_liger_config_other_than_the_defaults_is_refused():
    with pytest.raises(SpecError, match="liger_kernel_config.swiglu"):
        spec_from_cli(model="tiny-llama", training_args={
            "use_liger_kernel": True, "liger_kernel_config": {"swiglu": False}})


def test_model_type_liger_skips_trains_unchanged_with_a_note(tmp_path):
    # llava_next is not in Liger's MODEL_TYPE_TO_APPLY_LIGER_FN: Trainer trains it unchanged
    spec = TrainingSpec(model="tiny-llava-next", micro_batch=1, seq_len=256, precision="bf16")
    on = analytic(spec.with_(liger=True))
    assert on.peak == analytic(spec).peak
    assert any("no Liger kernels" in n for n in on.notes)


def test_model_type_liger_patches_but_not_priced_is_refused():
    from hybridmem.families import target
    from hybridmem.techniques.liger import liger_text_type

    with pytest.raises(SpecError, match="gemma2"):
        liger_text_type(target("gemma2"))
    assert liger_text_type(target("llava", "qwen2")) == "qwen2"  # LLaVA: its LM's kernels
    assert liger_text_type(target("gpt2")) is None  # a type Liger skips trains unchanged


def test_cli_clash_exits_2(capsys):
    from hybridmem.cli import main

    code = main(["predict", "--model", "tiny-llama", "--liger", "--chunked-ce", "4",
                 "--method", "analytic"])
    err = capsys.readouterr().err
    assert code == 2 and "--chunked-ce" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_harness_cpu_stand_in_runs_the_emulation():
    from hybridmem.harness import workload

    spec = tiny(liger=True, precision="fp32")
    saved = __import__("transformers.models.llama.modeling_llama",
                       fromlist=["x"]).apply_rotary_pos_emb
    try:
        job = workload.prepare(spec, load_config(spec.model), torch.device("cpu"))
        out = job.model(**job.batch)
        out.loss.backward()
        assert out.logits is None
        assert job.model.model.norm.forward.__func__ is L.rms_norm_forward
    finally:
        import transformers.models.llama.modeling_llama as m
        m.apply_rotary_pos_emb = saved


def test_real_liger_missing_is_one_line():
    pytest.importorskip("torch")
    try:
        import liger_kernel  # noqa: F401
        pytest.skip("liger-kernel installed")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="pip install liger-kernel"):
        L.apply_real(torch.nn.Linear(1, 1))
