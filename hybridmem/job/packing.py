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

The rules live here once; the trace tier (`trace/inputs.py`), the analytic tier
(`analytic/estimate.py`) and the CUDA harness (`harness/workload.py`) read them.
"""

from __future__ import annotations


from hybridmem.errors import SpecError

FLAG = "packing"


def check(spec) -> None:
    if not isinstance(spec.packing, bool):
        raise SpecError("packing", spec.packing, [True, False])


def check_model(spec, images: int) -> None:
    """Packing is priced for text batches only (`images`: image inputs per sample)."""
    if spec.packing and images:
        raise SpecError("packing", True, [False], reason="packed batches are priced for "
                        "text-only samples (images_per_sample 0)")


def row(spec) -> tuple[int, int]:
    """(batch, tokens) of the packed input: one row of every token of the micro-batch."""
    return (1, spec.micro_batch * spec.seq_len) if spec.packing else (spec.micro_batch,
                                                                       spec.seq_len)


def position_ids(spec, device=None):
    """0..seq_len-1 once per packed sequence, as TRL's padding-free collator writes them."""
    import torch  # only the batch builders need it: the spec and the analytic tier import this

    return torch.arange(spec.seq_len, device=device).repeat(spec.micro_batch).unsqueeze(0)


def one_row(spec):
    """The spec as the model graph sees a packed batch: one sample of all the tokens (every
    per-token tensor is the same; the attention is priced by `mask_bytes` on top)."""
    return spec.with_(micro_batch=1, seq_len=spec.micro_batch * spec.seq_len, packing=False)


def note(spec) -> str:
    return (f"packing: {spec.micro_batch} sequences of {spec.seq_len} tokens in one row of "
            f"{spec.micro_batch * spec.seq_len} (position ids restart per sequence, no padding); "
            + {"eager": "eager attention scores span the whole packed row, quadratic in its "
                        "length: packing with eager can cost far more than a padded batch",
               "sdpa": "sdpa gets a block-diagonal (1, 1, L, L) bool mask (no causal fast path)",
               "flash_attention_2": "flash_attention_2 runs varlen over cu_seqlens (no mask)"}
            [spec.attn])
