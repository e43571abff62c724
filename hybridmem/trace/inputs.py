"""Synthetic batches of exactly the configured shape, image tokens where the model expects them.

VLMs replace each image token of `input_ids` by one projected image feature (`masked_scatter`
in `get_placeholder_mask`); how many there are per image and what pixel inputs go with them is
the family's one rule (`hybridmem.families.common.images`), shared with the analytic graph and
the harness.
No attention mask is passed: an unpadded batch, for which HF uses the causal kernel path
instead of materialising a (B, 1, S, S) mask; a `padded` job's mask is added by the runner
(`TrainingSpec.padded`).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridmem.errors import SpecError
from hybridmem.families.common.images import IMAGE_FAMILIES, image_plan, pixel_inputs, text_inputs
from hybridmem.job.images import check_seq_len, images_in_batch
from hybridmem.models.loader import is_multimodal
from hybridmem.job.spec import TrainingSpec


def has_image_rule(config) -> bool:
    """Whether the one image-token rule (`hybridmem.families.common.images`) knows this
    family; other image-text-to-text families are priced on text-only batches."""
    return config.model_type in IMAGE_FAMILIES


def images_per_sample(spec: TrainingSpec, config) -> int:
    """`job.images.images_in_batch`; a VLM without an image-token rule runs text-only."""
    if not is_multimodal(config.model_type):
        return images_in_batch(spec, False)
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
    return images_in_batch(spec, True)


def batch_notes(spec: TrainingSpec, config) -> list[str]:
    """The notes a batch needs: a VLM priced without images says so."""
    if is_multimodal(config.model_type) and not has_image_rule(config):
        return [f"images: text-only batches (images_per_sample 0): no image-token rule for "
                f"model_type={config.model_type!r} yet; vision tower and projector hold weights "
                "(and grads, states) but run no forward"]
    return []


def make_batch(spec: TrainingSpec, config, model: nn.Module | None, dtype: torch.dtype,
               device=None, host_shapes: bool = True) -> tuple[dict, int]:
    """input_ids, labels (and pixel inputs in `dtype`) of shape (micro_batch, seq_len) on
    `device`; image tokens per sample, by the family's one rule (`families.common.images.image_plan`).
    The one batch builder of the trace tier and the CUDA harness. `model` is not read (tests
    check the rule against `get_image_features`; a ZeRO-3 model cannot run outside its
    engine). `host_shapes`: grid_thw / image_sizes stay readable, as the model code reads
    their values under fake tensors (`families.common.images.pixel_inputs`). A packed batch
    (`techniques.packing`) is one row of all the tokens."""
    from hybridmem import techniques

    shape = techniques.graph_spec(spec)  # packing's one row, else the spec's own
    b, s = shape.micro_batch, shape.seq_len
    n_img = images_per_sample(spec, config)
    techniques.check_batch(spec, n_img)
    batch: dict = {}
    n_tok = 0
    if n_img:
        plan = image_plan(config, spec.image_size)
        n_tok = check_seq_len(s, n_img, plan)
        batch = pixel_inputs(config, plan, b * n_img, dtype, device, host_shapes=host_shapes)
    batch.update(text_inputs(config, b, s, n_tok, device, images=n_img))
    batch.update(techniques.batch_inputs(spec, device))  # packing's position ids
    return batch, n_tok
