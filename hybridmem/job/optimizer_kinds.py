"""Every optimizer's rule, by library: torch.optim (AdamW, SGD, Adafactor), transformers'
Adafactor, Lion (lucidrains/lion-pytorch), bitsandbytes (8-bit, 32-bit, paged) and peft's LoRA-FA.
Each is a `Rule` (`optimizer_rule.py`); the registry (`optimizers.py`) names the instances.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hybridmem.errors import SpecError
from hybridmem.job.optimizer_layouts import BnbLayout, lion_pytorch
from hybridmem.job.optimizer_rule import (
    BF16, BNB_BLOCK, BNB_MIN_8BIT, BNB_PAGED_MIN, BNB_QMAP, FP32, LR, Alloc, LoopLocals, Rule,
    Size, Stepped, flat, raw,
)

# --- torch.optim ------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdamW(Rule):
    """torch.optim.AdamW (torch/optim/adam.py `_init_group`): exp_avg + exp_avg_sq
    (`zeros_like(p)`); `step` a CPU scalar unless fused/capturable, where it is a 4-byte device
    scalar per tensor. foreach (`_multi_tensor_adam`): `exp_avg_sq_sqrt =
    torch._foreach_sqrt(exp_avg_sqs)` is a new list sized like one state, per (device, dtype)
    group (`_group_tensors_by_device_and_dtype`, first-seen order), the groups' lists alive
    together at the last one (the name is rebound); fused: in place, none."""

    fused: bool = False

    def state(self, s):
        return [(s.numel, s.state)] * 2 + ([(1, FP32)] if self.fused else [])

    def temporary(self, stepped, size=raw):
        return 0 if self.fused else sum(size(s.numel, s.state) for s in stepped)

    def temporary_stream(self, stepped, size):
        if self.fused:
            return []
        groups: dict[int, list[Alloc]] = {}
        for s in stepped:
            groups.setdefault(s.state, []).append((s.numel, s.state))
        return list(groups.values())

    def build(self, params, cuda):
        import torch

        if self.fused:
            return torch.optim.AdamW(params, lr=LR, fused=True)
        # torch picks foreach on CUDA (`_default_to_fused_or_foreach`); CPU would not: force it
        return torch.optim.AdamW(params, lr=LR, foreach=True)


@dataclass(frozen=True)
class SGD(Rule):
    """torch.optim.SGD (torch/optim/sgd.py): `momentum_buffer` (n, the param's dtype) with
    momentum > 0 (made from the first step's grad: `torch.clone(grad)`), none without; the
    foreach update works in place."""

    momentum: float = 0.0

    def state(self, s):
        return [(s.numel, s.state)] if self.momentum else []

    def build(self, params, cuda):
        import torch

        return torch.optim.SGD(params, lr=LR, momentum=self.momentum, foreach=True)


@dataclass(frozen=True)
class TorchAdafactor(Rule):
    """torch.optim.Adafactor (torch/optim/_adafactor.py `_init_group`): >= 2-D: row_var
    (shape[:-1]) + col_var (shape[:-2] + shape[-1:]), in the grad's dtype; 1-D: variance (n);
    CPU `step`. foreach (`_multi_tensor_adafactor`): `var_estimates = row_var @ col_var` is a
    full-size tensor per >= 2-D tensor, the whole group at once; the 1-D group's are smaller or
    freed before (the larger group sets the peak)."""

    def state(self, s):
        if len(s.shape) >= 2:
            return [(math.prod(s.shape[:-1]), s.state),
                    (math.prod(s.shape[:-2]) * s.shape[-1], s.state)]
        return [(s.numel, s.state)]

    def temporary(self, stepped, size=raw):
        multi = sum(size(s.numel, s.state) for s in stepped if len(s.shape) >= 2)
        single = sum(size(s.numel, s.state) for s in stepped if len(s.shape) < 2)
        return max(multi, single)

    def temporary_stream(self, stepped, size):
        return [[(s.numel, s.state)] for s in stepped if len(s.shape) >= 2]

    def build(self, params, cuda):
        import torch

        return torch.optim.Adafactor(params, lr=1e-2, foreach=True)


@dataclass(frozen=True)
class HFAdafactor(Rule):
    """transformers' own `Adafactor` (transformers/optimization.py), what `optim="adafactor"`
    builds (trainer_optimizer.py `_get_adafactor`: scale_parameter=False, relative_step=False;
    beta1=None: no exp_avg). Differs from torch.optim.Adafactor: states fp32 whatever the
    param dtype (`torch.zeros(...).to(grad)` after `grad = grad.float()`), plus `state["RMS"] =
    self._rms(p_data_fp32)`, a 0-dim fp32 device tensor per tensor; factored iff >= 2-D:
    exp_avg_sq_row (shape[:-1]) + exp_avg_sq_col (shape[:-2] + shape[-1:]), else exp_avg_sq (n).
    The step is a per-tensor Python loop (`temporary`)."""

    def state(self, s):
        if len(s.shape) >= 2:
            rows, cols = math.prod(s.shape[:-1]), math.prod(s.shape[:-2]) * s.shape[-1]
            return [(rows, FP32), (cols, FP32), (1, FP32)]
        return [(s.numel, FP32), (1, FP32)]

    def temporary(self, stepped, size=raw):
        """Loop locals of `Adafactor.step`, one tensor at a time; each stays alive until its
        name is rebound for the next tensor: `grad = grad.float()` (16-bit grads), `p_data_fp32
        = p.float()` (16-bit params), `update = grad**2 + eps` (with the `grad**2` operand),
        factored: `update = torch.mul(r_factor, c_factor)` with the row / col factors, else
        `update = exp_avg_sq.rsqrt()`, and `p_data_fp32.add_(-update)` (`-update` a new one).
        0-dim norms (`_rms`) are left out."""
        loop = LoopLocals()
        for s in stepped:
            n4 = size(s.numel, FP32)
            low = s.state < FP32
            loop.drop("grad")  # `grad = p.grad` drops the previous fp32 copy
            if low:
                loop.bind("grad", n4)
            loop.drop("p32")
            if low:
                loop.bind("p32", n4)
            loop.bind("update", n4, n4)
            if len(s.shape) >= 2:
                rows, cols = math.prod(s.shape[:-1]), math.prod(s.shape[:-2]) * s.shape[-1]
                loop.bind("update", n4, size(rows, FP32), size(cols, FP32))
            else:
                loop.bind("update", n4)
            loop.touch(n4)  # -update
        return loop.peak

    def temporary_stream(self, stepped, size):
        return [[(self.temporary(stepped, size), 1)]] if stepped else []

    def build(self, params, cuda):
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=LR, scale_parameter=False, relative_step=False)


# --- Lion (lucidrains/lion-pytorch) -----------------------------------------------------------


@dataclass(frozen=True)
class LionPytorch(Rule):
    """Lion (Chen et al. 2023, arXiv 2302.06675, Alg. 2) as lucidrains/lion-pytorch
    `lion_pytorch.py` writes it: `exp_avg` (`zeros_like(p)`); `update_fn` per tensor:
    `exp_avg.clone().mul_(beta1).add(grad, alpha=1 - beta1)` makes two param-sized tensors
    (the clone, alive until `.add` returns, and its result), one tensor at a time: the largest
    tensor sets the peak. No foreach, so a flat ZeRO partition counts as one tensor."""

    def state(self, s):
        return [(s.numel, s.state)]

    def temporary_stream(self, stepped, size):
        return [[(s.numel, s.state)] * 2 for s in stepped]

    def build(self, params, cuda):
        return lion_pytorch(params)


# --- bitsandbytes -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Bnb(Rule):
    """bitsandbytes `Optimizer2State` (AdamW: state1 + state2) / `Optimizer1State` (Lion:
    state1), bitsandbytes/optim/optimizer.py `init_state` (0.48): `optim_bits` 32 -> fp32 states
    whatever the param dtype; 8 -> uint8 states plus one fp32 absmax per 256-element block
    (`block_wise`) and the `dynamic` (+ `udynamic` for AdamW) 256-entry fp32 qmaps moved to the
    device once, shared; tensors under `min_8bit_size` (4096) keep fp32 states. `is_paged`:
    `get_state_buffer` puts states of >= 1e5 elements in unified memory (`F.get_paged`,
    cudaMallocManaged), absmax stays on the device. `step` is a Python int; the update is one
    fused in-place kernel: no temporaries."""

    algo: str = "adam"
    """adam (two states) or lion (one)."""
    bits: int = 8

    @property
    def n_states(self) -> int:
        return 2 if self.algo == "adam" else 1

    def _eight_bit(self, s: Stepped) -> bool:
        return self.bits == 8 and s.numel >= BNB_MIN_8BIT

    def _on_device(self, s: Stepped) -> bool:
        return not self.paged or s.numel < BNB_PAGED_MIN

    def _states(self, s: Stepped) -> list[Alloc]:
        return [(s.numel, 1 if self._eight_bit(s) else FP32)] * self.n_states

    def state(self, s):
        absmax = [(-(-s.numel // BNB_BLOCK), FP32)] * self.n_states if self._eight_bit(s) else []
        return (self._states(s) if self._on_device(s) else []) + absmax

    def paged_state(self, s):
        return [] if self._on_device(s) else self._states(s)

    def shared(self, stepped):
        if self.bits == 8 and any(s.numel >= BNB_MIN_8BIT for s in stepped):
            return [(BNB_QMAP, FP32)] * self.n_states  # Lion moves only `dynamic`
        return []

    def build(self, params, cuda):
        if not cuda:
            return BnbLayout(params, self.n_states, self.bits, self.paged)
        try:
            import bitsandbytes as bnb
        except Exception as err:  # noqa: BLE001 - missing, or broken (e.g. its triton import)
            raise ImportError(f"optimizer {self.name!r} needs bitsandbytes, which does not "
                              f"import here ({type(err).__name__}: {err})") from err
        cls = bnb.optim.AdamW if self.algo == "adam" else bnb.optim.Lion
        return cls(params, lr=LR, optim_bits=self.bits, is_paged=self.paged)


# --- peft LoRA-FA -----------------------------------------------------------------------------

# any value > 0: LoRA-FA's decoupled decay `B.add_(B, alpha=...)` is in place, no memory; the
# peft MetaMathQA lorafa experiment (method_comparison/MetaMathQA) uses 0.1, and > 0 runs the
# same code path as that run
LORAFA_WEIGHT_DECAY = 0.1


@dataclass(frozen=True)
class LoraFA(Rule):
    """peft `LoraFAOptimizer` (peft/optimizers/lorafa.py, `create_lorafa_optimizer`):
    exp_avg_B + exp_avg_sq_B per lora_B (`zeros_like`; its lora_A is frozen: no grad, no
    state), exp_avg + exp_avg_sq per other trained tensor; `step` a Python int. Built from the
    PeftModel (`build_from_model`), by the trace tier and the harness alike."""

    def build_from_model(self, model, lora):
        """peft's `create_lorafa_optimizer(model, r, lora_alpha, lr, weight_decay)` over the
        PeftModel `model` with the spec's `lora` (r, alpha). It sets `requires_grad_(False)` on
        every lora_A, so build it before collecting the trainable parameters."""
        from peft.optimizers import create_lorafa_optimizer

        return create_lorafa_optimizer(model, r=lora.r, lora_alpha=lora.alpha, lr=LR,
                                       weight_decay=LORAFA_WEIGHT_DECAY)

    def state(self, s):
        return [(s.numel, s.state)] * 2

    def temporary(self, stepped, size=raw):
        return lorafa_temporary(stepped, size)

    def temporary_stream(self, stepped, size):  # r x r and out x r tensors: one block at their peak
        return [[(self.temporary(stepped, size), 1)]] if stepped else []

    def build(self, params, cuda):
        raise SpecError("optimizer", self.name, reason="built from the PeftModel: "
                        "build_from_model")


def lorafa_temporary(stepped: Sequence[Stepped], size: Size = raw) -> int:
    """Peak of the short-lived tensors of peft's `LoraFAOptimizer.step` (peft 0.21
    peft/optimizers/lorafa.py), one tensor at a time in `named_parameters()` order.

    Per lora_B (out x r, fp32 like its frozen lora_A): `AA_T = A @ A.T` (r x r);
    `pinv(AA_T + delta * eye(r).to(device))`: the fp32 eye, `delta * eye`, their sum, pinv's
    U, Vh and `Vh.mH * S` (r x r each; the SVD's solver workspace is left out) and the result
    `AA_T_inv`; under `autocast(bf16)` (taken when `is_bf16_available()`: Ampere or newer)
    `grad_B_orin @ AA_T_inv` casts both to bf16 and makes a bf16 (out x r) product, times a
    Python scalar another; `.to(B.grad.dtype)` the fp32 `grad_B`; `exp_avg_sq_B.sqrt()` the
    `denom_B`. Other tensors (AdamW branch): `denom = exp_avg_sq.sqrt()`. Each is a loop
    local: the previous tensor's stays alive until its name is bound again."""
    loop = LoopLocals()
    for s in stepped:
        if not s.lora_b:
            loop.bind("denom", size(s.numel, s.state))
            continue
        out, r = s.shape
        rr, half = size(r * r, FP32), size(out * r, BF16)
        loop.bind("AA_T", rr)
        loop.bind("AA_T_inv", rr, *[rr] * 4)          # sum, U, Vh, Vh.mH * S (eye freed by then)
        loop.bind("grad_B", half, half, size(r * r, BF16))  # the product, with the two bf16 casts
        loop.bind("grad_B", half, half)                  # scalar * product
        loop.bind("grad_B", size(out * r, s.state))      # .to(B.grad.dtype)
        loop.bind("denom_B", size(out * r, s.state))
    return loop.peak
