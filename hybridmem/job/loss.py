"""How the loss is computed: HF's `ForCausalLMLoss`, Liger's fused linear cross-entropy
(`--liger`) or torchtune's chunked cross-entropy (`--chunked-ce N`); the one home of their rules.

Why here: the analytic tier (`hybridmem/families/decoders/acts.py`), the trace tier and the CUDA
harness must agree on which kernels a technique swaps in and what each keeps alive; they read
these rules (and run `hybridmem.job.liger` / `chunked_loss_forward` below) instead of keeping
copies. Sources, read at liger-kernel 0.8.5 (PyPI) and torchtune 0.6.1 (PyPI):

- Liger (`liger_kernel/transformers/monkey_patch.py`): transformers' `Trainer` with
  `use_liger_kernel=True` calls `_apply_liger_kernel_to_instance(model, **liger_kernel_config)`
  (transformers `integrations/liger.py` `apply_liger_kernel`, on the PEFT-unwrapped model).
  Unknown model types are skipped with an info log (`MODEL_TYPE_TO_APPLY_LIGER_FN`); for
  llama / mistral / qwen2 `apply_liger_kernel_to_<type>` defaults to rope, rms_norm, swiglu and
  fused_linear_cross_entropy on, cross_entropy off; for llava it patches the text model with
  the text type's function and warns that the vision type (clip, siglip) is not supported.
- FLCE (`liger_kernel/ops/fused_linear_cross_entropy.py` `fused_linear_cross_entropy_forward`):
  the logits are never materialised; the input grad (BT x H, input dtype) and weight grad
  (V x H, weight dtype, if it trains) are computed in the forward over chunks of
  `flce_chunk_size` rows and saved for backward, which only scales them.
- torchtune `modules/loss/ce_chunked_output_loss.py` `CEWithChunkedOutputLoss` with
  `TransformerDecoder.chunked_output` (`modules/transformer.py`): the output projection runs on
  `h.chunk(N, dim=1)` (N logits tensors in the compute dtype, all alive until the loss is
  computed) and each chunk is upcast to fp32 inside the loss, one at a time.
"""

from __future__ import annotations

from hybridmem.errors import SpecError

# model_type -> the text model Liger patches (monkey_patch.py MODEL_TYPE_TO_APPLY_LIGER_FN and
# apply_liger_kernel_to_llava); only these are priced (their kernels are emulated here).
LIGER_TEXT_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2")
LIGER_PRICED: tuple[str, ...] = (*LIGER_TEXT_TYPES, "llava")
# model types Liger patches with kernels this project does not emulate (a refusal, not a skip):
# the keys of MODEL_TYPE_TO_APPLY_LIGER_FN (monkey_patch.py, liger-kernel 0.8.5) less the above
LIGER_OTHER: frozenset[str] = frozenset({
    "deepseek_v2", "deepseek_v3", "deepseek_v4", "gemma", "gemma2", "gemma3_text", "gemma3",
    "gemma4_text", "gemma4", "glm4", "glm4v", "glm4v_moe", "gpt_oss", "internvl", "llama4_text",
    "llama4", "granite", "mllama", "mllama_text_model", "ministral", "mixtral", "muse_glimmer",
    "nemotron", "olmo2", "pixtral", "olmo3", "qwen3", "qwen3_moe", "qwen2_vl", "qwen2_vl_text",
    "qwen2_5_vl", "qwen2_5_vl_text", "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
    "qwen3_5_moe_text", "qwen3_vl", "qwen3_vl_text", "qwen3_vl_moe", "qwen3_vl_moe_text",
    "smollm3", "phi3", "paligemma", "falcon_h1", "smolvlm", "hunyuan_v1_dense",
    "hunyuan_v1_moe", "exaone4",
})
# apply_liger_kernel_to_llama / _mistral / _qwen2 defaults (monkey_patch.py)
LIGER_DEFAULTS: dict[str, bool] = {"rope": True, "cross_entropy": False,
                                   "fused_linear_cross_entropy": True, "rms_norm": True,
                                   "swiglu": True}
# Liger's RMSNorm backward keeps one fp32 row of dW partial sums per SM (rms_norm.py
# `rms_norm_backward`: `_dW = torch.empty((sm_count, n_cols), dtype=torch.float32)`); the SM
# count of an H100 SXM (NVIDIA H100 datasheet: 132 SMs), a few MiB either way
LIGER_SM_COUNT = 132
IGNORE_INDEX = -100  # transformers / Liger / torchtune `ignore_index` default


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


def liger_text_type(model_type: str, text_type: str | None) -> str | None:
    """The text model type whose Liger kernels apply, or None when Liger skips the model
    (`_apply_liger_kernel_to_instance`: "no Liger kernels supported for model type");
    a type Liger patches but this project does not emulate is a SpecError."""
    if model_type in LIGER_OTHER or (model_type == "llava" and text_type in LIGER_OTHER):
        raise SpecError("liger", True, [f"model_type {t}" for t in LIGER_PRICED],
                        reason=f"Liger's kernels for {text_type or model_type!r} are not "
                        "priced yet")
    if model_type in LIGER_TEXT_TYPES:
        return model_type
    if model_type == "llava" and text_type in LIGER_TEXT_TYPES:
        return text_type
    return None


def liger_note(model_type: str) -> str:
    return (f"liger: model_type {model_type!r} has no Liger kernels; transformers' Trainer "
            "trains it unchanged (liger_kernel `_apply_liger_kernel_to_instance` skips it)")


def check_liger_config(config: object, field: str = "training_args.liger_kernel_config") -> None:
    """`liger_kernel_config` (kwargs of `_apply_liger_kernel_to_instance`): only the defaults
    are priced; anything else is a one-line SpecError naming the key."""
    if config is None:
        return
    if not isinstance(config, dict):
        raise SpecError(field, config, reason="must be an object of kernel flags")
    for key, value in config.items():
        if key not in LIGER_DEFAULTS:
            raise SpecError(f"{field}.{key}", value, sorted(LIGER_DEFAULTS))
        if value is not LIGER_DEFAULTS[key]:
            raise SpecError(f"{field}.{key}", value, [LIGER_DEFAULTS[key]],
                            reason="only Liger's default kernel set is priced")


# ------------------------------------------------------------------ chunked CE (torch)

def chunked_cross_entropy(logits: list, labels, ignore_index: int = IGNORE_INDEX):
    """torchtune `CEWithChunkedOutputLoss.forward` (ce_chunked_output_loss.py), line for line:
    the chunks of `labels` follow the logits chunks; each chunk upcast with `.float()` inside
    `F.cross_entropy(reduction="sum")`, the sum divided by the number of counted tokens."""
    import torch.nn.functional as F

    total_elements = (labels != ignore_index).sum()
    labels = [c.reshape(-1) for c in labels.chunk(len(logits), dim=1)]
    logits = [c.reshape(-1, c.size(-1)) for c in logits]
    total_loss = 0.0
    for logits_chunk, labels_chunk in zip(logits, labels):
        total_loss += F.cross_entropy(logits_chunk.float(), labels_chunk,
                                      ignore_index=ignore_index, reduction="sum")
    return total_loss / total_elements


def shift_labels(labels, ignore_index: int = IGNORE_INDEX):
    """transformers `ForCausalLMLoss` (loss/loss_utils.py): pad one ignored position, drop the
    first: `labels[..., 1:].contiguous()` (the same as Liger's `LigerForCausalLMLoss`)."""
    import torch.nn.functional as F

    padded = F.pad(labels, (0, 1), value=ignore_index)
    return padded[..., 1:].contiguous()


def chunked_loss_forward(n_chunks: int):
    """A causal-LM `forward` (bound to the HF model instance) whose output projection emits
    `n_chunks` logits chunks (torchtune `TransformerDecoder.chunked_output`) and whose loss is
    `chunked_cross_entropy`; the output keeps the list of chunks as its `logits`."""
    def forward(self, input_ids=None, labels=None, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        outputs = self.model(input_ids=input_ids, **kwargs)
        h = outputs[0]
        logits = [self.lm_head(chunk) for chunk in h.chunk(n_chunks, dim=1)]
        loss = None
        if labels is not None:
            loss = chunked_cross_entropy(logits, shift_labels(labels))
        return CausalLMOutputWithPast(loss=loss, logits=logits)
    return forward


def apply_chunked_ce(model, n_chunks: int) -> None:
    """Patch the causal LM instance (PEFT-unwrapped) as torchtune's recipes run it."""
    from types import MethodType

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.forward = MethodType(chunked_loss_forward(n_chunks), base)
