"""The image-token rule, the pixel inputs and the token ids of a VLM's batch, by its family.

Why here, not in `hybridmem.job`: each piece asks the family registry (`Family.image_plan`,
`pixel_inputs`, `text_extras`, `image_wrap`), and the job layer sits below the families. The
analytic graph (`models/build.py`), the trace tier's batch (`trace/inputs.py`), the CUDA
harness's batch (`harness/workload.py`) and the sweep planner (`harness/sweep.py`) all call
these, so every tier counts a family's image tokens the same way. The model-free pieces
(`ImagePlan`, `parse_image_size`, `check_seq_len`, `image_token_id`) stay in `job/images.py`.

Works on both config kinds the project builds (the light `SimpleNamespace` and a
transformers `PretrainedConfig`): it reads attributes only.
"""

from __future__ import annotations

from hybridmem.errors import SpecError
from hybridmem.families import family, types
from hybridmem.job.images import IGNORE_INDEX, ImagePlan, image_token_id, parse_image_size

IMAGE_FAMILIES: tuple[str, ...] = types(where=lambda f: f.image_plan is not None)
"""model_types with an image-token rule (`hybridmem/families/`): their batches carry images
(other image-text-to-text families are priced on text-only batches)."""
HXW_FAMILIES: tuple[str, ...] = types(where=lambda f: f.hw_images is True)
"""`image_size` may be `HxW`: native dynamic resolution (Qwen-VL: the patch grid) or image
splitting (Idefics3, SmolVLM: the image after the processor's resize)."""


def image_plan(cfg, image_size: object = None) -> ImagePlan:
    """The family's rule (`Family.image_plan`): tokens per image (and what the tower sees) at
    `image_size`."""
    mt = cfg.model_type
    fam = family(mt)
    if fam is None or fam.image_plan is None:
        raise SpecError("model_type", mt, IMAGE_FAMILIES, reason="no image-token rule")
    hw = parse_image_size(image_size)
    if not (fam.hw_images(cfg) if callable(fam.hw_images) else fam.hw_images):
        square_only(cfg, hw)
    return fam.image_plan(cfg, hw)


def square_only(cfg, hw: tuple[int, int] | None) -> None:
    """The one-line refusal of `HxW` for a tower that takes a square side."""
    if hw is not None and hw[0] != hw[1]:
        raise SpecError("image_size", f"{hw[0]}x{hw[1]}", reason="HxW needs a native-resolution "
                        f"or image-splitting family ({', '.join(HXW_FAMILIES)}) or a Pixtral "
                        f"tower; {cfg.model_type} takes a square side")


def pixel_inputs(config, plan: ImagePlan, n_images: int, dtype, device=None,
                 host_shapes: bool = False) -> dict:
    """The processor's pixel outputs for `n_images` images of `plan` (zeros: values change no
    memory). `host_shapes`: the integer shape inputs whose values the model code reads
    (`.tolist()`) stay readable under meta / fake tensors: Qwen-VL's `image_grid_thw` on the
    CPU, LLaVA-NeXT's `image_sizes` a list (the trace tier; 16-24 B each on a GPU)."""
    import torch

    fam = family(config.model_type)
    if fam is not None and fam.pixel_inputs is not None:
        return fam.pixel_inputs(config, plan, n_images, dtype, device, host_shapes)
    side = plan.size[0]
    return {"pixel_values": torch.zeros(n_images, 3, side, side, dtype=dtype, device=device)}


def text_inputs(config, batch: int, seq_len: int, image_tokens: int, device=None,
                images: int = 1) -> dict:
    """input_ids / labels (and the family's token type ids) of shape (batch, seq_len): BOS,
    then each of `images` images' tokens (`image_tokens` in all, masked out of the labels,
    haotian-liu/LLaVA `preprocess`) between the family's marker tokens (`Family.image_wrap`,
    Qwen-VL: one run per image for its M-RoPE), then text. Token 1 stands for BOS/text (any id
    the vocabulary has)."""
    import torch

    ids = torch.ones(batch, seq_len, dtype=torch.long, device=device)
    labels = torch.ones(batch, seq_len, dtype=torch.long, device=device)
    out = {}
    if image_tokens:
        fam = family(config.model_type)
        row = torch.tensor(_image_row(config, fam, image_tokens, images), dtype=torch.long)
        if len(row) > seq_len:  # check_seq_len refuses these first unless plan.markers is off
            raise ValueError(f"{config.model_type}: {len(row)} BOS, image and marker tokens "
                             f"exceed seq_len {seq_len} (its image_wrap vs ImagePlan.markers)")
        ids[:, :len(row)] = row.to(device)
        mask = ids == image_token_id(config)
        labels[mask] = IGNORE_INDEX
        if fam is not None and fam.text_extras is not None:  # token type ids
            out.update(fam.text_extras(config, mask.long()))
    return {**out, "input_ids": ids, "labels": labels}


def _image_row(config, fam, image_tokens: int, images: int) -> list[int]:
    """BOS (1) and each image's placeholder tokens between its marker tokens."""
    per, rest = divmod(image_tokens, images)
    if rest:
        raise ValueError(f"{image_tokens} image tokens are no whole number of {images} images")
    before, after = fam.image_wrap(config) if fam is not None and fam.image_wrap else ((), ())
    return [1, *([*before, *[image_token_id(config)] * per, *after] * images)]


def crop_pixel_bytes(layer, graph, pix: int) -> int:
    """`LayerKind.pixel_bytes` of a crop tower's embeddings (CLIP, SigLIP, InternViT): the
    processor's (crops, C, side, side) `pixel_values` in the model dtype `pix`, and Idefics3's
    bool `pixel_attention_mask` (crops, side, side) where the family sends one
    (`Family.pixel_mask`)."""
    from hybridmem.allocator.alloc import t

    if not graph.vision_batch:
        return 0
    d = layer.dims
    out = t(graph.vision_batch * d["channels"] * d["side"] ** 2, pix)
    if family(graph.model_type).pixel_mask:
        out += t(graph.vision_batch * d["side"] ** 2, 1)
    return out

