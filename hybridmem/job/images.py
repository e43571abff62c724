"""The one image-token rule per VLM family, and the one seq-len check every tier applies.

Why one module: the analytic graph (`models/build.py`), the trace tier's batch
(`trace/inputs.py`), the CUDA harness's batch (`harness/workload.py`) and the sweep planner
(`harness/sweep.py`) each used to count image tokens their own way (asking the model and
counting list outputs two different ways, or a closed form) and to check them against
`seq_len` with two thresholds. They now all call `image_plan` and `check_seq_len`.

Per family (transformers 5.24 modeling / image-processing code):
- `llava`, `llava_next`: `hybridmem.models.llava.image_layout` (CLS dropped under `default`,
  anyres tiles + base crop, unpadding, one newline per row);
- `llava_onevision`: LLaVA-NeXT's rule, then the anyres_max_N downsampling of the tile grid
  (`hybridmem.models.llava.onevision_layout`);
- `qwen2_vl`, `qwen2_5_vl` (native dynamic resolution): the image is resized by
  `image_processing_qwen2_vl.smart_resize` to multiples of patch_size x merge_size within
  [min_pixels, max_pixels]; grid_thw = (1, H/14, W/14) (one temporal patch: the image is
  repeated to `temporal_patch_size` frames); the PatchMerger turns every merge_size^2
  patches into one LM token;
- `idefics3`: the processor resizes the longest edge to `size.longest_edge` (here:
  `image_size`; default 4 x the vision tile, the processors' `size`), rounds it up to whole
  tiles of `vision_config.image_size`, splits them and adds the global image (one image if
  it is one tile); each tile becomes (tile / patch)² / scale_factor² tokens after the pixel
  shuffle (`processing_idefics3` `image_seq_len`);
- `gemma3`: `Gemma3MultiModalProjector` pools every image to `mm_tokens_per_image` soft tokens
  (the SigLIP tower always sees `vision_config.image_size`; the processor resizes to it);
- `mistral3` (Pixtral tower, native dynamic resolution): `hybridmem.models.mistral3.pixtral_plan`
  (`image_processing_pixtral.get_resize_output_image_size`: down to `longest_edge`, up to whole
  merged patches; rows x cols [IMG] tokens plus one [IMG_BREAK] / [IMG_END] per row).

Works on both config kinds the project builds (the light `SimpleNamespace` and a
transformers `PretrainedConfig`): it reads attributes only.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from hybridmem.errors import SpecError

SPLIT_FAMILIES: tuple[str, ...] = ("idefics3",)
"""Image splitting into vision-size tiles + a global image, pixel shuffle. SmolVLM shares the
rule but not yet the trace (its meta trace with images stops in a `nonzero`, not located yet):
it stays on text-only batches (docs/vlm-families.md)."""
PIXTRAL_FAMILIES: tuple[str, ...] = ("mistral3",)
"""Pixtral tower: (images, C, H, W) pixels at the resized size + `image_sizes`, `HxW` allowed."""
IMAGE_FAMILIES: tuple[str, ...] = ("llava", "llava_next", "llava_onevision", "qwen2_vl",
                                   "qwen2_5_vl", "gemma3") + SPLIT_FAMILIES + PIXTRAL_FAMILIES
"""model_types whose batches carry images (else: text-only)."""
GRID_FAMILIES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl")
"""Families with native dynamic resolution: `image_size` may be `HxW`."""

# transformers image_processing_qwen2_vl.py `Qwen2VLImageProcessor.size` defaults:
# shortest_edge = 56 * 56 (min_pixels), longest_edge = 28 * 28 * 1280 (max_pixels)
QWEN_MIN_PIXELS = 56 * 56
QWEN_MAX_PIXELS = 28 * 28 * 1280
QWEN_DEFAULT_SIZE = (448, 448)
"""Qwen2-VL has no native size; an assumed default (16 x 16 merged tokens = 256 per image)."""
QWEN_MAX_ASPECT = 200  # smart_resize: "absolute aspect ratio must be smaller than 200"

def is_pixtral(cfg) -> bool:
    """A Pixtral tower: Mistral-3, or LLaVA with a `pixtral` vision config (pixtral-12b)."""
    vc = getattr(cfg, "vision_config", None)
    return cfg.model_type in PIXTRAL_FAMILIES or getattr(vc, "model_type", "") == "pixtral"


_HXW = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def parse_image_size(value: object) -> tuple[int, int] | None:
    """(height, width) of `image_size`: None, a positive int (a square) or "HxW"."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise SpecError("image_size", value, reason="give a positive integer or HxW")
    if isinstance(value, int):
        if value <= 0:
            raise SpecError("image_size", value, reason="must be a positive integer or HxW")
        return value, value
    if isinstance(value, str):
        if value.strip().isdigit():
            return parse_image_size(int(value))
        m = _HXW.match(value)
        if m and int(m.group(1)) > 0 and int(m.group(2)) > 0:
            return int(m.group(1)), int(m.group(2))
    raise SpecError("image_size", value, reason="give a positive integer or HxW (e.g. 448x672)")


def normalize_image_size(value: object) -> int | str | None:
    """The spec's stored form: an int for a square (old specs keep their hash), else "HxW"."""
    hw = parse_image_size(value)
    if hw is None:
        return None
    return hw[0] if hw[0] == hw[1] else f"{hw[0]}x{hw[1]}"


@dataclass(frozen=True, slots=True)
class ImagePlan:
    """What one image becomes, for one family at one image size."""

    model_type: str
    tokens: int
    """Image tokens per image in the language model's sequence."""
    size: tuple[int, int]
    """(height, width) in pixels the vision tower sees (after the processor's resize)."""
    grid: tuple[int, int, int] = (0, 0, 0)
    """Qwen-VL: grid_thw in patches (temporal, height, width); 0s elsewhere."""
    layout: object | None = None
    """LLaVA / LLaVA-NeXT: the `models.llava.ImageLayout` (crops, features, newlines)."""
    markers: int = 0
    """Text tokens the processor adds per image beside `tokens` (Pixtral: one [IMG_BREAK] per
    row, the last one [IMG_END]); they take sequence positions but are no image features."""

    @property
    def patches(self) -> int:
        """Qwen-VL: patches of one image in the vision tower's packed sequence."""
        return math.prod(self.grid)

    @property
    def crops(self) -> int:
        """Idefics3 / SmolVLM: tiles + global image per image (`grid[1]`; grid[0] stays 0)."""
        return self.grid[1]


def smart_resize(height: int, width: int, factor: int, min_pixels: int = QWEN_MIN_PIXELS,
                 max_pixels: int = QWEN_MAX_PIXELS) -> tuple[int, int]:
    """transformers `image_processing_qwen2_vl.smart_resize`, restated (that module needs
    torchvision); tests/test_vlm_images.py checks it against the original where it imports."""
    if max(height, width) / min(height, width) > QWEN_MAX_ASPECT:
        raise SpecError("image_size", f"{height}x{width}",
                        reason=f"aspect ratio must be below {QWEN_MAX_ASPECT} (smart_resize)")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _qwen_plan(cfg, hw: tuple[int, int] | None) -> ImagePlan:
    vc = cfg.vision_config
    p, m = vc.patch_size, vc.spatial_merge_size
    h, w = smart_resize(*(hw or QWEN_DEFAULT_SIZE), factor=p * m)
    grid = (1, h // p, w // p)  # an image is one temporal patch (processor tiles it to T frames)
    return ImagePlan(cfg.model_type, tokens=grid[1] * grid[2] // (m * m), size=(h, w), grid=grid)


SPLIT_DEFAULT_TILES = 4
"""Idefics3ImageProcessor `size = {"longest_edge": 4 * 364}` with `max_image_size` 364 (the
vision tile); SmolVLM's processors likewise use 4 x their tile."""


def _split_plan(cfg, side: int | None) -> ImagePlan:
    vc = cfg.vision_config
    tile = vc.image_size
    side = side or SPLIT_DEFAULT_TILES * tile
    per_side = -(-side // tile)  # resize_for_vision_encoder: ceil to whole tiles
    crops = per_side * per_side + (1 if per_side > 1 else 0)  # + the global image
    per_tile = (tile // vc.patch_size) ** 2 // cfg.scale_factor ** 2
    return ImagePlan(cfg.model_type, tokens=crops * per_tile, size=(side, side),
                     grid=(0, crops, per_tile))


def image_plan(cfg, image_size: object = None) -> ImagePlan:
    """The family's rule: tokens per image (and what the tower sees) at `image_size`."""
    mt = cfg.model_type
    hw = parse_image_size(image_size)
    if mt in GRID_FAMILIES:
        return _qwen_plan(cfg, hw)
    if is_pixtral(cfg):
        from hybridmem.models.mistral3 import pixtral_plan

        return pixtral_plan(cfg, hw)
    if hw is not None and hw[0] != hw[1]:
        raise SpecError("image_size", image_size, reason=f"HxW needs a native-resolution family "
                        f"({', '.join(GRID_FAMILIES + PIXTRAL_FAMILIES)}, Pixtral LLaVA); {mt} takes "
                        "a square side")
    side = None if hw is None else hw[0]
    if mt in ("llava", "llava_next", "llava_onevision"):
        from hybridmem.models.llava import image_layout

        layout = image_layout(cfg, side)
        native = cfg.vision_config.image_size
        s = side or native
        return ImagePlan(mt, tokens=layout.tokens, size=(s, s), layout=layout)
    if mt in SPLIT_FAMILIES:
        return _split_plan(cfg, side)
    if mt == "gemma3":
        native = cfg.vision_config.image_size
        if side is not None and side != native:
            raise SpecError("image_size", image_size, (native,),
                            reason="Gemma 3's SigLIP tower takes its native size (the processor "
                            "resizes every image to it)")
        return ImagePlan(mt, tokens=int(cfg.mm_tokens_per_image), size=(native, native))
    raise SpecError("model_type", mt, IMAGE_FAMILIES, reason="no image-token rule")


def check_seq_len(seq_len: int, images: int, plan: ImagePlan | None) -> int:
    """Image tokens per sample; SpecError unless at least one text token (BOS) fits beside
    them (the collators put BOS first: haotian-liu/LLaVA `preprocess`, Qwen2-VL's chat
    template). The one seq-len check of every tier."""
    tokens = images * plan.tokens if plan is not None and images else 0
    markers = images * plan.markers if tokens else 0
    if tokens and tokens + markers + 1 > seq_len:
        extra = f" and {plan.markers} break/end tokens" if plan.markers else ""
        raise SpecError("seq_len", seq_len,
                        reason=f"too short for {images} image(s) of {plan.tokens} image tokens"
                        f"{extra} plus one text token (seq_len counts text and image tokens)")
    return tokens


def image_token_id(config) -> int:
    """The placeholder id the model replaces by image features (`image_token_id`, LLaVA's
    older `image_token_index`)."""
    ident = getattr(config, "image_token_id", None)
    return config.image_token_index if ident is None else ident


def images_in_batch(spec, multimodal: bool) -> int:
    """Images per sample: `images_per_sample`, None meaning 1 for a VLM (0 for a decoder)."""
    if not multimodal:
        return 0
    return 1 if spec.images_per_sample is None else spec.images_per_sample


def pixel_inputs(config, plan: ImagePlan, n_images: int, dtype, device=None,
                 host_shapes: bool = False) -> dict:
    """The processor's pixel outputs for `n_images` images of `plan` (zeros: values change no
    memory). `host_shapes`: the integer shape inputs whose values the model code reads
    (`.tolist()`) stay readable under meta / fake tensors: Qwen-VL's `image_grid_thw` on the
    CPU, LLaVA-NeXT's `image_sizes` a list (the trace tier; 16-24 B each on a GPU)."""
    import torch

    mt = config.model_type
    if mt in GRID_FAMILIES:
        vc = config.vision_config
        # Qwen2VLImageProcessor: flatten_patches -> (grid_t*grid_h*grid_w, C*T*P*P)
        row = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
        return {"pixel_values": torch.zeros(n_images * plan.patches, row, dtype=dtype,
                                            device=device),
                "image_grid_thw": torch.tensor([list(plan.grid)] * n_images, dtype=torch.long,
                                               device="cpu" if host_shapes else device)}
    if is_pixtral(config):
        # PixtralImageProcessor: (images, C, H, W) padded to the largest (all images share the
        # plan's size) and `image_sizes` (images, 2), whose values the tower reads per image
        h, w = plan.size
        sizes = [[h, w]] * n_images
        return {"pixel_values": torch.zeros(n_images, 3, h, w, dtype=dtype, device=device),
                "image_sizes": sizes if host_shapes else torch.tensor(sizes, device=device)}
    side = plan.size[0]
    if mt in SPLIT_FAMILIES:
        # Idefics3ImageProcessor: (images, tiles + global, C, tile, tile) and the bool
        # pixel_attention_mask; ones, not zeros: the model drops all-zero (padding) images
        tile = config.vision_config.image_size
        return {"pixel_values": torch.ones(n_images, plan.crops, 3, tile, tile, dtype=dtype,
                                           device=device),
                "pixel_attention_mask": torch.ones(n_images, plan.crops, tile, tile,
                                                   dtype=torch.bool, device=device)}
    if mt in ("llava_next", "llava_onevision"):  # (images, crops, C, H, W) + image_sizes
        native = config.vision_config.image_size
        return {"pixel_values": torch.zeros(n_images, plan.layout.crops, 3, native, native,
                                            dtype=dtype, device=device),
                "image_sizes": ([[side, side]] * n_images if host_shapes else
                                torch.tensor([[side, side]] * n_images, device=device))}
    return {"pixel_values": torch.zeros(n_images, 3, side, side, dtype=dtype, device=device)}


IGNORE_INDEX = -100  # HF / LLaVA label value left out of the loss


def text_inputs(config, batch: int, seq_len: int, image_tokens: int, device=None) -> dict:
    """input_ids / labels (and Qwen-VL's `mm_token_type_ids`) of shape (batch, seq_len): BOS,
    then the image tokens (masked out of the labels, haotian-liu/LLaVA `preprocess`), then
    text. Token 1 stands for BOS/text (any id the vocabulary has)."""
    import torch

    ids = torch.ones(batch, seq_len, dtype=torch.long, device=device)
    labels = torch.ones(batch, seq_len, dtype=torch.long, device=device)
    out = {}
    if image_tokens:
        ids[:, 1:1 + image_tokens] = image_token_id(config)
        labels[:, 1:1 + image_tokens] = IGNORE_INDEX
        if config.model_type in GRID_FAMILIES:
            # processing_qwen2_vl `return_mm_token_type_ids = True`: 1 marks image tokens;
            # the model needs it for its 3-D (M-RoPE) position ids
            tt = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
            tt[:, 1:1 + image_tokens] = 1
            out["mm_token_type_ids"] = tt
        if config.model_type == "gemma3":
            # processing_gemma3 returns `token_type_ids` (1 at image tokens) for training:
            # Gemma3Model builds the bidirectional-over-images masks from it
            # (`create_masks_for_vision_model`)
            tt = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
            tt[:, 1:1 + image_tokens] = 1
            out["token_type_ids"] = tt
    return {**out, "input_ids": ids, "labels": labels}
