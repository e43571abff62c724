"""Where the CPU trace differs from a CUDA run, and what is done about each difference.

Corrected here: CUDA autocast's fp32 list for the norms HF models call (`cuda_autocast_rules`),
CUDA's foreach gradient clipping (`cuda_foreach_norm`), AdamW/Adafactor `step` scalars on the host (`optimizers.host_state_keys`), cuBLAS workspaces
(placed by `runner.train`). Everything else is listed, with its size, in `KNOWN_LIMITATIONS`
(copied into every trace prediction's notes and into docs/trace.md).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hybridmem.allocator.foreach import foreach_norm_scratch

KNOWN_LIMITATIONS: tuple[str, ...] = (
    "attention kernels: the trace runs CPU SDPA (flash-attention-for-CPU, saves output + fp32 "
    "logsumexp of B*H*S*4 bytes); CUDA flash/cuDNN/mem-efficient save the same output plus a "
    "logsumexp of the same size (mem-efficient pads S to a multiple of 32), so saved tensors "
    "match to within B*H*32*4 bytes per layer",
    "flash_attention_2 is traced as SDPA; FA-2's backward allocates softmax_d (B*H*S*4 bytes) "
    "and dq_accum (B*S*H*D*4 bytes, fp32) inside the kernel, transiently, per layer: not in "
    "the trace (e.g. 2 MiB + 256 MiB at B=8, S=2048, 32 heads, hidden 4096)",
    "kernel-internal workspaces (cuDNN attention, cuBLASLt beyond the two 32 MiB cuBLAS "
    "workspaces counted as 'workspace') are not seen by the trace (typically < 100 MiB)",
    "autocast: the meta backend emulates CUDA's op lists; the fake backend runs CPU autocast "
    "with CUDA's fp32 policy added for layer_norm/group_norm (CLIP's norms: fp32 outputs, 2x "
    "the bytes of bf16 ones); other ops in CUDA's fp32 list (pow, exp, sum, ...) are not "
    "called on low-precision tensors by the supported models",
    "fp16-mixed: GradScaler is emulated (loss scaled, grads unscaled in place); its found_inf "
    "scalars (512 B per device) are not traced",
    "adamw-8bit and lion have no torch implementation: their state layout is emulated "
    "(bitsandbytes uint8 states + one fp32 absmax per 256 elements; lion-pytorch's exp_avg)",
    "no attention mask is passed (unpadded batch); a padded batch makes HF build a "
    "(B, 1, S, S) mask for SDPA/eager (B*S*S bytes as bool)",
    "meta backend (the default): scalars made with torch.tensor() inside an optimizer step are "
    "not seen (one 512 B block each, transient); layer_norm on bf16/fp16 input keeps fp32 "
    "mean/rstd (as CUDA does: 4 bytes per row and statistic, the CPU kernel's are 2)",
    "meta backend: inside Python-level composite functions (nn.MultiheadAttention, used only "
    "by SigLIP's pooling head) the emulated autocast does not apply, so that head runs in "
    "fp32 (a few KiB per image)",
    "the two iterations use a fixed batch; data-dependent shapes (variable-length LLaVA "
    "batches, group_by_modality_length) are not sampled",
)


def _packed_sequences(original):
    """`find_packed_sequence_indices` as a real run of our batches computes it: on real tensors
    the original; on meta / fake ones (no values) None for one sequence per row, and for a
    packed batch (`position_ids` given by the batch, `hybridmem.techniques.packing`) the original's
    `(diff != 1).cumsum(-1)`; the value check, which needs the values, answered from the batch."""
    def find(position_ids):
        from torch._subclasses.fake_tensor import FakeTensor

        if not (position_ids.is_meta or isinstance(position_ids, FakeTensor)):
            return original(position_ids)
        # the original's tensors, made and dropped as a real run makes them (its value check
        # too: `(mask[:, -1] == 0).all()`), then its answer for our batch
        first = position_ids[:, :1] - 1  # locals alive until the return, as the original's
        diff = torch.diff(position_ids, prepend=first, dim=-1)
        mask = (diff != 1).cumsum(-1)
        (mask[:, -1] == 0).all()
        del first, diff
        return mask if _PACKED[0] else None
    return find


_PACKED = [False]  # whether the traced batch is packed (set by `patched_model_checks`)


def _padded_on_meta(original):
    """`_ignore_causal_mask_sdpa` that keeps the mask for a fake or meta padding mask
    (`padded_mask`'s pad: not skippable), the original otherwise."""
    from torch._subclasses.fake_tensor import FakeTensor

    def ignore(padding_mask, *args, **kwargs):
        if padding_mask is not None and (padding_mask.is_meta
                                         or isinstance(padding_mask, FakeTensor)):
            return False
        return original(padding_mask, *args, **kwargs)

    return ignore


@contextlib.contextmanager
def patched_model_checks(packed: bool = False):
    """Take the code paths a real CUDA run takes where HF reads tensor values.

    - LLaVA's `n_image_tokens * hidden == numel` check calls `.item()` on a fake tensor
      (docs/design.md); the batch has exactly the right number of image tokens, so it is a no-op.
    - `masking_utils.find_packed_sequence_indices` treats fake tensors as "tracing" and then
      keeps a packed-sequence mask, which makes HF build a (B, 1, S, S) attention mask that a
      real run of an unpadded batch never builds; it returns None on a real run of our batch.
      transformers 4.x's returns the mask for every batch, values unread (4.57 masking_utils.py:
      "it would be nice to return None ... but it causes issues with export"), so a real run
      builds the (B, 1, S, S) mask there, and the trace runs that original as it is.
    - `warn_if_padding_and_no_attention_mask` only warns; skipped so fake and real runs match.
    - `_ignore_causal_mask_sdpa` reads a padding mask's values (`fast_all`; 5.x skips that for
      fake tensors, 4.57 does not): on fake and meta tensors it answers as for the padded
      batch TRL's collators pass (`objectives.steps.padded_mask`): the mask is built.
    """
    import importlib

    from transformers import masking_utils, modeling_utils
    from hybridmem.families import REGISTRY
    from hybridmem.trace import compat

    # each family whose record says its count check reads values (`Family.count_check`)
    checked = [importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
               for mt, fam in REGISTRY.items() if fam.count_check]
    patches = [(mod, "torch_compilable_check", lambda *a, **k: None) for mod in checked]
    patches.append((modeling_utils.PreTrainedModel, "warn_if_padding_and_no_attention_mask",
                    lambda *a, **k: None))
    patches = [p for p in patches if hasattr(p[0], p[1])] + compat.placeholder_patches()
    if compat.transformers_major() >= 5:  # 4.x's returns its mask always, reading no value
        patches.append((masking_utils, "find_packed_sequence_indices",
                        _packed_sequences(masking_utils.find_packed_sequence_indices)))
    if hasattr(masking_utils, "_ignore_causal_mask_sdpa"):
        patches.append((masking_utils, "_ignore_causal_mask_sdpa",
                        _padded_on_meta(masking_utils._ignore_causal_mask_sdpa)))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, new in patches:
        setattr(obj, name, new)
    was, _PACKED[0] = _PACKED[0], packed
    try:
        yield
    finally:
        _PACKED[0] = was
        for obj, name, old in saved:
            setattr(obj, name, old)


# c10 autocast_mode.cpp, `AT_FORALL_FP32`: on CUDA these run in fp32 (inputs upcast, fp32
# outputs); CPU autocast's fp32 list does not have them, so the CPU trace would run them in bf16.
_CUDA_FP32 = {F.layer_norm: 0, F.group_norm: 0}


class CudaAutocastFp32(TorchFunctionMode):
    """Apply CUDA autocast's fp32 policy to the norms, on top of CPU autocast."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CUDA_FP32 and torch.is_autocast_enabled("cpu"):
            args = tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point()
                         else a for a in args)
            kwargs = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point()
                          else v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def cuda_autocast_rules(enabled: bool):
    return CudaAutocastFp32() if enabled else contextlib.nullcontext()


class CpuSdpaOnMeta(TorchFunctionMode):
    """On meta tensors SDPA has no fused kernel and would decompose into the math path (which
    saves the S x S attention matrix); run the kernel a CPU (fake) run picks instead.

    aten/src/ATen/native/transformers/attention.cpp: on CPU, dense 4-D inputs without dropout
    go to `_scaled_dot_product_flash_attention_for_cpu` (GQA handled in the kernel), which has
    a meta implementation and an autograd formula.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            call = _as_cpu_flash(*args, **kwargs)
            if call is not None:
                return call
        return func(*args, **kwargs)


def _as_cpu_flash(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                  scale=None, enable_gqa=False):
    if dropout_p or query.dim() != 4 or not query.is_meta:
        return None
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # attention.cpp `convert_boolean_attn_mask` (every backend, before the kernel choice):
        # an additive mask in the query dtype, `at::where(mask, 0.0, scalar_tensor(-inf))`,
        # materialised over the mask's broadcast shape (Gemma 3's sliding / image masks)
        attn_mask = torch.where(attn_mask, 0.0, torch.scalar_tensor(
            float("-inf"), dtype=query.dtype, device=attn_mask.device))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]


@contextlib.contextmanager
def cuda_foreach_norm():
    """`clip_grad_norm_(..., foreach=True)` as on CUDA, on any backend.

    - `torch._foreach_norm` also allocates CUDA's scratch (`foreach_norm_scratch`) and its
      unused 0-dim `global_norm`, freed when the op returns (ForeachReduceOp.cu);
    - meta tensors pass clip_grad's foreach check (`_device_has_foreach_support` knows only
      CUDA-like devices and CPU), so the meta backend takes the same path.
    """
    from torch.nn.utils import clip_grad

    norm, has_foreach = torch._foreach_norm, clip_grad._device_has_foreach_support

    def foreach_norm(tensors, ord=2, dtype=None):
        like = tensors[0]
        scratch = [torch.zeros(n, dtype=torch.float32, device=like.device)
                   for n in foreach_norm_scratch([t.numel() for t in tensors])]
        out = norm(tensors, ord, dtype=dtype)
        global_norm = torch.empty((), dtype=dtype or like.dtype, device=like.device)
        del scratch, global_norm
        return out

    torch._foreach_norm = foreach_norm
    clip_grad._device_has_foreach_support = lambda device: device.type == "meta" or \
        has_foreach(device)
    try:
        yield
    finally:
        torch._foreach_norm, clip_grad._device_has_foreach_support = norm, has_foreach
