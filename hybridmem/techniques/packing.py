"""Packing / padding-free batches: the micro-batch's sequences in one row, no padding.

As TRL builds them (trl/trainer/sft_trainer.py `DataCollatorForLanguageModeling(padding_free=
True)`, used when SFTConfig `padding_free=True` or `packing=True`, whose `packing_strategy`
"bfd" / "wrapped" only decides which sequences share a row): the examples of one step are
concatenated into ONE row of micro_batch x seq_len tokens (batch dimension 1) with
`position_ids` restarting at 0 for each sequence, and no `attention_mask`.

What the model does with it (transformers 5.x masking_utils.py): with no attention mask and
position ids given, `_preprocess_mask_arguments` calls `find_packed_sequence_indices`
(`(diff(position_ids) != 1).cumsum(-1)`), and `create_causal_mask` then builds a block-diagonal
causal mask over the whole row for sdpa (`sdpa_mask`: a (1, 1, L, L) bool tensor, L = micro_batch
x seq_len; `allow_is_causal_skip` is off, so the causal kernel path is lost) and eager
(`eager_mask`: the same as a float tensor, 0 / finfo.min); flash_attention_2 gets no mask and
runs varlen over `cu_seqlens` from the position ids (modeling_flash_attention_utils.py
`_is_packed_sequence` / `prepare_fa_kwargs_from_position_ids`). So: linear in L for flash
(as the padded batch), a quadratic mask for sdpa, and for eager the attention scores over the
whole packed row per head, quadratic in L: micro_batch times the unpacked batch's scores.

A technique behind `techniques.protocol` (off any axis: it combines with a loss replacement):
the rules live here once, and the tiers reach them through the protocol's hooks
(`techniques.graph_spec`, `check_batch`, `batch_inputs`, `notes`), not `if spec.packing`. The
analytic tier's packed-mask terms are `analytic/packed.py` (they need the allocator's rounding).
"""

from __future__ import annotations

from hybridmem.errors import SpecError
from hybridmem.techniques.protocol import Target

NAME = "packing"
AXIS = None  # combines with any loss replacement
FLAG = "packing"
# priced for sft (`objectives.rules.trl_step` refuses it with the TRL objectives, naming why)
OBJECTIVES: tuple[str, ...] = ("sft",)


def active(spec) -> bool:
    return spec.packing is True


def check(spec) -> None:
    if not isinstance(spec.packing, bool):
        raise SpecError("packing", spec.packing, [True, False])


def check_batch(spec, images: int) -> None:
    """Packing is priced for text batches only (`images`: image inputs per sample)."""
    if spec.packing and images:
        raise SpecError("packing", True, [False], reason="packed batches are priced for "
                        "text-only samples (images_per_sample 0)")


def applies(target: Target) -> bool:
    return True  # the collator's batch, for any causal LM (text only: `check_batch`)


def kept_logits(spec, b: int, s: int, vocab: int, e: int) -> list[tuple[int, int]] | None:
    return None  # the ordinary (1, L, V) logits of the one row


def batch_inputs(spec, device=None) -> dict:
    """What TRL's padding-free collator adds to the batch: `position_ids`, 0..seq_len-1 once
    per packed sequence (no attention mask)."""
    import torch  # only the batch builders need it: the spec and the analytic tier import this

    return {"position_ids": torch.arange(spec.seq_len, device=device)
            .repeat(spec.micro_batch).unsqueeze(0)}


def graph_spec(spec):
    """The spec as the model graph (and the batch builder) sees a packed batch: one sample of
    all the tokens (every per-token tensor is the same; sdpa's mask is priced on top,
    `analytic/packed.py`)."""
    return spec.with_(micro_batch=1, seq_len=spec.micro_batch * spec.seq_len, packing=False)


def install(model, spec, target: Target) -> str | None:
    return None  # the batch changes, not the model (`batch_inputs`)


def apply_real(model, spec) -> None:
    return None  # likewise on CUDA: the harness builds the same batch (`trace.inputs`)


def note(spec, model_type: str | None = None, applies: bool = True) -> str:
    return (f"packing: {spec.micro_batch} sequences of {spec.seq_len} tokens in one row of "
            f"{spec.micro_batch * spec.seq_len} (position ids restart per sequence, no padding); "
            + {"eager": "eager attention scores span the whole packed row, quadratic in its "
                        "length: packing with eager can cost far more than a padded batch",
               "sdpa": "sdpa gets a block-diagonal (1, 1, L, L) bool mask (no causal fast path)",
               "flash_attention_2": "flash_attention_2 runs varlen over cu_seqlens (no mask)"}
            [spec.attn])
