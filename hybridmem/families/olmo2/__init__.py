"""OLMo 2 (`olmo2`, transformers' `Olmo2ForCausalLM`; docs/families.md): a Llama-shaped decoder
whose layers normalise after, not before, each half: `post_attention_layernorm` on the
attention output and `post_feedforward_layernorm` on the MLP output, before each residual add
(no input norm), plus q/k RMSNorms over the whole projection width. Its RMSNorm multiplies the
weight in fp32 before casting back, and its RoPE tables stay fp32.

This folder: the record, the layer graph (`model.py`, the shared decoder graph with OLMo 2's
layers), the closed forms (`acts.py`), the presets (`presets/`).
"""

from __future__ import annotations

from hybridmem.families import DECODER, Family


def lm_layers(tc, batch: int, seq: int):
    from hybridmem.families.olmo2.model import lm_layers as olmo2_layers

    return olmo2_layers(tc, batch, seq)


def layer_kinds() -> dict:
    """OLMo 2's decoder layer, RoPE tables and final norm (`acts.py`), named by its layers'
    `formula`; the other kinds are the shared decoder's."""
    from hybridmem.families import LayerKind
    from hybridmem.families.common.decoder_graph import DecoderDims, DecoderLayerDims
    from hybridmem.families.olmo2 import acts

    return {"olmo2_decoder_layer": LayerKind(acts.decoder_layer, checkpointed=True, linear=True,
                                             dims=DecoderLayerDims),
            "olmo2_rotary": LayerKind(acts.rotary, dims=DecoderDims),
            "olmo2_rmsnorm": LayerKind(acts.rmsnorm, dims=DecoderDims)}


FAMILIES = (
    # configuration_olmo2.py `Olmo2Config` defaults (transformers 5.24); no head_dim field
    # (Olmo2Attention: hidden / heads)
    Family("olmo2", DECODER, "modeling_olmo2.py", lm_layers=lm_layers, layer_kinds=layer_kinds,
           text_defaults=dict(vocab_size=50304, hidden_size=4096, intermediate_size=11008,
                              num_hidden_layers=32, num_attention_heads=32,
                              num_key_value_heads=None, head_dim=None, hidden_act="silu",
                              attention_bias=False, tie_word_embeddings=False,
                              attention_dropout=0.0)),
)
