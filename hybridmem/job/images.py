"""The model-free pieces of the image-token rule, and the one seq-len check every tier applies.

Why one module: the analytic graph (`models/build.py`), the trace tier's batch
(`trace/inputs.py`), the CUDA harness's batch (`harness/workload.py`) and the sweep planner
(`harness/sweep.py`) must count image tokens alike and check them against `seq_len` with one
threshold: they all call `families.common.images.image_plan` (the family's
`Family.image_plan`) and `check_seq_len`.

Here: what a plan is (`ImagePlan`), the `image_size` forms, the seq-len check, the placeholder
id. The families' own rules live in their folders (`hybridmem/families/<family>/`).
Nothing here asks the family registry (the job layer sits below the families).

Works on both config kinds the project builds (the light `SimpleNamespace` and a
transformers `PretrainedConfig`): it reads attributes only.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from hybridmem.errors import SpecError

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
    """LLaVA / LLaVA-NeXT: the `models.graph.ImageLayout` (crops, features, newlines)."""
    markers: int = 0
    """Text tokens the processor adds per image beside `tokens` (Pixtral: one [IMG_BREAK] per
    row, the last one [IMG_END]); they take sequence positions but are no image features."""

    @property
    def patches(self) -> int:
        """Qwen-VL: patches of one image in the vision tower's packed sequence."""
        return math.prod(self.grid)

    @property
    def crops(self) -> int:
        """Idefics3 / SmolVLM: tiles + global image per image; InternVL: tiles + thumbnail
        (`grid[1]`; grid[0] stays 0)."""
        return self.grid[1]


def check_seq_len(seq_len: int, images: int, plan: ImagePlan | None) -> int:
    """Image tokens per sample; SpecError unless at least one text token (BOS) fits beside
    them (the collators put BOS first: haotian-liu/LLaVA `preprocess`, Qwen2-VL's chat
    template). The one seq-len check of every tier."""
    tokens = images * plan.tokens if plan is not None and images else 0
    markers = images * plan.markers if tokens else 0
    if tokens and tokens + markers + 1 > seq_len:
        extra = f" and {plan.markers} marker tokens" if plan.markers else ""  # per image
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
    """Images per sample: `images_per_sample`, None meaning 1 for a VLM; a decoder takes none
    (an image count or size for one is a one-line SpecError). The model graph and the trace
    tier's batch read it."""
    if not multimodal:
        if spec.images_per_sample:
            raise SpecError("images_per_sample", spec.images_per_sample, (0,),
                            reason=f"{spec.model} is a text-only decoder")
        if spec.image_size is not None:
            raise SpecError("image_size", spec.image_size, reason=f"{spec.model} takes no images")
        return 0
    return 1 if spec.images_per_sample is None else spec.images_per_sample


IGNORE_INDEX = -100  # HF / LLaVA label value left out of the loss


