"""InternVL (transformers 5.24 `modeling_internvl.py`): the image-tiling rule and the vision
side as layers (InternViT `model.vision_tower`, pixel shuffle + `model.multi_modal_projector`).

Why its own module: InternVL's processor (`InternVLProcessor` + `GotOcr2ImageProcessor`
`crop_to_patches`) cuts each image into a grid of 1..12 vision-size tiles chosen by aspect
ratio, plus a thumbnail, and the tower differs from CLIP's layer by layer: separate q/k/v and
`projection_layer`, layer scale (`lambda_1`, `lambda_2` multiply each branch), optional q/k
RMSNorms over the whole width, LayerNorm or RMSNorm (`norm_type`), and no final norm under
`use_mean_pooling` (nn.Identity). `get_image_features` drops the CLS token, pixel-shuffles
every 1/r x 1/r patches into one token of width E/r², then LayerNorm - Linear - GELU - Linear.
"""

from __future__ import annotations

from typing import TypedDict

from hybridmem.errors import SpecError
from hybridmem.models.graph import Layer, Module, ParamTensor as T, linear

# GotOcr2ImageProcessor class defaults (image_processing_got_ocr2.py): min_patches 1,
# max_patches 12; InternVLProcessor.images_kwargs turns `crop_to_patches` on
MIN_TILES = 1
MAX_TILES = 12



class InternVLProjectorDims(TypedDict):
    """`n` tiles of `t` patches, `s2` of them shuffled into one, from `h` to the LM's `out`."""

    n: int
    t: int
    h: int
    s2: int
    out: int


def tile_side(vc) -> int:
    """The tile = the tower's input size (`vision_config.image_size`, (h, w) after
    `InternVLVisionConfig.__post_init__`; the published processors' `size` is the same)."""
    size = vc.image_size
    return size[0] if isinstance(size, (list, tuple)) else size


def _pair(value) -> int:
    return value[0] if isinstance(value, (list, tuple)) else value


def tokens_per_crop(vc) -> int:
    """Sequence length inside the tower for one tile: patches + CLS."""
    return (tile_side(vc) // _pair(vc.patch_size)) ** 2 + 1


def tokens_per_tile(cfg) -> int:
    """(tile / patch)² patches (the CLS dropped), pixel-shuffled by downsample_ratio in each
    direction (`InternVLModel.pixel_shuffle`); `image_seq_length` must say the same (the
    processor writes that many image tokens per tile, `InternVLProcessor.replace_image_token`)."""
    vc = cfg.vision_config
    side = tile_side(vc) // _pair(vc.patch_size)
    k = int(side * cfg.downsample_ratio)
    tokens = k * k
    declared = getattr(cfg, "image_seq_length", tokens)
    if declared != tokens:
        raise SpecError("image_seq_length", declared, (tokens,),
                        reason=f"a {tile_side(vc)}-px tile of {side}x{side} patches shuffled by "
                        f"downsample_ratio {cfg.downsample_ratio} gives {tokens} tokens")
    return tokens


def optimal_grid(height: int, width: int, tile: int, lo: int = MIN_TILES,
                 hi: int = MAX_TILES) -> tuple[int, int]:
    """(columns, rows): transformers `image_processing_got_ocr2.get_optimal_tiled_canvas`,
    restated (the analytic tier does not import transformers): the grid of lo..hi tiles with
    the closest aspect ratio; on a tie the later (larger) grid while the image covers more than
    half of it. tests/test_internvl.py checks it against the original."""
    grids = sorted(((w, h) for w in range(1, hi + 1) for h in range(1, hi + 1)
                    if lo <= w * h <= hi), key=lambda g: g[0] * g[1])
    ratio, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for g in grids:
        diff = abs(ratio - g[0] / g[1])
        if diff < best_diff:
            best, best_diff = g, diff
        elif diff == best_diff and area > 0.5 * tile * tile * g[0] * g[1]:
            best = g
    return best


def tiles_per_image(cfg, height: int, width: int) -> int:
    """`GotOcr2ImageProcessor.get_number_of_image_patches` for a height x width image: the
    grid's tiles, + 1 thumbnail when the grid has more than one tile (`crop_image_to_patches`)."""
    cols, rows = optimal_grid(height, width, tile_side(cfg.vision_config))
    return cols * rows + (1 if cols * rows > 1 else 0)


def image_plan(cfg, hw: tuple[int, int] | None):
    """The family's one image rule (`families.common.images.image_plan` dispatches here) for an
    input image of (height, width) px: the grid follows its aspect ratio (`optimal_grid`), the
    tiles are always the tower's size. With no size the image is one tile (an assumption: the
    processor takes any input size)."""
    from hybridmem.job.images import ImagePlan

    h, w = hw or (tile_side(cfg.vision_config),) * 2
    tiles, per_tile = tiles_per_image(cfg, h, w), tokens_per_tile(cfg)
    return ImagePlan(cfg.model_type, tokens=tiles * per_tile, size=(h, w),
                     grid=(0, tiles, per_tile))


# --- the light config (no transformers import on the analytic path) ------------------------

# InternVLVisionConfig / InternVLConfig field defaults (configuration_internvl.py), for the
# fields the graph reads; the text config is Qwen2's unless it says otherwise
VISION_DEFAULTS = dict(
    model_type="internvl_vision", hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
    attention_bias=False, use_qk_norm=False, intermediate_size=4096, hidden_act="gelu",
    hidden_dropout_prob=0.0, attention_dropout=0.0, projection_dropout=0.0,
    norm_type="layer_norm", image_size=(448, 448), patch_size=(14, 14), num_channels=3,
    use_mask_token=False, use_absolute_position_embeddings=True, use_mean_pooling=True)
TOP_DEFAULTS = dict(image_token_id=151667, image_seq_length=256, downsample_ratio=0.5,
                    projector_hidden_act="gelu", vision_feature_layer=-1,
                    vision_feature_select_strategy="default", tie_word_embeddings=True)


def _hw(field: str, value) -> tuple[int, int]:
    """`InternVLVisionConfig.__post_init__`: an int side becomes (side, side)."""
    pair = tuple(value) if isinstance(value, (list, tuple)) else (value, value)
    if len(pair) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0
                             for v in pair):
        raise SpecError(field, value, reason="must be a positive integer or [height, width]")
    return pair


def light_config(data: dict):
    """The fields the graph reads, with transformers' defaults, as attributes (the light
    reader's InternVL branch, `models/light.py`); tests/test_models.py compares the graph it
    gives with the meta-device model for every preset."""
    from types import SimpleNamespace

    from hybridmem.models.light import parse_text

    clean = {k: v for k, v in data.items() if not k.startswith("_")}
    vision = {**VISION_DEFAULTS, **{k: v for k, v in (clean.pop("vision_config", None) or {})
                                    .items() if not k.startswith("_")}}
    for key in ("image_size", "patch_size"):
        vision[key] = _hw(f"vision_config.{key}", vision[key])
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_channels"):
        value = vision[key]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise SpecError(f"vision_config.{key}", value, reason="must be a positive integer")
    if vision["hidden_size"] % vision["num_attention_heads"]:
        raise SpecError("vision_config.hidden_size", vision["hidden_size"], reason="not a "
                        f"multiple of num_attention_heads={vision['num_attention_heads']}")
    text = {"model_type": "qwen2", **(clean.pop("text_config", None) or {})}
    cfg = SimpleNamespace(**{**TOP_DEFAULTS, **clean})
    cfg.vision_config = SimpleNamespace(**vision)
    cfg.text_config = parse_text(text, "text_config.")
    return cfg


# --- graph ----------------------------------------------------------------------------------

def _norm(prefix: str, h: int, rms: bool) -> tuple[T, ...]:
    """nn.LayerNorm (weight, bias) or InternVLVisionRMSNorm (weight) (`NORM2FN`)."""
    return (T(f"{prefix}.weight", (h,)),) + (() if rms else (T(f"{prefix}.bias", (h,)),))


def layer_params(vc) -> tuple[T, ...]:
    """InternVLVisionLayer: attention (q/k/v with `attention_bias`, projection_layer with a
    bias, q_norm/k_norm if `use_qk_norm`), fc1/fc2 MLP, two norms, lambda_1/lambda_2."""
    h, f, bias = vc.hidden_size, vc.intermediate_size, vc.attention_bias
    rms = vc.norm_type == "rms_norm"
    attn = sum((linear(f"attention.{n}", h, h, bias) for n in ("q_proj", "k_proj", "v_proj")), ())
    attn += linear("attention.projection_layer", h, h, True)
    if vc.use_qk_norm:
        attn += (T("attention.q_norm.weight", (h,)), T("attention.k_norm.weight", (h,)))
    mlp = linear("mlp.fc1", f, h, True) + linear("mlp.fc2", h, f, True)
    return (attn + mlp + _norm("layernorm_before", h, rms) + _norm("layernorm_after", h, rms)
            + (T("lambda_1", (h,)), T("lambda_2", (h,))))


def check_supported(cfg) -> None:
    """The closed forms cover InternViT's norm options (LayerNorm / RMSNorm, q/k norms), the
    last layer's features with the CLS dropped (every InternVL3 config); other settings are
    priced by the trace tier."""
    vc = cfg.vision_config
    if vc.norm_type not in ("layer_norm", "rms_norm"):
        raise SpecError("vision_config.norm_type", vc.norm_type, ("layer_norm", "rms_norm"))
    for field, value, ok in (("vision_feature_layer", cfg.vision_feature_layer, -1),
                             ("vision_feature_select_strategy",
                              cfg.vision_feature_select_strategy, "default")):
        if value != ok:
            raise SpecError(field, value, (ok,), reason="the analytic tier has no closed form "
                            "for this InternVL setting; use --method trace")
    if vc.hidden_dropout_prob or vc.attention_dropout or vc.projection_dropout:
        raise SpecError("vision_config.hidden_dropout_prob", vc.hidden_dropout_prob, (0.0,),
                        reason="InternViT dropout is not priced; use --method trace")


def vision_modules(cfg, n_tiles: int, runs: bool = True) -> list[Module]:
    """`model.vision_tower` and `model.multi_modal_projector` for `n_tiles` tiles."""
    check_supported(cfg)
    vc = cfg.vision_config
    h, p = vc.hidden_size, _pair(vc.patch_size)
    side = tile_side(vc)
    t = tokens_per_crop(vc)  # + CLS (InternVLVisionEmbeddings.forward: torch.cat)
    patches = t - 1
    base = dict(n=n_tiles, t=t, h=h)
    emb = (T("embeddings.cls_token", (1, 1, h)),)
    if vc.use_mask_token:
        emb += (T("embeddings.mask_token", (1, 1, h)),)
    emb += (T("embeddings.patch_embeddings.projection.weight", (h, vc.num_channels, p, p)),
            T("embeddings.patch_embeddings.projection.bias", (h,)))
    if vc.use_absolute_position_embeddings:
        emb += (T("embeddings.position_embeddings", (1, t, h)),)
    tower = [Layer(name="embeddings", kind="vision_embeddings", params=emb, runs=runs,
                   dims=dict(base, channels=vc.num_channels, side=side, cls=True))]
    params = layer_params(vc)
    for i in range(vc.num_hidden_layers):
        tower.append(Layer(name=f"encoder.layer.{i}", kind="encoder_layer", params=params,
                           formula="internvl_encoder_layer", scope=f"encoder.layer.{i}", runs=runs,
                           dims=dict(base, heads=vc.num_attention_heads,
                                     head_dim=h // vc.num_attention_heads,
                                     ffn=vc.intermediate_size, act=vc.hidden_act,
                                     qk_norm=vc.use_qk_norm,
                                     rms=vc.norm_type == "rms_norm")))
    # use_mean_pooling: `layernorm` is nn.Identity; its output (last_hidden_state) is held by
    # `image_outputs` either way
    final = () if vc.use_mean_pooling else _norm("layernorm", h, False)
    tower.append(Layer(name="post_layernorm", kind="internvl_final_norm", params=final, runs=runs,
                       on_grad_path=not vc.use_mean_pooling,
                       dims=dict(base, feeds=not vc.use_mean_pooling,
                                 identity=vc.use_mean_pooling)))
    s2 = int(1 / cfg.downsample_ratio) ** 2
    th = cfg.text_config.hidden_size
    proj = (_norm("layer_norm", h * s2, False) + linear("linear_1", th, h * s2, True)
            + linear("linear_2", th, th, True))
    projector = Layer(name="projector", kind="internvl_projector", params=proj, runs=runs,
                      dims=dict(n=n_tiles, t=patches, h=h, s2=s2, out=th))
    return [Module(name="vision_tower", prefix="model.vision_tower", layers=tuple(tower)),
            Module(name="multi_modal_projector", prefix="model.multi_modal_projector",
                   layers=(projector,))]
