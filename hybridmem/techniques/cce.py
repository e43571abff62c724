"""Cut Cross-Entropy (`--loss cce`, `--cut-cross-entropy`; axolotl `cut_cross_entropy: true`):
the loss from the hidden states and `lm_head.weight` without (N, V) logits; the one home of its rules, its allocations emulated in torch, and the real patch.

Why one module: the analytic tier (`head_tensors` below, read by
`hybridmem/families/common/decoder_acts.py` `technique_head`), the trace tier and the harness's CPU
stand-in (`emulate`) and the CUDA harness (`apply_real`) must agree on what CCE keeps alive. CCE needs Triton and a CUDA GPU, so
the trace tier runs `LinearCrossEntropy` below: plain torch ops that allocate, save and free
what the kernels do, not their values. Sources: apple/ml-cross-entropy `cut_cross_entropy/`
(`cce.py`, `cce_lse_forward.py`, `cce_backward.py`, `utils.py`, `linear_cross_entropy.py`)
and axolotl's fork of it (axolotl-ai-cloud/ml-cross-entropy, the package axolotl's
`cut_cross_entropy` plugin installs: `transformers/llava.py`, `transformers/utils.py`).

What CCE keeps (`cce_forward` of the patch: in training with labels, `apply_lce(hidden_states,
lm_head.weight, labels, shift=True)`, no logits returned):

- valids (`utils.py` `_build_flat_valids`, shift 1): `(targets[..., 1:] != ignore).nonzero()`
  (int64, N x 2), `.to(int32)`, row offsets multiplied in place, `.sum(1)` (int64, N): the
  flat indices of the N = b x (s - 1) counted tokens, saved for backward.
- forward (`cce.py` `LinearCrossEntropyFunction.forward`, `cce_lse_forward.py`
  `cce_lse_forward_kernel`): `lse` (N, fp32), `locks` (cdiv(N, 128), uint32, freed on return),
  `logit_avg` (V, fp32; when e or c needs a grad and `filter_eps` is set: default "auto");
  `indexed_neg_dot_forward_kernel` -> neg_dot (N, fp32), `nll = neg_dot.add_(lse)` in place,
  the mean. No (N, V) logits. Saved: e, c, bias, lse, targets, valids, logit_avg.
- backward (`cce.py` `backward`: `sort_logit_avg` = `argsort(logit_avg).to(int32)`;
  `cce_backward.py` `cce_backward_kernel`): `de = zeros_like(e)` (e's dtype; fp32 only with
  `accum_e_fp32`, off by default) if e needs a grad, `dc = zeros_like(c)` if c does, de_locks
  (cdiv(N, 128) x cdiv(H, 64), int32), dc_locks (cdiv(V, 128) x cdiv(H, 64), int32).
  `cce_backward_kernel` asserts e and c are fp16 / bf16: fp32 weights (fp32, *-mixed) are
  refused here.
"""
from __future__ import annotations

from types import MethodType

from hybridmem.errors import SpecError
from hybridmem.job.precision import POLICIES
from hybridmem.techniques.kernels import IGNORE_INDEX
from hybridmem.techniques.protocol import Target, adapts_lm_head

# Which model types the CCE patch handles with a plain `lm_head` (no softcap) is their family
# records' (`Family.techniques` "cce": apple's `transformers/patch.py` `cce_patch` (llama,
# mistral) and axolotl's fork (qwen2, llava, whose `cce_forward` reads `self.lm_head.weight`
# of the LLaVA model)); the refusal names them (`Target.listed`).
LOCK_ROWS = 128   # `triton.cdiv(B, 128)` locks (cce_lse_forward_kernel, cce_backward_kernel)
LOCK_COLS = 64    # `nd_locks = triton.cdiv(c.size(1), 64)` (cce_backward_kernel)
INT64, INT32, FP32, BOOL = 8, 4, 4, 1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_model(target: Target) -> None:
    """A model the patch handles (its family record lists `cce`); others are a one-line
    SpecError (apple's `cce_patch` raises "Unknown model type" for types it does not list)."""
    if NAME in target.priced:
        return
    raise SpecError("cut_cross_entropy", True,
                    [f"model_type {t}" for t in target.listed.get(NAME, ())],
                    reason=f"Cut Cross-Entropy for {target.patched or target.model_type!r} "
                    "is not priced")


def cce_head_tensors(b: int, s: int, h: int, v: int, e_bytes: int, need_e: bool,
                 need_c: bool) -> dict[str, list[tuple[int, int]]]:
    """(numel, bytes per element) of what the CCE loss allocates for a b x s batch, hidden
    size h, vocab v, e (the hidden states) in `e_bytes`, every shifted label counted:
    `saved` (made in the forward, kept for backward; e itself is the norm's output, saved
    here), `fwd` (forward transients, their high point: nonzero's int64 and its int32 cast),
    `bwd` (backward transients beside `dc`, which becomes lm_head's .grad)."""
    n = b * (s - 1)
    grads = need_e or need_c
    saved = [(b * s * h, e_bytes), (n, INT64), (n, FP32)] + ([(v, FP32)] if grads else [])
    fwd = [(2 * n, INT64), (2 * n, INT32)]
    bwd = ([(v, INT32)] if grads else []) + (
        [(b * s * h, e_bytes), (cdiv(n, LOCK_ROWS) * cdiv(h, LOCK_COLS), INT32)]
        if need_e else []) + ([(cdiv(v, LOCK_ROWS) * cdiv(h, LOCK_COLS), INT32)]
                              if need_c else [])
    return {"saved": saved, "fwd": fwd, "bwd": bwd}



NAME = "cce"
AXIS = "loss"
FLAG = "cut_cross_entropy"
OBJECTIVES: tuple[str, ...] = ("sft",)  # priced with the LM loss only


def active(spec) -> bool:
    return bool(spec.cut_cross_entropy)


def check(spec) -> None:
    """LoRA / modules_to_save on lm_head (the patch reads `lm_head.weight` directly); fp32
    weights (`cce_backward_kernel` asserts fp16 / bf16)."""
    if not isinstance(spec.cut_cross_entropy, bool):
        raise SpecError("cut_cross_entropy", spec.cut_cross_entropy, [True, False])
    if not spec.cut_cross_entropy:
        return
    if POLICIES[spec.precision].param_bytes != 2:
        raise SpecError("precision", spec.precision,
                        [p for p, pol in POLICIES.items() if pol.param_bytes == 2],
                        reason="Cut Cross-Entropy's backward needs fp16 / bf16 weights and "
                        "hidden states (cce_backward_kernel asserts it)")
    if adapts_lm_head(spec):
        raise SpecError("cut_cross_entropy", True, [False], reason="CCE reads lm_head.weight "
                        "directly: LoRA / modules_to_save on lm_head is bypassed")


def applies(target: Target) -> bool:
    check_model(target)  # a model the patch does not list: a SpecError
    return True


def kept_logits(spec, b: int, s: int, vocab: int, e: int) -> list[tuple[int, int]] | None:
    return []  # `cce_forward`: no logits


def head_tensors(d: dict, c, need_in: bool, need_w: bool) -> dict[str, list[tuple[int, int]]]:
    """lm_head + loss under Cut Cross-Entropy (`cce_head_tensors`; the module docstring cites the
    kernels): the head's input (e) and valids, lse, logit_avg saved; no logits; the forward's
    high point is the valids' nonzero output beside its int32 cast; the backward makes e's
    grad, the locks and the vocab ordering, and lm_head's grad when it trains."""
    return cce_head_tensors(d["b"], d["s"], d["h"], d["vocab"], c.e, need_in, need_w)


def note(spec, model_type: str, applies: bool) -> str | None:
    return ("cut_cross_entropy: no logits; lse, logit_avg and the counted tokens' indices "
            "saved, as cut-cross-entropy's kernels allocate (docs/loss.md)")


def install(model, spec, target: Target) -> str | None:
    emulate(model, target)
    return None


def apply_real(model, spec) -> None:
    apply_cce(model)


# ------------------------------------------------------------------ emulation (torch)

def build_flat_valids(targets):
    """`utils.py` `_build_flat_valids(targets, ignore_index, shift=1)`, allocation for
    allocation. `nonzero` has a data-dependent size (no meta / fake kernel): its output is made
    at the size every counted label gives, as in the traced and the stand-in batches."""
    import torch

    shifted = targets[..., 1:]
    mask = shifted != IGNORE_INDEX
    nz = torch.empty((mask.numel(), shifted.ndim), dtype=torch.int64, device=targets.device)
    del mask
    valids = nz.to(torch.int32)
    del nz
    for i in range(shifted.ndim - 1):
        valids[:, i] *= shifted.stride(i)
    return valids.sum(1)


def _linear_cross_entropy_class():
    import torch

    class LinearCrossEntropy(torch.autograd.Function):
        """`LinearCrossEntropyFunction` (cce.py), reduction "mean", filter_eps "auto", no
        bias, no vocab parallelism: the tensors of `cce_lse_forward_kernel`,
        `indexed_neg_dot_forward_kernel` and `cce_backward_kernel` (module docstring)."""

        @staticmethod
        def forward(ctx, e, c, targets, valids):
            n, v, dev = valids.numel(), c.shape[0], e.device
            lse = torch.full((n,), float("-inf"), dtype=torch.float32, device=dev)
            locks = torch.zeros((cdiv(n, LOCK_ROWS),), dtype=torch.int32, device=dev)
            grads = e.requires_grad or c.requires_grad
            logit_avg = torch.zeros((v,), dtype=torch.float32, device=dev) if grads else None
            del locks  # freed when cce_lse_forward_kernel returns
            neg_dot = torch.zeros((n,), dtype=torch.float32, device=dev)
            nll = neg_dot.add_(lse.clamp_min_(0.0))  # lse of -inf rows would poison the mean
            loss = nll.mean()
            ctx.save_for_backward(e, c, lse, targets, valids, logit_avg)
            return loss

        @staticmethod
        def backward(ctx, grad_out):
            e, c, lse, _targets, valids, logit_avg = ctx.saved_tensors
            order = torch.argsort(logit_avg).to(torch.int32) if logit_avg is not None else None
            n, h = valids.numel(), e.shape[1]
            de = torch.zeros_like(e) if ctx.needs_input_grad[0] else None
            dc = torch.zeros_like(c) if ctx.needs_input_grad[1] else None
            de_locks = torch.zeros((cdiv(n, LOCK_ROWS), cdiv(h, LOCK_COLS)), dtype=torch.int32,
                                   device=e.device) if de is not None else None
            dc_locks = torch.zeros((cdiv(c.shape[0], LOCK_ROWS), cdiv(h, LOCK_COLS)),
                                   dtype=torch.int32, device=e.device) if dc is not None else None
            del order, de_locks, dc_locks
            return de, dc, None, None

    return LinearCrossEntropy


def linear_cross_entropy(e, c, labels):
    """`apply_lce` -> `cce_linear_cross_entropy(e, c, labels, shift=1)` (cce.py): e made
    contiguous and flattened, the valids built, the labels flattened (a view)."""
    e = e.contiguous()
    targets = labels.contiguous()
    valids = build_flat_valids(targets)
    return _linear_cross_entropy_class().apply(e.flatten(0, -2), c, targets.flatten(), valids)


def cce_forward(self, input_ids=None, labels=None, **kwargs):
    """The patch's `cce_forward` (axolotl fork `transformers/llava.py`, apple
    `transformers/llama.py`): in training with labels the hidden states go to CCE with
    `lm_head.weight`; no logits."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    outputs = self.model(input_ids=input_ids, **kwargs)
    hidden = outputs[0]
    if self.training and labels is not None:
        loss = linear_cross_entropy(hidden, self.lm_head.weight, labels)
        return CausalLMOutputWithPast(loss=loss, logits=None)
    return CausalLMOutputWithPast(loss=None, logits=self.lm_head(hidden))


def emulate(model, target: Target) -> None:
    """The emulated patch on the PEFT-unwrapped instance (trace tier, CPU stand-in)."""
    check_model(target)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.forward = MethodType(cce_forward, base)


def apply_cce(model) -> None:
    """On CUDA: `cut_cross_entropy.transformers.cce_patch(model)` on the PEFT-unwrapped
    instance, as axolotl's CCE plugin patches the model it loads (impl "cce")."""
    try:
        from cut_cross_entropy.transformers import cce_patch
    except ImportError as err:
        raise ImportError(f"--cut-cross-entropy needs cut-cross-entropy on the GPU machine "
                          f"(pip install cut-cross-entropy): {err}") from err
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cce_patch(base)
