"""The decoder LLM families with closed forms (docs/families.md): one record each.

`text_defaults` are the defaults of the transformers 5.x config class (`configuration_<family>.py`)
for the fields the light parser reads (`models/light.py`; tests/test_models.py checks the
result against models built from the real transformers configs). `traits` are the switches
the one decoder code path reads: the layer graph (`model.py`) and the closed forms (`acts.py`)
of the layers every decoder family and every VLM's language model are built from; the presets
are in `presets/`. A new decoder family with Llama-like layers is one record here plus its
tests; one whose layers differ is its own folder that brings them (`Family.lm_layers`).
"""

from __future__ import annotations

from hybridmem.families import (
    DECODER, FUSED, GEMMA, MOE, NO_SDPA, QK_NORM, QKV_BIAS, SLIDING, Family,
)


def layer_kinds() -> dict:
    """The decoder's layers (`acts.py`)."""
    from hybridmem.families.common import decoder_acts as TA
    from hybridmem.families.common.decoder_graph import DecoderDims, DecoderLayerDims, LmHeadDims
    from hybridmem.families import LayerKind

    return {"embedding": LayerKind(TA.embedding, dims=DecoderDims),
            "rotary": LayerKind(TA.rotary, dims=DecoderDims),
            "decoder_layer": LayerKind(TA.decoder_layer, checkpointed=True, linear=True,
                                       dims=DecoderLayerDims),
            "rmsnorm": LayerKind(TA.rmsnorm, dims=DecoderDims),
            "lm_head": LayerKind(TA.lm_head, linear=True, dims=LmHeadDims)}


def gemma3_layer_types(tc) -> list[str]:
    """configuration_gemma3.Gemma3TextConfig: sliding unless (i + 1) % sliding_window_pattern
    == 0, pattern 6."""
    pattern = getattr(tc, "sliding_window_pattern", None) or 6
    return ["sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(tc.num_hidden_layers)]


def mixtral_experts(tc) -> dict:
    """`num_local_experts`, `intermediate_size` (configuration_mixtral.py); MixtralTopKRouter:
    softmax of an fp32 copy, always renormalised, fp32 weights."""
    return dict(experts=tc.num_local_experts, top_k=tc.num_experts_per_tok,
                ffn=tc.intermediate_size, router_copy=True, router_norm=True,
                router_fp32_weights=True)


def qwen3_moe_experts(tc) -> dict:
    """`num_experts`, `moe_intermediate_size` (configuration_qwen3_moe.py); Qwen3MoeTopKRouter:
    softmax(dtype=float), renormalised if `norm_topk_prob`, weights cast back."""
    return dict(experts=tc.num_experts, top_k=tc.num_experts_per_tok,
                ffn=tc.moe_intermediate_size, router_copy=False,
                # Qwen3VLMoeTextTopKRouter renormalises always (no norm_topk_prob test)
                router_norm=tc.model_type == "qwen3_vl_moe_text"
                or bool(getattr(tc, "norm_topk_prob", False)),
                router_fp32_weights=False)


def qwen3_moe_sparse(tc, i: int) -> bool:
    """Qwen3MoeDecoderLayer.__init__ (Qwen3VLMoeTextDecoderLayer alike): not in
    `mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0`."""
    return (i not in (getattr(tc, "mlp_only_layers", None) or []) and tc.num_experts > 0
            and (i + 1) % (getattr(tc, "decoder_sparse_step", 1) or 1) == 0)


FAMILIES = (
    Family("llama", DECODER, "modeling_llama.py", techniques=frozenset({"liger", "cce"}),
           text_defaults=dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                              num_hidden_layers=32, num_attention_heads=32,
                              num_key_value_heads=None, head_dim=None, hidden_act="silu",
                              attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
                              attention_dropout=0.0),
           layer_kinds=layer_kinds),
    Family("mistral", DECODER, "modeling_mistral.py", techniques=frozenset({"liger", "cce"}),
           text_defaults=dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                              head_dim=None, hidden_act="silu", tie_word_embeddings=False,
                              attention_dropout=0.0),
           layer_kinds=layer_kinds),
    Family("qwen2", DECODER, "modeling_qwen2.py", techniques=frozenset({"liger", "cce"}),
           traits=frozenset({QKV_BIAS}),
           # the Qwen2-VL / Qwen2.5-VL text models: the same attention (Qwen2VLAttention)
           sub_types=("qwen2_vl_text", "qwen2_5_vl_text"),
           text_defaults=dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                              num_hidden_layers=32, num_attention_heads=32,
                              num_key_value_heads=None, hidden_act="silu",
                              tie_word_embeddings=False, attention_dropout=0.0),
           layer_kinds=layer_kinds),
    Family("qwen3", DECODER, "modeling_qwen3.py", traits=frozenset({QK_NORM}),
           sub_types=("qwen3_vl_text",),  # Qwen3-VL's text model (modeling_qwen3_vl q/k norm)
           text_defaults=dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                              head_dim=128, hidden_act="silu", attention_bias=False,
                              tie_word_embeddings=False, attention_dropout=0.0),
           layer_kinds=layer_kinds),
    Family("phi3", DECODER, "modeling_phi3.py", traits=frozenset({FUSED}),
           text_defaults=dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                              num_hidden_layers=32, num_attention_heads=32,
                              num_key_value_heads=None, head_dim=None, hidden_act="silu",
                              tie_word_embeddings=False, attention_dropout=0.0, resid_pdrop=0.0,
                              embd_pdrop=0.0, partial_rotary_factor=1.0, sliding_window=None),
           layer_kinds=layer_kinds),
    Family("gemma2", DECODER, "modeling_gemma2.py", traits=frozenset({GEMMA, NO_SDPA}),
           text_defaults=dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                              num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                              head_dim=256, hidden_activation="gelu_pytorch_tanh",
                              attention_bias=False, tie_word_embeddings=True, attention_dropout=0.0,
                              final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
           layer_kinds=layer_kinds),
    Family("gemma3_text", DECODER, "modeling_gemma3.py",
           traits=frozenset({QK_NORM, GEMMA, SLIDING}), default_layer_types=gemma3_layer_types,
           text_defaults=dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216,
                              num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                              head_dim=256, hidden_activation="gelu_pytorch_tanh",
                              attention_bias=False, tie_word_embeddings=True, attention_dropout=0.0,
                              final_logit_softcapping=None, attn_logit_softcapping=None,
                              sliding_window=4096, layer_types=None, sliding_window_pattern=6),
           layer_kinds=layer_kinds),
    Family("mixtral", DECODER, "modeling_mixtral.py", traits=frozenset({MOE}),
           experts=mixtral_experts,
           text_defaults=dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                              head_dim=None, hidden_act="silu", tie_word_embeddings=False,
                              attention_dropout=0.0, num_experts_per_tok=2, num_local_experts=8,
                              output_router_logits=False, router_jitter_noise=0.0),
           layer_kinds=layer_kinds),
    Family("qwen3_moe", DECODER, "modeling_qwen3_moe.py", traits=frozenset({QK_NORM, MOE}),
           sub_types=("qwen3_vl_moe_text",),  # Qwen3-VL-MoE's (modeling_qwen3_vl_moe)
           experts=qwen3_moe_experts, sparse_layer=qwen3_moe_sparse,
           text_defaults=dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                              num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=4,
                              head_dim=None, hidden_act="silu", attention_bias=False,
                              tie_word_embeddings=False, attention_dropout=0.0,
                              decoder_sparse_step=1, moe_intermediate_size=768,
                              num_experts_per_tok=8, num_experts=128, norm_topk_prob=False,
                              output_router_logits=False, mlp_only_layers=None),
           layer_kinds=layer_kinds),
)
