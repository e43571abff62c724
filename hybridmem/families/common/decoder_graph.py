"""Decoder LLMs (Llama, Mistral, Qwen2, Qwen3, ...) as layers, following transformers 5.x
`modeling_<family>.py` parameter by parameter; one code path, per-family switches read from the
config (`qk_norm`, ...; docs/families.md).

Differences that change memory: grouped-query attention (`num_key_value_heads`), an explicit
`head_dim` (may differ from hidden/heads), Qwen2's q/k/v biases (hard-coded `bias=True`, o_proj
without), Llama's optional `attention_bias` / `mlp_bias`, tied input/output embeddings, Qwen3's
RMSNorm over head_dim on q and k (`Qwen3Attention.q_norm` / `k_norm`), Phi-3's fused
projections, Gemma's four norms per layer, scaled embedding and logit softcapping.
"""

from __future__ import annotations

from typing import TypedDict

from hybridmem.families import (
    FUSED, GEMMA, MOE, QK_NORM, QKV_BIAS, SLIDING, text_family, with_trait,
)
from hybridmem.models.graph import Layer, ParamTensor as T, linear as _linear

FP32 = 4
# Per-family switches (`Family.traits`, hybridmem/families/decoders/), as model_type tuples.
# Qwen2 and the Qwen2-VL / Qwen2.5-VL text models (Qwen2VLAttention: the same q/k/v biases)
QWEN2_TEXT = with_trait(QKV_BIAS)


def head_dim(tc) -> int:
    """`head_dim` from the config, else hidden / heads (as the attention modules compute it)."""
    return getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads


def kv_heads(tc) -> int:
    return getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads


# families whose attention RMS-normalises q and k over head_dim before RoPE
# (modeling_qwen3.Qwen3Attention.q_norm / k_norm)
QK_NORM_TYPES = with_trait(QK_NORM)  # Gemma 3: (1 + weight) norms
# families with one fused q/k/v projection and one fused gate/up projection, whose q, k, v and
# gate, up are views (slices / `chunk`) of the fused output (modeling_phi3.Phi3Attention, Phi3MLP)
FUSED_TYPES = with_trait(FUSED)
# Gemma 2 / Gemma 3 text: four RMSNorms per layer (post-attention on the attention output,
# pre/post feed-forward), `(1 + weight)` RMSNorms in fp32, the embedding scaled by sqrt(hidden)
# (modeling_gemma2.Gemma2DecoderLayer, Gemma2RMSNorm, Gemma2TextScaledWordEmbedding)
GEMMA_TYPES = with_trait(GEMMA)
# mixture-of-experts families: a router (`mlp.gate.weight`, E x h) and every expert's fused
# weights as 3-D parameters (`mlp.experts.gate_up_proj` E x 2f x h, `mlp.experts.down_proj`
# E x h x f; modeling_mixtral.MixtralExperts / MixtralTopKRouter, modeling_qwen3_moe likewise)
MOE_TYPES = with_trait(MOE)
# families with local (sliding) and global layers, a RoPE table per type (Gemma3RotaryEmbedding)
SLIDING_TYPES = with_trait(SLIDING)


def qk_norm(tc) -> bool:
    """Whether the attention has `q_norm` / `k_norm` (RMSNorm(head_dim)) weights."""
    return tc.model_type in QK_NORM_TYPES


def layer_types(tc) -> list[str]:
    """Per-layer attention types: `layer_types` from the config, else the family's default
    (`Family.default_layer_types`: Gemma 3's pattern); one type for the other families."""
    types = getattr(tc, "layer_types", None)
    if types:
        return list(types)
    fam = text_family(tc.model_type)
    if fam is not None and fam.default_layer_types is not None:
        return fam.default_layer_types(tc)
    return ["full_attention"] * tc.num_hidden_layers


def rope_tables(tc) -> tuple[str, ...]:
    """Layer types with their own RoPE table (Gemma3RotaryEmbedding: `{type}_inv_freq` per
    type present, a local and a global base; one unnamed table elsewhere)."""
    return tuple(sorted(set(layer_types(tc)))) if tc.model_type in SLIDING_TYPES else ("",)


def gemma(tc) -> bool:
    """Whether the layers are Gemma's (four `(1 + weight)` norms, a scaled embedding)."""
    return tc.model_type in GEMMA_TYPES


def softcaps(tc) -> tuple[float | None, float | None]:
    """(attention-logit, final-logit) softcapping (`tanh(x / cap) * cap`; Gemma 2's
    `attn_logit_softcapping` / `final_logit_softcapping`, None = off)."""
    return (getattr(tc, "attn_logit_softcapping", None),
            getattr(tc, "final_logit_softcapping", None))


def activation(tc) -> str:
    """The MLP activation's name (Gemma calls the field `hidden_activation`)."""
    return getattr(tc, "hidden_activation", None) or tc.hidden_act


def experts(tc) -> dict | None:
    """The family's experts' fields and router rules (`Family.experts`); None for a dense
    family."""
    fam = text_family(tc.model_type)
    return fam.experts(tc) if fam is not None and fam.experts is not None else None


def moe(tc) -> tuple[int, int, int]:
    """(experts, top_k, expert intermediate size); (0, 0, 0) for a dense family."""
    rules = experts(tc)
    return (0, 0, 0) if rules is None else (rules["experts"], rules["top_k"], rules["ffn"])


def moe_layer(tc, i: int) -> bool:
    """Whether layer `i` has the sparse MoE block (`Family.sparse_layer`, else every layer of
    a MoE family)."""
    if tc.model_type not in MOE_TYPES:
        return False
    fam = text_family(tc.model_type)
    return fam is None or fam.sparse_layer is None or fam.sparse_layer(tc, i)


def _biases(tc) -> tuple[bool, bool, bool]:
    """(q/k/v bias, o_proj bias, mlp bias) per family."""
    if tc.model_type in QWEN2_TEXT:
        return True, False, False  # modeling_qwen2.Qwen2Attention: bias=True on q/k/v only
    attn = bool(getattr(tc, "attention_bias", False))
    return attn, attn, bool(getattr(tc, "mlp_bias", False))


def fused(tc) -> bool:
    """Whether q/k/v and gate/up are one Linear each (`qkv_proj`, `gate_up_proj`)."""
    return tc.model_type in FUSED_TYPES


def rotary_dim(tc) -> int:
    """Rotated channels per head: head_dim x `partial_rotary_factor` (Phi-3 reads it from
    `rope_parameters`, filled from the top-level key; modeling_phi3
    `Phi3RotaryEmbedding.compute_default_rope_parameters`: `int(head_dim * factor)`)."""
    rope = getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(tc, "partial_rotary_factor", 1.0))
    return int(head_dim(tc) * (1.0 if factor is None else factor))


def decoder_layer_params(tc, sparse: bool = False) -> tuple[T, ...]:
    h, f, d = tc.hidden_size, tc.intermediate_size, head_dim(tc)
    q, kv = tc.num_attention_heads * d, kv_heads(tc) * d
    qkv_b, o_b, mlp_b = _biases(tc)
    if fused(tc):  # modeling_phi3: Phi3Attention.qkv_proj, Phi3MLP.gate_up_proj (no biases)
        attn = _linear("self_attn.qkv_proj", q + 2 * kv, h, False)
        mlp = _linear("mlp.gate_up_proj", 2 * f, h, False)
    else:
        attn = (_linear("self_attn.q_proj", q, h, qkv_b) + _linear("self_attn.k_proj", kv, h, qkv_b)
                + _linear("self_attn.v_proj", kv, h, qkv_b))
        mlp = _linear("mlp.gate_proj", f, h, mlp_b) + _linear("mlp.up_proj", f, h, mlp_b)
    if sparse:
        n, _, fe = moe(tc)
        mlp = (T("mlp.gate.weight", (n, h)), T("mlp.experts.gate_up_proj", (n, 2 * fe, h)),
               T("mlp.experts.down_proj", (n, h, fe)))
    else:
        mlp = mlp + _linear("mlp.down_proj", h, f, mlp_b)
    return (attn + _linear("self_attn.o_proj", h, q, o_b) + mlp
            + ((T("self_attn.q_norm.weight", (d,)), T("self_attn.k_norm.weight", (d,)))
               if qk_norm(tc) else ())
            + (T("input_layernorm.weight", (h,)), T("post_attention_layernorm.weight", (h,)))
            + ((T("pre_feedforward_layernorm.weight", (h,)),
                T("post_feedforward_layernorm.weight", (h,))) if gemma(tc) else ()))


class DecoderShape(TypedDict):
    """What every decoder closed form reads (a Pixtral block priced as a decoder layer gives
    only these, `pixtral.acts.as_decoder`)."""

    b: int
    s: int
    h: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int


class DecoderDims(DecoderShape, total=False):
    """The decoder's dims (`decoder_dims`): the same dict for the embedding, the rotary tables,
    the layers, the final norm and the head; the traits the family's config sets."""

    vocab: int
    act: str
    attn_dropout: float
    qk_norm: bool
    fused: bool
    gemma: bool
    attn_softcap: bool
    final_softcap: bool
    moe: bool
    rope_tables: int
    mask_types: int
    sliding_masked: bool
    masked: bool
    """This layer's SDPA gets a materialised mask (a sliding layer past its window; Gemma 3 with
    images: every layer)."""
    image_masks: bool
    """Gemma 3 with images: both masks built (`gemma3.model.image_masks`)."""


class DecoderLayerDims(DecoderDims, total=False):
    """A decoder layer's: a sparse layer adds its experts and router rules (`moe_dims`,
    `Family.experts`)."""

    experts: int
    top_k: int
    router_copy: bool
    router_norm: bool
    router_fp32_weights: bool


class LmHeadDims(DecoderDims, total=False):
    """The head's: whether it is tied to the embedding (an objective's score head: vocab 1,
    untied)."""

    tied: bool


def decoder_dims(tc, batch: int, seq: int) -> DecoderDims:
    return dict(b=batch, s=seq, h=tc.hidden_size, heads=tc.num_attention_heads,
                kv_heads=kv_heads(tc), head_dim=head_dim(tc), ffn=tc.intermediate_size,
                vocab=tc.vocab_size, act=activation(tc),
                attn_dropout=float(getattr(tc, "attention_dropout", 0.0) or 0.0),
                qk_norm=qk_norm(tc), fused=fused(tc), gemma=gemma(tc),
                attn_softcap=bool(softcaps(tc)[0]), final_softcap=bool(softcaps(tc)[1]),
                moe=False, rope_tables=len(rope_tables(tc)),
                mask_types=len(set(layer_types(tc))),  # eager: a float mask per type (masking_utils)
                sliding_masked=_sliding_masked(tc, seq))


def _sliding_masked(tc, seq: int) -> bool:
    """Whether Gemma 3's sliding layers get a materialised mask under SDPA: masking_utils
    `sdpa_mask` skips it (is_causal) only while kv_length < the window
    (`_ignore_causal_mask_sdpa`, `local_attention_size`); full layers always skip it."""
    window = getattr(tc, "sliding_window", None)
    return (tc.model_type in SLIDING_TYPES and bool(window) and seq >= window
            and "sliding_attention" in layer_types(tc))


def moe_dims(tc, dims: DecoderDims) -> DecoderLayerDims:
    """A sparse layer's dims: experts, top_k, the experts' intermediate size as `ffn`, and
    the router's rules, as the family gives them (`Family.experts`)."""
    return dict(dims, moe=True, **experts(tc))


def language_model_layers(tc, batch: int, seq: int) -> tuple[Layer, ...]:
    """Layers of the base model (`model.*` in a CausalLM): embed_tokens, decoder layers, norm."""
    h = tc.hidden_size
    dims = decoder_dims(tc, batch, seq)
    rot = len(range(0, rotary_dim(tc), 2))  # inv_freq = 1 / base ** (arange(0, dim, 2) / dim)
    # Gemma2TextScaledWordEmbedding.embed_scale: a 0-dim non-persistent buffer (sqrt(hidden)),
    # `torch.tensor(embed_scale)` in the default dtype = the parameters' (itemsize None)
    scale = (T("embed_tokens.embed_scale", ()),) if gemma(tc) else ()
    layers = [Layer(name="embed_tokens", kind="embedding",
                    params=(T("embed_tokens.weight", (tc.vocab_size, h)),), buffers=scale,
                    dims=dims)]
    # forward order: LlamaModel.forward embeds, then computes cos/sin once, then runs the layers
    tables = [f"{ty}_" if ty else "" for ty in rope_tables(tc)]
    layers.append(Layer(name="rotary_emb", kind="rotary",
                        buffers=tuple(T(f"rotary_emb.{ty}{name}", (rot,), FP32) for ty in tables
                                      for name in ("inv_freq", "original_inv_freq")),
                        dims=dims))
    dense, sparse = decoder_layer_params(tc), None
    for i in range(tc.num_hidden_layers):
        if moe_layer(tc, i):
            sparse = sparse or decoder_layer_params(tc, sparse=True)
            layers.append(Layer(name=f"layers.{i}", kind="decoder_layer", params=sparse,
                                scope=f"layers.{i}", dims=moe_dims(tc, dims)))
        else:
            masked = dims["sliding_masked"] and layer_types(tc)[i] == "sliding_attention"
            layers.append(Layer(name=f"layers.{i}", kind="decoder_layer", params=dense,
                                scope=f"layers.{i}", dims=dict(dims, masked=masked)))
    layers.append(Layer(name="norm", kind="rmsnorm", params=(T("norm.weight", (h,)),), dims=dims))
    return tuple(layers)


def lm_head_layer(tc, batch: int, seq: int, tied: bool) -> Layer:
    """The output projection; tied to embed_tokens it owns no parameter (counted there)."""
    params = () if tied else (T("weight", (tc.vocab_size, tc.hidden_size)),)
    return Layer(name="lm_head", kind="lm_head", params=params,
                 dims=dict(decoder_dims(tc, batch, seq), tied=tied))
