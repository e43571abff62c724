"""Liger's fused linear preference losses (`--liger` with `--objective dpo` / `orpo`): the
lm_head and the DPO / ORPO loss in one autograd function that walks the batch in chunks of
chosen / rejected pairs, so the (2 x micro-batch, S, V) logits never exist at once.

Source: liger-kernel `src/liger_kernel/chunked_loss/fused_linear_preference.py`
(`LigerFusedLinearPreferenceBase.forward`, commit 15ce9c4), which `LigerFusedLinearDPOLoss`
(`dpo_loss.py`, `use_ref_model=True`) and `LigerFusedLinearORPOLoss` (`orpo_loss.py`, the chosen
NLL on) subclass; TRL's DPO / ORPO trainers used them under `use_liger_kernel` (`use_liger_loss`
in DPOConfig) before TRL 1.x replaced them with its own fused head. What the forward allocates,
R = 2 x micro-batch rows of S tokens, hidden H, vocabulary V, `chunk_size` pairs per chunk
(default 1: r = 2 rows a chunk):

- before the loop: `grad_weight = torch.zeros_like(weight)` (V x H, the weight's dtype: the
  loss asks `torch.func.grad_and_value` for the weight's grad, argnums=(0, 1), trainable or
  not);
- per chunk, inside `grad_and_value`: `logits_chunk = input_chunk @ weight.t()` (r x S x V, the
  compute dtype), `log_softmax(logits_chunk.float())` (fp32, kept for its backward), with a
  reference model its chunk forward under no_grad beside them (the same two, freed after the
  gather); the chunk's backward then holds the fp32 log-probs, the gather's fp32 grad and
  log_softmax's fp32 input grad together (as HF's loss backward), and returns the chunk's
  input grad (r x S x H) and weight grad (V x H) before `grad_weight.add_`;
- the chunks' input grads are appended to lists and `torch.cat` once at the end (R x S x H,
  twice for that moment), then saved with `grad_weight` for backward, which only scales them
  (during the loop the list so far stands where the saved concatenation will be).

The decoder's other Liger kernels (RMSNorm, SwiGLU, RoPE) are the `liger` technique's, which
Trainer applies to the model either way.
"""

from __future__ import annotations

from hybridmem.errors import SpecError
from hybridmem.techniques.protocol import Target

NAME = "liger-preference"
AXIS = None  # how `--loss liger` prices a preference objective, not a choice of its own
FLAG = "liger"
OBJECTIVES: tuple[str, ...] = ("dpo", "orpo")
CHUNK_PAIRS = 1  # `chunk_size=1` (fused_linear_preference.py forward's default)
FP32 = 4


def active(spec) -> bool:
    """Asked for, and not overridden by TRL's own fused head: where the installed TRL runs the
    step through it (`objectives.fused_head`), `use_liger_kernel` applies Liger's layer
    kernels only (trl 1.16 dpo_trainer.py: `liger_kernel_config["fused_linear_cross_entropy"]
    = False`, "which this trainer patches with a fused LM head"), and no TRL trainer calls
    `LigerFusedLinear*Loss` any more."""
    from hybridmem.techniques import trl_head_runs

    return bool(spec.liger) and spec.objective in OBJECTIVES and not trl_head_runs(spec)


def check(spec) -> None:
    return None  # lm_head's LoRA clash is the `liger` technique's, as for SFT


def applies(target: Target) -> bool:
    return True  # a plain-torch chunked loss on the lm_head's weight and hidden states


def kept_logits(spec, b: int, s: int, vocab: int, e: int) -> list[tuple[int, int]] | None:
    return []  # the loss returns no logits


def head_tensors(d: dict, c, need_in: bool, need_w: bool) -> dict[str, list[tuple[int, int]]]:
    """The head for the analytic tier (`families.common.decoder_acts.technique_head`): `tensors` of
    the lm_head's dims and the step's dtypes; DPO with a reference model runs its chunks too."""
    reference = c.ref_model in ("separate", "adapter")  # DPO's (ORPO reads none)
    return tensors(d["b"], d["s"], d["h"], d["vocab"], c.e, c.stream, c.param, reference)


def tensors(R: int, S: int, H: int, V: int, e: int, stream: int, param: int,
            reference: bool) -> dict[str, list[tuple[int, int]]]:
    """(numel, bytes per element) of the module docstring's tensors: `saved` (kept for
    backward), `fwd` (the forward's high point beside them: a chunk's logits and log-probs, the
    reference chunk's, the chunk's two fp32 grads and its input / weight grads; then the final
    concatenation of the input grads), `grad_in_saved` (the saved weight grad, which becomes
    the weight's `.grad`)."""
    r = 2 * CHUNK_PAIRS
    rows = r * S
    chunk = [(rows * V, e), (rows * V, FP32)]
    ref = [(rows * V, e), (rows * V, FP32)] if reference else []
    backward = [(rows * V, FP32), (rows * V, FP32), (rows * H, stream), (V * H, param)]
    fwd_chunk = chunk + max(ref, backward, key=lambda ts: sum(n * b for n, b in ts))
    fwd_cat = [(R * S * H, stream)]  # the list of chunk grads beside their concatenation
    fwd = max(fwd_chunk, fwd_cat, key=lambda ts: sum(n * b for n, b in ts))
    return {"saved": [(R * S * H, stream), (V * H, param)], "fwd": fwd,
            "grad_in_saved": [(V * H, param)]}


def note(spec, model_type: str, applies: bool) -> str | None:
    return (f"liger ({spec.objective}): Liger's fused linear preference loss "
            f"(LigerFusedLinear{spec.objective.upper()}Loss, chunks of {CHUNK_PAIRS} "
            "chosen/rejected pair): no full logits; the input and weight grads made in the "
            "forward (docs/loss.md)")


def install(model, spec, target: Target) -> str | None:
    raise SpecError("liger", True, [False], reason=f"the trace tier does not emulate Liger's "
                    f"fused {spec.objective} loss: use --method analytic")


def apply_real(model, spec) -> None:
    raise ImportError(f"Liger's fused {spec.objective} loss is not run by the harness")
