"""The sizing rules the loss techniques share with each other and with the analytic closed
forms (`families/common/decoder_acts.py`): torch's `chunk`, Triton's `next_power_of_2`, Liger's FLCE
chunk rule and RMSNorm partials, the ignore index and the causal label shift, TRL's activation
offloading thresholds.

Why a shared module: the technique modules are independent (pyproject.toml's "techniques are
independent" contract), yet Liger's emulated kernels, its analytic terms, torchtune's chunked
loss and CCE's patch all size their tensors by these; each rule cites its library.
"""

from __future__ import annotations

# Liger's RMSNorm backward keeps one fp32 row of dW partial sums per SM (rms_norm.py
# `rms_norm_backward`: `_dW = torch.empty((sm_count, n_cols), dtype=torch.float32)`); the SM
# count of an H100 SXM (NVIDIA H100 datasheet: 132 SMs), a few MiB either way
LIGER_SM_COUNT = 132
IGNORE_INDEX = -100  # transformers / Liger / torchtune `ignore_index` default
# TRL get_act_offloading_ctx_manager / OffloadActivations defaults (SFTTrainer passes none),
# read by the offloading hooks (`offload_hooks`) and the analytic tier (`analytic/offloaded.py`)
MIN_OFFLOAD_SIZE = 1024  # bytes: `min_offload_size`, element_size() * nelement()
MAX_FWD_STASH_SIZE = 5  # `max_fwd_stash_size`: ids a device copy outlives its offload by


def next_power_of_2(n: int) -> int:
    """`triton.next_power_of_2` (triton/__init__.py: the smallest power of 2 >= n)."""
    return 1 << max(n - 1, 0).bit_length()


def flce_chunk_size(bt: int, h: int, v: int, chunk_mem_const: int = 1) -> int:
    """Rows per chunk of Liger's FLCE forward (fused_linear_cross_entropy.py):
    `inc_factor = cdiv(V, chunk_mem_const * H)`, `chunk_size = next_power_of_2(cdiv(BT,
    inc_factor))`, capped at BT."""
    inc = -(-v // (chunk_mem_const * h))
    return min(next_power_of_2(-(-bt // inc)), bt)


def flce_chunks(bt: int, h: int, v: int) -> list[int]:
    """Row counts of the FLCE chunks (`num_chunks = cdiv(BT, chunk_size)`, the last one short)."""
    size = flce_chunk_size(bt, h, v)
    return [min(size, bt - i) for i in range(0, bt, size)]


def torch_chunks(n: int, parts: int) -> list[int]:
    """Sizes `Tensor.chunk(parts)` gives along a dim of size n: ceil(n / parts) each, the last
    one shorter, fewer than `parts` when n is not divisible (torch docs, `torch.chunk`)."""
    size = -(-n // parts)
    return [min(size, n - i) for i in range(0, n, size)]


def shift_labels(labels, ignore_index: int = IGNORE_INDEX):
    """transformers `ForCausalLMLoss` (loss/loss_utils.py): pad one ignored position, drop the
    first: `labels[..., 1:].contiguous()` (the same as Liger's `LigerForCausalLMLoss`)."""
    import torch.nn.functional as F

    padded = F.pad(labels, (0, 1), value=ignore_index)
    return padded[..., 1:].contiguous()

