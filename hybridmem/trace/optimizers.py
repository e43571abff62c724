"""Optimizers as PyTorch (or the library users use) would configure them on CUDA.

torch's AdamW/SGD/Adafactor run as they are; `fused=True` AdamW has a CPU kernel with the
same in-place memory behaviour as the CUDA one. Lion and bitsandbytes' 8-bit AdamW have no
torch implementation, so they are emulated by their state layout (see each class). LoRA-FA is
peft's own optimizer, built from the PeftModel (`make_lorafa`).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.optim import Optimizer

from hybridmem.errors import SpecError
from hybridmem.spec import OPTIMIZERS

LR = 1e-5  # any value; learning rates change no memory
# any value > 0: LoRA-FA's decoupled decay `B.add_(B, alpha=...)` is in place (the peft
# MetaMathQA lorafa experiment uses 0.1); > 0 runs the same code path as that run
WEIGHT_DECAY = 0.1


class Lion(Optimizer):
    """Lion (Chen et al. 2023, arXiv 2302.06675, Alg. 2) as lucidrains/lion-pytorch writes it.

    One state tensor (`exp_avg`) per parameter; the update makes one param-sized temporary
    per parameter at a time (`exp_avg.clone().mul_(b1).add(grad, alpha=1-b1)`), no foreach.
    """

    def __init__(self, params, lr: float = LR, betas=(0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg.clone().mul_(b1).add(p.grad, alpha=1 - b1).sign_()
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(b2).add_(p.grad, alpha=1 - b2)


class AdamW8bitLayout(Optimizer):
    """Memory layout of bitsandbytes `AdamW8bit` (bitsandbytes/optim/optimizer.py, 0.4x).

    Parameters with >= `min_8bit_size` (4096) elements keep `state1`/`state2` as uint8 plus
    one fp32 `absmax` per 256-element block (blockwise quantisation, `blocksize=256`);
    smaller ones keep fp32 states; two 256-entry fp32 quantisation maps (`qmap1`, `qmap2`,
    `F.create_dynamic_map`) are shared by all tensors. The update is one fused in-place kernel,
    so no temporaries.
    """

    MIN_8BIT_SIZE = 4096  # bnb Optimizer8bit default `min_8bit_size=4096`
    BLOCK = 256  # bnb `get_state_buffer`/`F.quantize_blockwise` blocksize for 8-bit states

    def __init__(self, params, lr: float = LR):
        super().__init__(params, {"lr": lr})
        self.qmaps: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    if p.numel() >= self.MIN_8BIT_SIZE:
                        if not self.qmaps:
                            self.qmaps = [torch.zeros(256, dtype=torch.float32) for _ in range(2)]
                        blocks = -(-p.numel() // self.BLOCK)
                        for k in ("state1", "state2"):
                            state[k] = torch.zeros_like(p, dtype=torch.uint8)
                        for k in ("absmax1", "absmax2"):
                            state[k] = torch.zeros(blocks, dtype=torch.float32)
                    else:
                        for k in ("state1", "state2"):
                            state[k] = torch.zeros_like(p, dtype=torch.float32)
                p.add_(p.grad, alpha=-group["lr"])


def make_optimizer(name: str, params: list[torch.Tensor]) -> Optimizer:
    """The optimizer `name` over `params`, configured as on CUDA."""
    if name == "adamw":
        # torch picks foreach on CUDA (`_default_to_fused_or_foreach`); CPU would not, so force it.
        return torch.optim.AdamW(params, lr=LR, foreach=True)
    if name == "adamw-fused":
        if params and params[0].is_meta:  # torch refuses fused on meta; see `fused_on_meta`
            opt = torch.optim.AdamW(params, lr=LR, foreach=False)
            for group in opt.param_groups:
                group["fused"] = True
            return opt
        return torch.optim.AdamW(params, lr=LR, fused=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR, foreach=True)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=LR, momentum=0.9, foreach=True)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=LR, foreach=True)
    if name == "lion":
        return Lion(params)
    if name == "adamw-8bit":
        return AdamW8bitLayout(params)
    if name == "lora-fa":
        raise SpecError("optimizer", name, reason="built from the PeftModel: make_lorafa(model)")
    raise SpecError("optimizer", name, OPTIMIZERS)


def make_lorafa(model, lora) -> Optimizer:
    """peft's `create_lorafa_optimizer(model, r, lora_alpha, lr, weight_decay)` (peft
    optimizers/lorafa.py), whose step runs as on a bf16-capable CUDA GPU (`lorafa_as_on_cuda`).

    It sets `requires_grad_(False)` on every lora_A, so call it before collecting the trainable
    parameters. Its one param group holds every named parameter (frozen ones are skipped in the
    step: no grad); its state is keyed by name (`...q_proj.lora` for an A/B pair)."""
    from peft.optimizers import create_lorafa_optimizer

    opt = create_lorafa_optimizer(model, r=lora.r, lora_alpha=lora.alpha, lr=LR,
                                  weight_decay=WEIGHT_DECAY)
    step = opt.step

    @functools.wraps(step)
    def step_as_on_cuda(*args, **kwargs):
        with lorafa_as_on_cuda(opt):
            return step(*args, **kwargs)

    opt.step = step_as_on_cuda
    return opt


@contextlib.contextmanager
def lorafa_as_on_cuda(opt: Optimizer):
    """LoRA-FA's gradient projection runs under `autocast(infer_device(), bfloat16)` when
    `is_bf16_available()` (lorafa.py `step`): on a CUDA GPU (Ampere or newer) a bf16 product
    of bf16 casts. Here: bf16 is available, the device is the CPU (CPU autocast casts the
    fake / real CPU tensors the same way: `mm` is lower-precision on both), and on meta tensors,
    which no autocast touches, CUDA's policy is emulated (`autocast.CudaAutocast`)."""
    from peft.optimizers import lorafa

    saved = lorafa.infer_device, lorafa.is_bf16_available, lorafa.autocast
    meta = any(p.is_meta for g in opt.param_groups for p in g["params"])

    @contextlib.contextmanager
    def emulated(device_type=None, dtype=torch.bfloat16, **_):
        from hybridmem.trace.autocast import CudaAutocast

        mode = CudaAutocast(dtype)
        with mode, mode.region(True):
            yield

    lorafa.infer_device = lambda: "cpu"
    lorafa.is_bf16_available = lambda *a, **k: True
    if meta:
        lorafa.autocast = emulated
    try:
        yield
    finally:
        lorafa.infer_device, lorafa.is_bf16_available, lorafa.autocast = saved


@contextlib.contextmanager
def fused_on_meta():
    """Let fused AdamW step meta tensors: `_fused_adamw_` has a meta kernel, only the Python
    device check (torch/optim/optimizer.py `_device_dtype_check_for_fused`) refuses them."""
    from torch.optim import adam

    check = adam._device_dtype_check_for_fused

    def meta_ok(p, *args, **kwargs):
        return None if p.is_meta else check(p, *args, **kwargs)

    adam._device_dtype_check_for_fused = meta_ok
    try:
        yield
    finally:
        adam._device_dtype_check_for_fused = check


def host_state_keys(opt: Optimizer) -> tuple[str, ...]:
    """State entries that live on the host on CUDA, so take no device memory.

    torch/optim/adam(w).py `_init_group`: `step` is a CPU scalar unless `capturable` or
    `fused` (`torch.tensor(0.0, dtype=_get_scalar_dtype())` with no device). Adafactor
    likewise keeps `step` on the host (torch/optim/_adafactor.py `_init_group`).
    Optimizer-in-backward's per-parameter optimizers (`job.optim_in_backward.InBackward`) share
    one class and settings: the first answers for all.
    """
    opt = getattr(opt, "first", opt)
    if isinstance(opt, (torch.optim.AdamW, torch.optim.Adam)):
        group = opt.param_groups[0]
        return () if (group.get("fused") or group.get("capturable")) else ("step",)
    if isinstance(opt, torch.optim.Adafactor):
        return ("step",)
    if isinstance(opt, AdamW8bitLayout):
        return ("step",)  # bnb keeps `step` as a Python int in state
    return ()
