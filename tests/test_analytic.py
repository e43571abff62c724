"""Analytic tier: each factor against a hand derivation on tiny configs, and timeline properties.

Tiny Llama (`tiny-llama` preset): hidden h=64, ffn f=128, 4 heads x head_dim 16 (q 64),
2 kv heads (k/v 32), 2 layers, vocab V=128, untied. Every tensor is rounded up to 512 B
(CUDACachingAllocator kMinBlockSize), so each number below is a sum of 512-multiples.

Parameter tensors (elements): embed 128x64=8192, q 64x64=4096, k 32x64=2048, v 2048,
o 4096, gate 128x64=8192, up 8192, down 64x128=8192, 2 RMSNorm weights 64, final norm 64,
lm_head 8192; buffers: rotary inv_freq + original_inv_freq, 8 fp32 each (512 B each).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmem import SpecError, TrainingSpec
from hybridmem.analytic import estimate
from hybridmem.families.common import decoder_acts as A
from hybridmem.analytic.estimate import context, price, timeline
from hybridmem.analytic.timeline import walk
from hybridmem.models import build_graph
from hybridmem.job.spec import ATTENTIONS, OPTIMIZERS, PRECISIONS, TRAINABLES

MiB = 1024**2

# fp32 bytes of one decoder layer's params: q 16384 + k 8192 + v 8192 + o 16384
# + gate/up/down 3 x 32768 + 2 norms x 512 (256 B rounded up) = 147456
LAYER_FP32 = 16384 + 8192 + 8192 + 16384 + 3 * 32768 + 2 * 512
# all parameters, fp32: embed 32768 + 2 layers + final norm 512 + lm_head 32768 = 360960
PARAMS_FP32 = 32768 + 2 * LAYER_FP32 + 512 + 32768
BUFFERS = 2 * 512  # two rotary buffers of 8 fp32 (32 B -> 512 B)
# bf16: q 8192 + k 4096 + v 4096 + o 8192 + 3 x 16384 + 2 x 512 = 74752 per layer;
# embed 16384 + 2 x 74752 + 512 + lm_head 16384 = 182784
PARAMS_BF16 = 16384 + 2 * (8192 + 4096 + 4096 + 8192 + 3 * 16384 + 2 * 512) + 512 + 16384
N_TENSORS = 1 + 2 * 9 + 1 + 1  # embed, 9 per layer, final norm, lm_head


def spec(**kw) -> TrainingSpec:
    base = dict(model="tiny-llama", micro_batch=2, seq_len=16, precision="fp32",
                optimizer="adamw", train="full")
    base.update(kw)
    return TrainingSpec(**base)


def at_optimizer(s: TrainingSpec) -> dict:
    """Whole-run totals: every param, every grad (all live at the step), all optimizer state."""
    priced = price(build_graph(s), s)
    return {"grad": sum(p.states.grad for p in priced),
            "optimizer": sum(p.states.optimizer for p in priced),
            "param": sum(p.states.param for p in priced)}


# --- parameters, gradients, optimizer state ---------------------------------------------------

def test_param_bytes_fp32_and_bf16():
    assert at_optimizer(spec())["param"] == PARAMS_FP32 + BUFFERS
    # rotary buffers are built in fp32 whatever the parameter dtype
    assert at_optimizer(spec(precision="bf16"))["param"] == PARAMS_BF16 + BUFFERS


def test_grad_bytes_follow_grad_dtype():
    assert at_optimizer(spec())["grad"] == PARAMS_FP32
    assert at_optimizer(spec(precision="bf16"))["grad"] == PARAMS_BF16
    assert at_optimizer(spec(precision="bf16-mixed"))["grad"] == PARAMS_FP32  # fp32 params


@pytest.mark.parametrize("optimizer, expected", [
    ("adamw", 2 * PARAMS_FP32),                       # exp_avg + exp_avg_sq, fp32
    ("adamw-fused", 2 * PARAMS_FP32 + 512 * N_TENSORS),  # + one device `step` per tensor
    ("sgd", 0),
    ("sgd-momentum", PARAMS_FP32),                    # momentum_buffer
    ("lion", PARAMS_FP32),                            # exp_avg
    # adafactor, 2-D (out, in): row_var out x 4 B + col_var in x 4 B, each rounded to 512:
    # every matrix here has out, in <= 128 -> 512 + 512; 1-D norms: variance 64 x 4 -> 512.
    # per layer 7 x 1024 + 2 x 512 = 8192; embed 1024 + norm 512 + lm_head 1024
    ("adafactor", 1024 + 2 * 8192 + 512 + 1024),
    # bitsandbytes 8-bit: n >= 4096 -> 2 x n uint8 + 2 absmax x ceil(n/256) fp32 (<= 512 B):
    # n=8192 -> 2x8192 + 2x512 = 17408; n=4096 -> 2x4096 + 2x512 = 9216; k/v (2048) and
    # norms (64) keep two fp32 states: 2 x 8192 and 2 x 512. Per layer: q 9216 + k 16384 +
    # v 16384 + o 9216 + 3 x 17408 + 2 x 1024 = 105472; + embed 17408 + final norm 1024 +
    # lm_head 17408 + the two shared 256-entry fp32 qmaps 2 x 1024.
    ("adamw-8bit", 2 * 105472 + 17408 + 1024 + 17408),
])
def test_optimizer_state_bytes(optimizer, expected):
    assert at_optimizer(spec(optimizer=optimizer))["optimizer"] == expected


def test_bitsandbytes_qmaps_are_counted_once():
    # two 256-entry fp32 maps (2 x 1024 B) shared by every 8-bit tensor, on top of per-tensor state
    s = spec(optimizer="adamw-8bit")
    _, _, points = timeline(s)
    step = next(p for p in points if p.phase == "optimizer")
    assert step.bytes["optimizer"] == 2 * 105472 + 17408 + 1024 + 17408 + 2 * 1024


def test_bf16_master_weights_state_and_fp32_grads_at_the_step():
    # bf16 params; fp32 master copy (= PARAMS_FP32), fp32 Adam state 2 x PARAMS_FP32, and at the
    # step fp32 grads for the masters (the bf16 grads are dropped): 4 x PARAMS_FP32 in all
    s = spec(precision="bf16-master", seq_len=8, micro_batch=1)
    pred = estimate(s)
    assert pred.peak.phase == "optimizer"
    assert pred.breakdown["optimizer"] == 4 * PARAMS_FP32
    assert pred.breakdown["grad"] == 0
    assert pred.breakdown["temporary"] == PARAMS_FP32  # foreach sqrt over fp32 exp_avg_sq


def test_foreach_adamw_temporary_is_one_state():
    s = spec(seq_len=8, micro_batch=1)
    pred = estimate(s)
    assert pred.peak.phase == "optimizer"
    assert pred.breakdown["temporary"] == PARAMS_FP32
    assert estimate(s.with_(optimizer="adamw-fused")).breakdown["temporary"] < PARAMS_FP32


def test_design_fact_pure_bf16_full_finetune_peaks_in_the_optimizer_step():
    # docs/design.md: pure-bf16 full fine-tune of LLaVA-1.5-7B shapes with foreach AdamW peaks in the
    # optimizer step at 2*P_all + 8*P_trainable bytes (params 2, grads 2, states 4, sqrt temp 2).
    # P_trainable excludes the last CLIP layer and post_layernorm (no grads with feature layer -2).
    s = TrainingSpec(model="llava-1.5-7b", micro_batch=1, seq_len=1024, precision="bf16",
                     train="full", grad_ckpt=True)
    pred = estimate(s)
    assert pred.peak.phase == "optimizer"
    # last ViT-L/14 layer: q/k/v/out 4 x (1024^2 + 1024) + fc1 (4096 x 1024 + 4096)
    # + fc2 (1024 x 4096 + 1024) + 2 LayerNorms x 2048 = 12,596,224; post_layernorm 2048
    last_clip = 12_596_224 + 2 * 1024
    # p_all: meta-device parameter count (docs/design.md, parameter counts; test_models.py)
    p_all, p_trained = 7_063_427_072, 7_063_427_072 - last_clip
    tensors = pred.peak.allocated_bytes - pred.breakdown["workspace"] - pred.breakdown["activation"]
    assert tensors == pytest.approx(2 * p_all + 8 * p_trained, rel=1e-3)


def test_lora_adapters_are_fp32_and_alone_trained():
    s = spec(train="lora", precision="bf16")
    priced = price(build_graph(s), s)
    # adapters r=8 on q,k,v,o,gate,up,down: A (8 x in) + B (out x 8), fp32, each >= 512 B:
    # q: 8x64 + 64x8 -> 2048 + 2048; k, v: 2048 + 1024(32x8x4) ; o like q;
    # gate/up: 8x64 + 128x8 -> 2048 + 4096; down: 8x128 + 64x8 -> 4096 + 2048
    per_layer = (2048 + 2048) * 2 + (2048 + 1024) * 2 + (2048 + 4096) * 2 + (4096 + 2048)
    assert sum(p.states.grad for p in priced) == 2 * per_layer
    assert sum(p.states.optimizer for p in priced) == 2 * 2 * per_layer  # fp32 Adam state


# --- activations --------------------------------------------------------------------------

def test_decoder_layer_activations_fp32_sdpa():
    # B = b*s = 32 tokens, fp32 (e = stream = 4), full training (input and weights need grads).
    # input RMSNorm: x 32x64x4 = 8192, rsqrt 32x4 -> 512, normalised 8192; q/k/v input 8192
    # attention (SDPA, fp32 -> mem-efficient kernel): q 8192, k 32x32x4 = 4096, v 4096,
    #   out 8192, logsumexp 2 x 4 heads x 32 rows (16 padded to 32) x 4 = 1024; o_proj reuses out
    # post-attention RMSNorm: 8192 + 512 + 8192; gate/up input 8192
    # MLP: gate out, SiLU out, up out 3 x 32x128x4 = 3 x 16384; down input 16384
    s = spec()
    layer = build_graph(s).module("language_model").layers[2]
    assert layer.kind == "decoder_layer"
    acts = A.decoder_layer(layer, context(s), need_in=True, need_w=True)
    assert acts.saved == (8192 + 512 + 8192 + 8192 + 8192 + 4096 + 4096 + 8192 + 1024
                          + 8192 + 512 + 8192 + 8192 + 3 * 16384 + 16384)
    assert acts.ckpt_saved == 8192  # checkpointed: only the layer input


def test_decoder_layer_frozen_weights_keep_only_what_input_grads_need():
    # LM frozen but on the backward path (train='projector'): no weight-grad inputs (n1, y1,
    # n2, y2, down input) -> 8192 + 512 + attention 25600 + 8192 + 512 + 3 x 16384
    s = spec()
    layer = build_graph(s).module("language_model").layers[2]
    acts = A.decoder_layer(layer, context(s), need_in=True, need_w=False)
    assert acts.saved == 8192 + 512 + (8192 + 4096 + 4096 + 8192 + 1024) + 8192 + 512 + 3 * 16384


def test_eager_attention_keeps_the_probabilities():
    # eager, fp32: q 8192, repeat_kv'd k and v 2 x 8192, fp32 softmax 2x4x16x16x4 = 8192
    # (no second copy in fp32), o_proj input copy 8192 -> instead of SDPA's 25600
    s = spec(attn="eager")
    layer = build_graph(s).module("language_model").layers[2]
    sdpa = A.decoder_layer(layer, context(spec()), True, True).saved
    eager = A.decoder_layer(layer, context(s), True, True).saved
    assert eager - sdpa == (8192 + 8192 + 8192 + 8192 + 8192) - (8192 + 4096 + 4096 + 8192 + 1024)


def test_loss_keeps_fp32_log_softmax_and_upcasts_logits():
    # lm_head (bf16): input 32x64x2 = 4096 (weight grad), log_softmax out 32x128x4 = 16384,
    # shift_labels 32x8 -> 512, nll output + total_weight 2 x 512.
    # forward transient: bf16 logits 8192 + fp32 upcast 16384;
    # backward, before the head's weight grad exists: nll grad + log_softmax grad, 2 x 16384
    # (> 16384 + 8192); then the head's matmuls: bf16 logits grad 8192 + input grad 4096
    s = spec(precision="bf16")
    head = build_graph(s).module("lm_head").layers[0]
    acts = A.lm_head(head, context(s), need_in=True, need_w=True)
    assert acts.saved == 4096 + 16384 + 512 + 2 * 512
    assert acts.fwd_extra == 8192 + 16384
    assert acts.bwd_mlp == 2 * 16384
    assert acts.bwd_extra == 8192 + 4096


def test_autocast_saves_bf16_copies_of_linear_inputs_and_weights():
    # bf16-mixed: stream fp32, matmuls bf16. Each of q/k/v casts the fp32 normed input
    # separately (3 x 32x64x2 = 3 x 4096) where pure fp32 saves it once (8192); the weight copies
    # (bf16) of all 7 linears are saved: (4096+2048+2048+4096+3x8192) x 2 -> 73728 B in 512s.
    s = spec(precision="bf16-mixed")
    layer = build_graph(s).module("language_model").layers[2]
    acts = A.decoder_layer(layer, context(s), True, True)
    weights = (4096 + 2048 + 2048 + 4096 + 3 * 8192) * 2
    assert acts.cache == weights
    assert acts.saved > weights


# --- the timeline -------------------------------------------------------------------------

def _points(s: TrainingSpec):
    from hybridmem.analytic.estimate import estimate as est

    return est(s).extras["analytic"]["phase_peaks"]


def test_optimizer_state_appears_from_the_second_iteration():
    s = spec(optimizer="adamw")
    peaks = _points(s)
    # iteration 1's forward carries the state (2 x params) and the second cuBLAS workspace
    assert peaks["forward@1"] - peaks["forward@0"] == 2 * PARAMS_FP32 + 32 * MiB
    assert peaks["backward@1"] - peaks["backward@0"] == 2 * PARAMS_FP32
    assert peaks["optimizer@1"] == peaks["optimizer@0"]  # state made lazily inside step 0


def test_no_grads_during_forward_zero_grad_set_to_none():
    s = spec()
    graph = build_graph(s)
    priced = price(graph, s)
    from hybridmem.analytic.timeline import Statics

    st = Statics(param=0, master=0, state=0, opt_temp=0, inputs=0, workspace_first=0,
                 workspace=0)
    points = walk([p.step for p in priced], st)
    assert all(p.bytes["grad"] == 0 for p in points if p.phase == "forward")
    assert max(p.bytes["grad"] for p in points if p.phase == "backward") == PARAMS_FP32


def test_peak_is_not_the_sum_of_category_maxima():
    s = spec(seq_len=128, micro_batch=4)
    _, _, points = timeline(s)
    pred = estimate(s)
    assert pred.peak.allocated_bytes == max(p.allocated for p in points)
    maxima = sum(max(p.bytes[c] for p in points) for c in points[0].bytes)
    # activations are freed before the step that holds the state and its temporaries
    assert pred.peak.allocated_bytes < maxima


def test_checkpointing_trades_activations_for_recompute():
    big = dict(model="tiny-llama", micro_batch=8, seq_len=256)
    plain = estimate(TrainingSpec(**big)).peak.allocated_bytes
    ckpt = estimate(TrainingSpec(**big, grad_ckpt=True)).peak.allocated_bytes
    assert ckpt < plain


def test_peak_grows_with_micro_batch():
    devs = [estimate(TrainingSpec(model="tiny-llava", micro_batch=b, seq_len=64)).peak.device_bytes
            for b in range(1, 7)]
    assert devs == sorted(devs) and devs[0] < devs[-1]


def test_breakdown_sums_to_device_bytes_with_sourced_overheads():
    pred = estimate(TrainingSpec(model="tiny-llava", seq_len=64))
    assert sum(pred.breakdown.values()) == pred.peak.device_bytes
    assert pred.breakdown["workspace"] == 2 * 32 * MiB  # two Hopper cuBLAS workspaces
    assert pred.breakdown["context"] == 512 * MiB
    assert pred.peak.allocated_bytes <= pred.peak.reserved_bytes <= pred.peak.device_bytes
    assert any("context" in n for n in pred.notes)


def test_modules_sum_to_totals():
    pred = estimate(TrainingSpec(model="llava-1.5-7b", micro_batch=2, seq_len=2048))
    assert [m.name for m in pred.modules] == ["vision_tower", "multi_modal_projector",
                                               "language_model", "lm_head"]
    # meta-device parameter count (docs/design.md, parameter counts; test_models.py)
    assert sum(m.params for m in pred.modules) == pred.params_total == 7_063_427_072


def test_frozen_vision_tower_keeps_no_activations():
    pred = estimate(TrainingSpec(model="tiny-llava", seq_len=64, train="llm+projector"))
    vt = next(m for m in pred.modules if m.name == "vision_tower")
    assert (vt.grad, vt.optimizer, vt.activation) == (0, 0, 0)


def test_flash_attention_needs_half_precision():
    with pytest.raises(SpecError, match=r"^attn='flash_attention_2'"):
        estimate(spec(attn="flash_attention_2"))


def test_projector_training_without_images_is_refused():
    with pytest.raises(SpecError, match=r"^train='projector'"):
        estimate(TrainingSpec(model="tiny-llava", seq_len=64, train="projector",
                              images_per_sample=0))


@pytest.mark.parametrize("preset", ["llava-1.5-7b", "llava-1.5-13b", "llava-v1.6-mistral-7b",
                                    "llama-3.2-3b", "qwen2-7b", "tiny-llava",
                                    "tiny-llava-siglip", "tiny-llama"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-mixed", "bf16-master"])
def test_every_preset_and_precision_gives_a_consistent_prediction(preset, precision):
    s = TrainingSpec(model=preset, micro_batch=1, seq_len=2048, precision=precision,
                     grad_ckpt=True)
    pred = estimate(s)
    assert pred.peak.device_bytes > pred.breakdown["param"] > 0
    assert pred.to_dict()["params"]["total"] == sum(m.params for m in pred.modules)


def test_lora_dropout_saves_a_bool_mask_and_its_own_output_per_adapter():
    # CUDA's fused native_dropout saves a bool mask (1 B/element); lora_A then saves the dropout
    # output, one per adapter, where without dropout (nn.Identity) fp32 adapters share the
    # layer's input. B = 32 tokens, fp32, adapters on all 7 linears, base frozen:
    # without dropout: q/k/v input 8192 once, gate/up input 8192 once, down input 16384 once
    # (o_proj reads SDPA's saved output) = 32768;
    # with dropout: masks 6 x 2048 (h inputs) + 4096 (down, 32x128) = 16384, outputs
    # 6 x 8192 + 16384 = 65536 -> 81920. Difference 49152.
    from hybridmem.job.spec import LoraSpec

    plain = spec(train="lora")
    drop = spec(train="lora", lora=LoraSpec(dropout=0.1))
    layer = build_graph(plain).module("language_model").layers[2]
    a = A.decoder_layer(layer, context(plain), need_in=True, need_w=False).saved
    b = A.decoder_layer(layer, context(drop), need_in=True, need_w=False).saved
    assert b - a == 49152


@settings(max_examples=40, deadline=None)
@given(model=st.sampled_from(["tiny-llava", "tiny-llama", "tiny-llava-siglip", "tiny-llava-next"]),
       precision=st.sampled_from(PRECISIONS), optimizer=st.sampled_from(OPTIMIZERS),
       train=st.sampled_from(TRAINABLES), ckpt=st.booleans(), attn=st.sampled_from(ATTENTIONS),
       batch=st.integers(1, 4), seq=st.sampled_from([96, 128, 300]))
def test_invariants_hold_for_any_valid_spec(model, precision, optimizer, train, ckpt, attn,
                                            batch, seq):
    try:
        s = TrainingSpec(model=model, precision=precision, optimizer=optimizer, train=train,
                         grad_ckpt=ckpt, attn=attn, micro_batch=batch, seq_len=seq)
        pred = estimate(s)
    except SpecError:
        return  # e.g. a projector on a decoder-only model, FlashAttention-2 in fp32
    assert sum(pred.breakdown.values()) == pred.peak.device_bytes
    assert pred.peak.allocated_bytes <= pred.peak.reserved_bytes <= pred.peak.device_bytes
    assert pred.peak.allocated_bytes == max(pred.extras["analytic"]["phase_peaks"].values())
    assert sum(m.params for m in pred.modules) == pred.params_total
    assert 0 < pred.params_trainable <= pred.params_total
    bigger = estimate(s.with_(micro_batch=batch + 1))
    assert bigger.peak.device_bytes >= pred.peak.device_bytes  # find-max-batch bisects on this
