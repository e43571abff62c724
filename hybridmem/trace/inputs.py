"""Synthetic batches of exactly the configured shape, image tokens where the model expects them.

LLaVA (and LLaVA-NeXT) replace each `<image>` token of `input_ids` by one projected image
feature (`masked_scatter` in `get_placeholder_mask`); the collator puts the image first, after
BOS, and masks image positions out of the labels (-100, haotian-liu/LLaVA `preprocess`).
No attention mask is passed: an unpadded batch, the common training case, for which HF uses
the causal kernel path instead of materialising a (B, 1, S, S) mask.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridmem.errors import SpecError
from hybridmem.models.loader import MULTIMODAL_TYPES, is_multimodal
from hybridmem.spec import TrainingSpec

IGNORE_INDEX = -100  # HF/LLaVA label value excluded from the loss


def has_image_rule(config) -> bool:
    """Whether the batch builder knows where this family's image tokens go (LLaVA's rule,
    `make_batch`); other image-text-to-text families are priced on text-only batches."""
    return config.model_type in MULTIMODAL_TYPES


def images_per_sample(spec: TrainingSpec, config) -> int:
    if not is_multimodal(config.model_type):
        if spec.images_per_sample:
            raise SpecError("images_per_sample", spec.images_per_sample, (0,),
                            reason="a decoder-only model takes no images")
        if spec.image_size is not None:
            raise SpecError("image_size", spec.image_size, reason=f"{spec.model} takes no images")
        return 0
    if not has_image_rule(config):
        if spec.images_per_sample:
            raise SpecError("images_per_sample", spec.images_per_sample, (0,),
                            reason=f"no image-token rule for model_type={config.model_type!r} "
                            "yet: the trace tier prices it on text-only batches")
        if spec.train == "projector":  # the loss would not reach the only trained part
            raise SpecError("train", spec.train, ("full", "llm+projector", "lora", "peft"),
                            reason="the projector runs no forward on text-only batches (no "
                            f"image-token rule for model_type={config.model_type!r} yet)")
        return 0
    return 1 if spec.images_per_sample is None else spec.images_per_sample


def batch_notes(spec: TrainingSpec, config) -> list[str]:
    """The notes a batch needs: a VLM priced without images says so."""
    if is_multimodal(config.model_type) and not has_image_rule(config):
        return [f"images: text-only batches (images_per_sample 0): no image-token rule for "
                f"model_type={config.model_type!r} yet; vision tower and projector hold weights "
                "(and grads, states) but run no forward"]
    return []


def image_side(spec: TrainingSpec, config) -> int:
    return spec.image_size or config.vision_config.image_size


def pixel_inputs(spec: TrainingSpec, config, n_images: int, dtype: torch.dtype) -> dict:
    """pixel_values (and LLaVA-NeXT's image_sizes / anyres patches) for `n_images` images."""
    side = image_side(spec, config)
    native = config.vision_config.image_size
    if config.model_type == "llava_next":
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        patches = image_size_to_num_patches((side, side), config.image_grid_pinpoints, native)
        return {"pixel_values": torch.zeros(n_images, patches, 3, native, native, dtype=dtype),
                "image_sizes": [[side, side]] * n_images}
    if side != native:
        raise SpecError("image_size", spec.image_size, (native,),
                        reason="LLaVA-1.5's CLIP tower takes only its native size")
    return {"pixel_values": torch.zeros(n_images, 3, side, side, dtype=dtype)}


def tokens_per_image(model: nn.Module, config, pixels: dict) -> int:
    """Image tokens one image becomes, asked of the model itself (one image, no grad).

    The model knows its CLS handling (CLIP vs SigLIP), feature selection and LLaVA-NeXT's
    anyres packing; the batch then has exactly as many `<image>` tokens as features.
    """
    one = {k: v[:1] for k, v in pixels.items()}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    with torch.no_grad():
        out = base.model.get_image_features(**one)
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    if isinstance(feats, (list, tuple)):
        return sum(f.numel() for f in feats) // config.get_text_config().hidden_size
    return feats.numel() // config.get_text_config().hidden_size


def make_batch(spec: TrainingSpec, config, model: nn.Module,
               dtype: torch.dtype) -> tuple[dict, int]:
    """input_ids, labels (and pixel inputs) of shape (micro_batch, seq_len); image tokens."""
    from hybridmem.job import packing

    b, s = packing.row(spec)  # packed: one row of all the tokens (job.packing)
    n_img = images_per_sample(spec, config)
    packing.check_model(spec, n_img)
    batch: dict = {}
    n_tok = 0
    if n_img:
        batch = pixel_inputs(spec, config, b * n_img, dtype)
        n_tok = n_img * tokens_per_image(model, config, batch)
        if n_tok + 1 > s:
            raise SpecError("seq_len", s, reason=f"too short for {n_img} image(s) of {n_tok} "
                            "image tokens plus at least one text token")
    ids = torch.ones(b, s, dtype=torch.long)  # token 1: BOS in Llama/Mistral vocabularies
    labels = torch.ones(b, s, dtype=torch.long)
    if n_tok:
        image_id = getattr(config, "image_token_id", None)
        image_id = config.image_token_index if image_id is None else image_id
        ids[:, 1:1 + n_tok] = image_id
        labels[:, 1:1 + n_tok] = IGNORE_INDEX
    batch.update(input_ids=ids, labels=labels)
    if spec.packing:  # TRL's padding-free collator: position ids restart per sequence
        batch["position_ids"] = packing.position_ids(spec)
    return batch, n_tok
