"""Quantised base weights (`--quantize`, hybridmem/techniques/quantize.py): hand-derived weight bytes,
the trace tier's bitsandbytes emulation against a real CPU run of real `bnb.nn.Linear4bit`
layers, analytic vs trace, clashes and the BitsAndBytesConfig readers."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from hybridmem.analytic.estimate import timeline
from hybridmem.analytic.timeline import peak
from hybridmem.errors import SpecError
from hybridmem.techniques.quantize import from_bnb_config
from hybridmem.models import build_graph, load_config
from hybridmem.intake.resolve import spec_from_cli
from hybridmem.job.spec import TrainingSpec


def r512(n: int) -> int:
    return -(-n // 512) * 512


def _param_bytes(spec: TrainingSpec) -> int:
    _, _, points = timeline(spec, 0)
    return peak(points).bytes["param"]


def test_llama_3b_nf4_double_quant_weight_bytes_by_hand():
    # Llama-3.2-3B (preset config: hidden 3072, intermediate 8192, 28 layers, 24 heads, 8 kv
    # heads, head_dim 128): per layer q, o (3072 x 3072), k, v (1024 x 3072), gate, up
    # (8192 x 3072), down (3072 x 8192); lm_head tied (not quantised). Per weight of n
    # elements with NF4 + double quant (bitsandbytes functional.quantize_4bit): packed uint8
    # n/2, absmax uint8 n/64, offset fp32 0-dim, nested absmax fp32 per 256 blocks, the
    # 256-entry fp32 dynamic map copy, the 16-entry fp32 NF4 code: each its own 512 B block.
    shapes = [(3072, 3072)] * 2 + [(1024, 3072)] * 2 + [(8192, 3072)] * 2 + [(3072, 8192)]
    quant = 0
    numel = 0
    for o, i in shapes:
        n = o * i
        blocks = n // 64
        quant += (r512(n // 2) + r512(blocks) + r512(4) + r512(4 * -(-blocks // 256))
                  + r512(4 * 256) + r512(4 * 16))
        numel += n
    quant, numel = 28 * quant, 28 * numel
    assert numel == 28 * 100_663_296
    # about 0.5 byte per parameter + 1/64 for the absmax (QLoRA paper, arXiv 2305.14314 §3)
    assert 0.515 < quant / numel < 0.517
    base = TrainingSpec(model="llama-3.2-3b", train="lora", precision="fp32", seq_len=256)
    # everything unquantised in fp32 (what prepare_model_for_kbit_training leaves of a bf16 load)
    expected = _param_bytes(base) - 4 * numel + quant
    got = _param_bytes(base.with_(precision="bf16", quantize="nf4"))
    assert got == expected
    # without kbit prep the unquantised params stay bf16: less by half of their fp32 bytes
    assert _param_bytes(base.with_(precision="bf16", quantize="nf4", kbit_prep=False)) < got


def test_int8_weight_bytes_by_hand():
    # LLM.int8 (bnb Int8Params._quantize): CB int8 (out x in) + SCB fp32 (out,) per weight
    base = TrainingSpec(model="tiny-llama", train="lora", precision="fp32", seq_len=64)
    graph = build_graph(base)
    ws = [p.shape for m, l in graph.layers() for p in l.params
          if l.kind == "decoder_layer" and len(p.shape) == 2]
    expected = _param_bytes(base) - sum(r512(4 * o * i) for o, i in ws) \
        + sum(r512(o * i) + r512(4 * o) for o, i in ws)
    assert _param_bytes(base.with_(quantize="int8")) == expected


def test_bits_per_weight_match_the_weight_itemsizes():
    """`quantize.BITS` (a learned feature) against what the tiers price per weight element:
    int8 keeps one byte (CB), the 4-bit methods pack two elements per byte."""
    from hybridmem.techniques.quantize import BITS, QUANTIZE, quant_of

    assert set(BITS) == set(QUANTIZE) and BITS["none"] == 0
    spec = TrainingSpec(model="tiny-llama", train="lora", precision="bf16", seq_len=64)
    for method in QUANTIZE[1:]:
        weight = quant_of(spec.with_(quantize=method)).weight_allocs(64, 64)[0]
        assert weight.itemsize * 8 // (2 if method != "int8" else 1) == BITS[method]


def _real_bnb_trace(spec, monkeypatch):
    """The trace runner on real CPU tensors with real bitsandbytes layers (the harness's
    `quantize_bnb`), as the oracle of the meta emulation."""
    from hybridmem.harness.workload import quantize_bnb
    from hybridmem.trace import quantized, runner
    from hybridmem.trace.result import summarize

    def real(model, quant, dtype):
        with torch.no_grad():  # no_init_weights leaves garbage; bnb's CPU kernels need finite
            for p in model.parameters():
                p.normal_(0, 0.02)
        return quantize_bnb(model, spec.with_(kbit_prep=False), "cpu")

    monkeypatch.setattr(quantized, "replace_linears", real)
    # peft's bnb LoRA asks `torch.is_autocast_enabled()` (CUDA's) - on a CUDA run it is the
    # autocast region's; on CPU ask for CPU autocast, the one that runs here
    iae = torch.is_autocast_enabled
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a: iae(*a) if a else iae("cpu"))
    tracker, job = runner.trace(spec, load_config(spec.model), backend="real")
    return summarize(tracker, job), len(tracker.events)


@pytest.mark.parametrize("quantize,precision,ckpt", [
    ("nf4", "bf16", False), ("nf4", "bf16", True), ("fp4", "bf16", False),
    ("nf4", "bf16-mixed", False)])
def test_trace_emulation_equals_real_bitsandbytes_cpu_run(quantize, precision, ckpt,
                                                          monkeypatch):
    pytest.importorskip("bitsandbytes")
    from hybridmem.trace import runner
    from hybridmem.trace.result import summarize

    warnings.filterwarnings("ignore")
    spec = TrainingSpec(model="tiny-llama", train="lora", quantize=quantize, precision=precision,
                        micro_batch=2, seq_len=64, grad_ckpt=ckpt)
    tracker, job = runner.trace(spec, load_config(spec.model), backend="meta")
    emu, emu_events = summarize(tracker, job), len(tracker.events)
    real, real_events = _real_bnb_trace(spec, monkeypatch)
    assert (emu.peak_allocated, emu.breakdown["param"]) == \
        (real.peak_allocated, real.breakdown["param"])
    import bitsandbytes

    if bitsandbytes.__version__.startswith("0.48."):
        # every allocation too, on the release the emulation was read from; later CPU backends
        # (0.50: more small transients inside the CPU dequantise kernel, same peak) differ there
        assert emu_events == real_events


@pytest.mark.parametrize("model,quantize,precision,ckpt,seq", [
    ("tiny-llama", "nf4", "bf16", True, 256), ("tiny-llama", "nf4", "bf16-mixed", False, 256),
    ("tiny-llama", "int8", "bf16", True, 256), ("tiny-llava", "nf4", "bf16", True, 128),
    ("llama-3.2-3b", "nf4", "bf16", True, 512),
    ("tiny-phi3", "nf4", "bf16", True, 256)])  # fused qkv_proj / gate_up_proj quantised
def test_analytic_close_to_trace(model, quantize, precision, ckpt, seq):
    from hybridmem.trace import run_trace

    spec = TrainingSpec(model=model, train="lora", quantize=quantize, precision=precision,
                        micro_batch=2, seq_len=seq, grad_ckpt=ckpt)
    traced = run_trace(spec, workspace=0)
    _, _, points = timeline(spec, 0)
    analytic = peak(points).allocated
    # 4-bit SwiGLU: within 3 % (this tree: -0.1 % to +0.4 %). Known gaps (docs/quantize.md),
    # bounded so a regression shows: tiny-phi3 +8.1 % (fused gate_up_proj: its MLP backward is
    # not staged like the SwiGLU one), int8 +8.4 % (MatMul8bitLt keeps its input in ctx: the
    # 4-bit MLP-backward stages do not apply)
    tol = 0.10 if model == "tiny-phi3" or quantize == "int8" else 0.03
    assert abs(analytic / traced.peak_allocated - 1) < tol
    assert peak(points).bytes["param"] == traced.breakdown["param"]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-llava", "tiny-qwen3"])
def test_qlora_tiny_tensor_peak_within_3_percent_of_trace(model):
    # QLoRA (nf4 LoRA b2 s64), bf16 / bf16-mixed x checkpointing: the analytic tensor peak
    # (no cuBLAS workspaces) within 3 % of the trace tier (the oracle: equal to a real CPU run
    # of bnb's layers, test_trace_emulation_equals_real_bitsandbytes_cpu_run). On these sizes
    # the activations set the peak, so this checks the order of MatMul4Bit's temporaries, the
    # MLP backward's two stages and the recompute (docs/quantize.md): before, tiny-llama was
    # +3.4 % / +13.9 % / +2.3 % / +9.7 % (bf16, bf16 ckpt, bf16-mixed, bf16-mixed ckpt).
    from hybridmem.trace import run_trace

    for precision in ("bf16", "bf16-mixed"):
        for ckpt in (False, True):
            spec = TrainingSpec(model=model, train="lora", quantize="nf4", precision=precision,
                                micro_batch=2, seq_len=64, grad_ckpt=ckpt)
            traced = run_trace(spec, workspace=0).peak_allocated
            _, _, points = timeline(spec, 0)
            rel = peak(points).allocated / traced - 1
            assert abs(rel) < 0.03, (precision, ckpt, rel)


# real-sized QLoRA (LoRA nf4 bf16 checkpointed) configs the docs quote: docs/quantize.md's
# llama-3.2-3b b4 s1024, 10.25 GiB allocated in both tiers (trace ~25 s), and README's squeeze
# table QLoRA row, llava-1.5-7b b4 s2048: trace 11.98 GiB, the analytic tier was 12.63 (+5.4 %)
# before the MLP-backward staging and the recompute's input (docs/quantize.md); the tiny-model
# fixes must keep both within 0.5 %
@pytest.mark.slow
@pytest.mark.parametrize("model, micro_batch, seq_len, gib", [
    ("llama-3.2-3b", 4, 1024, 10.25), ("llava-1.5-7b", 4, 2048, None)])
def test_real_sized_qlora_doc_configs_close_to_trace(model, micro_batch, seq_len, gib):
    from hybridmem.analytic import estimate as analytic
    from hybridmem.trace import estimate as traced

    spec = TrainingSpec(model=model, train="lora", quantize="nf4", precision="bf16",
                        micro_batch=micro_batch, seq_len=seq_len, grad_ckpt=True)
    a, tr = analytic(spec).peak.allocated_bytes, traced(spec).peak.allocated_bytes
    assert abs(a / tr - 1) < 0.005
    if gib is not None:
        assert round(a / 2**30, 2) == round(tr / 2**30, 2) == gib


def test_dequantised_weight_is_a_forward_temporary():
    # MatMul4Bit dequantises the full weight (quant_state.dtype = the bf16 load dtype) in the
    # forward: the largest layer transient is at least gate_proj's bf16 weight (ffn x hidden)
    from hybridmem.analytic.estimate import price

    spec = TrainingSpec(model="llama-3.2-3b", train="lora", quantize="nf4", precision="bf16",
                        micro_batch=1, seq_len=16)
    layer = next(p for p in price(build_graph(spec), spec) if p.layer.kind == "decoder_layer")
    assert layer.step.acts.fwd_extra >= 2 * 8192 * 3072
    # and no autocast copy of a quantised weight is saved under bf16-mixed
    mixed = spec.with_(precision="bf16-mixed")
    plain = TrainingSpec(model="llama-3.2-3b", train="lora", precision="bf16-mixed",
                         micro_batch=1, seq_len=16)
    acts = [next(p for p in price(build_graph(s), s) if p.layer.kind == "decoder_layer")
            .step.acts.saved for s in (mixed, plain)]
    assert acts[0] < acts[1]


@pytest.mark.parametrize("train,model", [("full", "tiny-llama"), ("llm+projector", "tiny-llava")])
def test_quantised_base_refuses_training_the_base(train, model):
    with pytest.raises(SpecError) as err:
        TrainingSpec(model=model, train=train, quantize="nf4")
    assert "quantize='nf4'" in str(err.value) and f"train={train!r}" in str(err.value)


def test_cli_clash_exits_2():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "hybridmem.cli", "predict", "--model",
                           "tiny-llama", "--quantize", "nf4", "--method", "analytic"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "quantize='nf4'" in proc.stderr and "train='full'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bnb_config_file_and_model_config(tmp_path):
    qc = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
          "bnb_4bit_compute_dtype": "bfloat16", "llm_int8_skip_modules": ["lm_head", "mlp.down_proj"]}
    f = tmp_path / "bnb.json"
    f.write_text(json.dumps(qc))
    spec = spec_from_cli(model="tiny-llama", train="lora", quantization_config=str(f))
    assert (spec.quantize, spec.quant_double_quant, spec.quant_compute_dtype, spec.quant_skip) \
        == ("nf4", True, "bfloat16", ("lm_head", "mlp.down_proj"))
    # skipped down_proj keeps its own weights: fewer quantised names per layer
    layer = next(l for _, l in build_graph(spec).layers() if l.kind == "decoder_layer")
    assert "mlp.down_proj.weight" not in layer.quantized and len(layer.quantized) == 6
    # a pre-quantised checkpoint's config.json carries it (BitsAndBytesConfig.to_dict spelling)
    cfg = json.loads(json.dumps(load_config("tiny-llama").to_dict()))
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "_load_in_8bit": True,
                                  "_load_in_4bit": False}
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    spec = spec_from_cli(model=str(tmp_path / "m"), train="lora")
    assert spec.quantize == "int8"
    # BitsAndBytesConfig's own defaults for a file without the 4-bit keys: fp4, no double quant
    assert from_bnb_config({"load_in_4bit": True})["quantize"] == "fp4"
    assert from_bnb_config({"load_in_4bit": True})["quant_double_quant"] is False


@pytest.mark.parametrize("qc,field", [
    ({"load_in_4bit": True, "load_in_8bit": True}, "quantization_config.load_in_8bit"),
    ({"quant_method": "gptq", "bits": 4}, "quantization_config.quant_method"),
    ({"load_in_4bit": False}, "quantization_config.load_in_4bit"),
])
def test_bnb_config_errors(qc, field):
    with pytest.raises(SpecError) as err:
        from_bnb_config(qc)
    assert err.value.field == field


def test_spec_hash_stable_and_round_trip():
    plain = TrainingSpec(model="tiny-llama", train="lora")
    assert "quantize" not in plain.to_dict() and "kbit_prep" not in plain.to_dict()
    q = plain.with_(quantize="nf4", quant_skip=("lm_head",))
    assert TrainingSpec.from_dict(json.loads(json.dumps(q.to_dict()))) == q


def test_harness_quantize_bnb_on_cpu():
    # the CUDA harness's real bitsandbytes build, run on CPU (bnb 0.48 has a CPU backend)
    bnb = pytest.importorskip("bitsandbytes")
    from hybridmem.harness.workload import build_model, quantize_bnb

    spec = TrainingSpec(model="tiny-llama", train="lora", quantize="nf4", precision="bf16",
                        seq_len=64)
    model = build_model(spec, load_config(spec.model), torch.device("cpu"))
    n_layers = load_config(spec.model).num_hidden_layers
    assert quantize_bnb(model, spec, "cpu") == 7 * n_layers  # q k v o gate up down
    assert type(model.lm_head) is torch.nn.Linear  # get_keys_to_not_convert: output embeddings
    assert isinstance(model.model.layers[0].mlp.up_proj, bnb.nn.Linear4bit)
    assert model.model.norm.weight.dtype == torch.float32  # kbit prep's fp32 cast
