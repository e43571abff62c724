"""OLMo 2's language model as layers (transformers 5.24 `modeling_olmo2.py`): the shared
decoder graph (`common/decoder_graph.py`: embed_tokens, rotary_emb, layers, norm) with OLMo 2's
decoder layer parameters and its closed forms named on the layers (`Layer.formula`).

`Olmo2DecoderLayer`: q/k/v/o projections (`attention_bias` on all four), `self_attn.q_norm`
(heads x head_dim) and `k_norm` (kv heads x head_dim), the SwiGLU MLP, and
`post_attention_layernorm` / `post_feedforward_layernorm` (hidden); no `input_layernorm`.
"""

from __future__ import annotations

from dataclasses import replace

from hybridmem.families.common.decoder_graph import (
    decoder_layer_params, head_dim, kv_heads, language_model_layers,
)
from hybridmem.models.graph import Layer, ParamTensor as T

FORMULAS = {"decoder_layer": "olmo2_decoder_layer", "rotary": "olmo2_rotary",
            "rmsnorm": "olmo2_rmsnorm"}
"""Layer kind -> OLMo 2's closed form of it (`olmo2/acts.py`)."""


def layer_params(tc) -> tuple[T, ...]:
    """The Llama layer's parameters without `input_layernorm`, plus the q/k norms over the
    whole projection width and `post_feedforward_layernorm`."""
    d, h = head_dim(tc), tc.hidden_size
    llama = tuple(p for p in decoder_layer_params(tc) if p.name != "input_layernorm.weight")
    return llama + (T("self_attn.q_norm.weight", (tc.num_attention_heads * d,)),
                    T("self_attn.k_norm.weight", (kv_heads(tc) * d,)),
                    T("post_feedforward_layernorm.weight", (h,)))


def lm_layers(tc, batch: int, seq: int) -> tuple[Layer, ...]:
    """`model.*` of `Olmo2ForCausalLM`: embed_tokens, rotary_emb, the layers, norm."""
    params = layer_params(tc)
    out = []
    for layer in language_model_layers(tc, batch, seq):
        if layer.kind == "decoder_layer":
            layer = replace(layer, params=params)
        out.append(replace(layer, formula=FORMULAS.get(layer.kind, "")))
    return tuple(out)
