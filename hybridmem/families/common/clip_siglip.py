"""Vision towers (CLIP, SigLIP) as layers, following transformers 5.x `modeling_clip.py` and
`modeling_siglip.py` parameter by parameter.

CLIP prepends a CLS token (class_embedding) and has `pre_layrnorm`; SigLIP has no CLS, a patch
embedding bias, and a multi-head attention pooling `head`. Neither `post_layernorm` nor the
SigLIP head feed LLaVA: it reads `hidden_states[vision_feature_layer]`, taken *before*
`post_layernorm` (CLIP/SigLIP keep `tie_last_hidden_states` off), so they never get gradients.
"""

from __future__ import annotations

from typing import TypedDict

from hybridmem.models.graph import Layer, ParamTensor as T, linear

INT64 = 8  # position_ids buffer dtype (torch.arange default)


class TowerDims(TypedDict):
    """A ViT tower's: `n` crops (or tiles) of `t` tokens, hidden `h`."""

    n: int
    t: int
    h: int


class VisionEmbeddingsDims(TowerDims, total=False):
    channels: int
    side: int
    """The crop's side in pixels."""
    cls: bool
    """CLIP's class token (SigLIP has none)."""
    anyres: bool
    """The crops are concatenated into a new pixel tensor the patch conv saves."""


class EncoderLayerDims(TowerDims, total=False):
    heads: int
    head_dim: int
    ffn: int
    act: str
    qk_norm: bool
    rms: bool
    """InternViT's RMSNorm (`norm_type`); CLIP / SigLIP: LayerNorm."""


class TowerNormDims(TowerDims, total=False):
    feeds: bool
    """The norm's output is the feature the projector reads."""
    identity: bool
    """InternViT with mean pooling: the norm is nn.Identity."""


class PoolingHeadDims(TowerDims):
    ffn: int


def _ln(prefix: str, h: int) -> tuple[T, ...]:
    return (T(f"{prefix}.weight", (h,)), T(f"{prefix}.bias", (h,)))


def _linear(prefix: str, n_out: int, n_in: int) -> tuple[T, ...]:
    """CLIP/SigLIP linears all have a bias."""
    return linear(prefix, n_out, n_in, bias=True)


def patches_per_side(vc, image_size: int) -> int:
    return image_size // vc.patch_size


def has_cls(vc) -> bool:
    """CLIP prepends a CLS token; SigLIP does not (modeling_siglip.SiglipVisionEmbeddings)."""
    return vc.model_type == "clip_vision_model"


def tokens_per_crop(vc) -> int:
    """Sequence length inside the tower for one crop at its native size."""
    return patches_per_side(vc, vc.image_size) ** 2 + (1 if has_cls(vc) else 0)


def encoder_layer_params(vc) -> tuple[T, ...]:
    """CLIPEncoderLayer / SiglipEncoderLayer: attention with biases, two LayerNorms, fc1/fc2 MLP."""
    h, f = vc.hidden_size, vc.intermediate_size
    attn = sum((_linear(f"self_attn.{n}", h, h) for n in ("k_proj", "v_proj", "q_proj", "out_proj")), ())
    return (attn + _ln("layer_norm1", h) + _linear("mlp.fc1", f, h) + _linear("mlp.fc2", h, f)
            + _ln("layer_norm2", h))


def last_used_hidden_state(feature_layer: int | list[int], num_layers: int) -> int:
    """Highest index into `hidden_states` (0 = embeddings output, i = output of layer i-1)."""
    layers = [feature_layer] if isinstance(feature_layer, int) else list(feature_layer)
    return max(k if k >= 0 else num_layers + 1 + k for k in layers)


def vision_layers(vc, feature_layer: int | list[int], n_crops: int,
                  post_norm_feeds: bool = False) -> tuple[Layer, ...]:
    """The tower's layers, with which of them reach the LLaVA feature (on_grad_path).
    `post_norm_feeds`: the model reads `last_hidden_state` (after `post_layernorm`), as
    Gemma 3's projector does (`Gemma3Model.get_image_features`), not a hidden state."""
    h, heads, f = vc.hidden_size, vc.num_attention_heads, vc.intermediate_size
    side = patches_per_side(vc, vc.image_size)
    t = tokens_per_crop(vc)
    base = dict(n=n_crops, t=t, h=h)
    last = last_used_hidden_state(feature_layer, vc.num_hidden_layers)
    clip = has_cls(vc)
    emb = (T("embeddings.patch_embedding.weight", (h, vc.num_channels, vc.patch_size, vc.patch_size)),)
    if clip:
        emb = (T("embeddings.class_embedding", (h,)),) + emb
    else:
        emb += (T("embeddings.patch_embedding.bias", (h,)),)
    emb += (T("embeddings.position_embedding.weight", (t, h)),)
    layers = [Layer(name="embeddings", kind="vision_embeddings", params=emb,
                    buffers=(T("embeddings.position_ids", (1, t), INT64),),
                    dims=dict(base, channels=vc.num_channels, side=side * vc.patch_size, cls=clip))]
    if clip:
        layers.append(Layer(name="pre_layrnorm", kind="layernorm", params=_ln("pre_layrnorm", h),
                            dims=base))
    params = encoder_layer_params(vc)
    for i in range(vc.num_hidden_layers):
        layers.append(Layer(name=f"encoder.layers.{i}", kind="encoder_layer", params=params,
                            scope=f"encoder.layers.{i}",
                            on_grad_path=i + 1 <= last,
                            dims=dict(base, heads=heads, head_dim=h // heads, ffn=f,
                                      act=vc.hidden_act)))
    layers.append(Layer(name="post_layernorm", kind="layernorm", params=_ln("post_layernorm", h),
                        on_grad_path=post_norm_feeds, dims=dict(base, feeds=post_norm_feeds)))
    if not clip and getattr(vc, "vision_use_head", True):
        head = ((T("head.probe", (1, 1, h)), T("head.attention.in_proj_weight", (3 * h, h)),
                 T("head.attention.in_proj_bias", (3 * h,)))
                + _linear("head.attention.out_proj", h, h) + _ln("head.layernorm", h)
                + _linear("head.mlp.fc1", f, h) + _linear("head.mlp.fc2", h, f))
        layers.append(Layer(name="head", kind="pooling_head", params=head, on_grad_path=False,
                            dims=dict(base, ffn=f)))
    return tuple(layers)
