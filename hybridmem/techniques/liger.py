"""Liger kernels (`--loss liger`, `--liger`; TrainingArguments `use_liger_kernel`): fused linear
cross-entropy (no logits), RMSNorm, SwiGLU, RoPE, as liger-kernel 0.8.5 allocates them; the one
home of their rules (which models, the default kernel set). The kernels emulated in torch and the
real patch are `liger_kernels` (imported only when a model is patched: no torch here); the sizing
rules shared with the analytic tier are `kernels`; docs/loss.md.

Sources, read at liger-kernel 0.8.5 (PyPI):

- `liger_kernel/transformers/monkey_patch.py`: transformers' `Trainer` with
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
"""

from __future__ import annotations

from hybridmem.errors import SpecError
from hybridmem.techniques.kernels import flce_chunks
from hybridmem.techniques.protocol import Target, adapts_lm_head

# Which model types are priced is their family records' (`Family.techniques` "liger": Liger's
# monkey_patch.py MODEL_TYPE_TO_APPLY_LIGER_FN and apply_liger_kernel_to_llava, the kernels
# `liger_kernels.py` emulates); the refusals name them (`Target.listed`).
# model types Liger patches with kernels this project does not emulate (a refusal, not a skip):
# the keys of MODEL_TYPE_TO_APPLY_LIGER_FN (monkey_patch.py, liger-kernel 0.8.5) less the
# priced ones (llama, mistral, qwen2, llava)
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
def liger_text_type(target: Target) -> str | None:
    """The text model type whose Liger kernels apply, or None when Liger skips the model
    (`_apply_liger_kernel_to_instance`: "no Liger kernels supported for model type");
    a type Liger patches but this project does not emulate is a SpecError."""
    if target.model_type in LIGER_OTHER or target.patched in LIGER_OTHER:
        raise SpecError("liger", True,
                        [f"model_type {t}" for t in target.listed.get(NAME, ())],
                        reason=f"Liger's kernels for {target.patched or target.model_type!r} "
                        "are not priced yet")
    return target.patched if NAME in target.priced else None


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



INT64, FP32 = 8, 4

NAME = "liger"
AXIS = "loss"
FLAG = "liger"
OBJECTIVES: tuple[str, ...] = ("sft",)  # priced with the LM loss only


def active(spec) -> bool:
    return bool(spec.liger)


def check(spec) -> None:
    """LoRA or a trainable copy on lm_head: Liger's FLCE reads `lm_head.weight` directly
    (liger_kernel/transformers/model/llama.py `lce_maybe_trainable_lm_head`), so an adapter
    there would be bypassed."""
    if not isinstance(spec.liger, bool):
        raise SpecError("liger", spec.liger, [True, False])
    if spec.liger and adapts_lm_head(spec):
        raise SpecError("liger", True, [False], reason="Liger's fused loss reads "
                        "lm_head.weight directly: LoRA / modules_to_save on lm_head is bypassed")


def applies(target: Target) -> bool:
    return liger_text_type(target) is not None


def kept_logits(spec, b: int, s: int, vocab: int, e: int) -> list[tuple[int, int]] | None:
    return []  # `lce_forward`: no logits (where Liger patches the model at all: `applies`)


def head_tensors(d: dict, c, need_in: bool, need_w: bool) -> dict[str, list[tuple[int, int]]]:
    """lm_head + loss under Liger (`lce_forward` -> `LigerForCausalLMLoss` ->
    `LigerFusedLinearCrossEntropyFunction`; the rules are `liger_kernels`'s docstring),
    as (numel, bytes) for the analytic tier (`families.common.decoder_acts.technique_head`).

    Saved: grad_input (B x H, the input's = the stream dtype) and, when both the input and the
    weight need grads, grad_weight (V x H, the weight's dtype; it becomes the weight's .grad at
    backward: `grad_in_saved`). Forward transients: the final norm's output (read only here),
    the padded and shifted labels (int64), loss_1d (fp32), the target mask and its count, then
    per chunk (`flce_chunk_size`, the first is the largest): under autocast the cached bf16
    copy of a trainable weight (`grad_logits @ weight`), the input chunk's cast, the
    transposed weight's cast (a view: not cached) and the chunk's logits; without autocast one
    persistent (chunk x V) logits buffer, and in fp32 the `mm(grad_logits.t(), input)` weight
    product. Backward: a 0-dim tensor (`torch.tensor(1.0)` for the comparison)."""
    b, s, h, V = d["b"], d["s"], d["h"], d["vocab"]
    B = b * s
    rows = flce_chunks(B, h, V)[0]
    grad_w = [(V * h, c.param)] if need_in and need_w else []
    fwd = [(B * h, c.stream), (b * (s + 1), INT64), (B, INT64), (B, FP32), (B, 1), (1, INT64)]
    if c.amp:
        if need_w:
            fwd.append((V * h, 2))                      # autocast cache of the weight cast
        fwd += [(rows * h, 2), (V * h, 2), (rows * V, 2)]
    else:
        fwd.append((rows * V, c.e))                     # logits_storage
        if grad_w and c.e == FP32:
            fwd.append((V * h, FP32))                   # legacy dW product
    return {"saved": [(B * h, c.stream), *grad_w], "fwd": fwd, "bwd": [(1, FP32)],
            "grad_in_saved": grad_w}


def note(spec, model_type: str, applies: bool) -> str | None:
    if not applies:
        return liger_note(model_type)
    from hybridmem.techniques import trl_head_runs

    if trl_head_runs(spec):
        return ("liger: RMSNorm, SwiGLU, RoPE as liger-kernel 0.8.5's kernels allocate; the head "
                "is TRL's own fused LM head (its trainers turn Liger's fused linear "
                "cross-entropy off under use_liger_kernel; docs/loss.md)")
    return ("liger: fused linear cross-entropy (no logits; grad_input and grad_weight made in "
            "the forward), RMSNorm, SwiGLU, RoPE as liger-kernel 0.8.5's kernels allocate "
            "(docs/loss.md); RMSNorm's (sm_count x H) dW partials are not counted")


def install(model, spec, target: Target) -> str | None:
    from hybridmem.techniques import trl_head_runs, liger_kernels

    from hybridmem.objectives import lm_loss

    if not lm_loss(spec) and trl_head_runs(spec):
        raise SpecError("liger", True, [False], reason=f"the trace tier does not run Liger's "
                        f"layer kernels beside TRL's fused head ({spec.objective}): use "
                        "--method analytic")

    text = liger_text_type(target)
    if text is not None:
        liger_kernels.patch_instance(model)
    return text


def apply_real(model, spec) -> None:
    from hybridmem.techniques import liger_kernels

    liger_kernels.apply_real(model)
