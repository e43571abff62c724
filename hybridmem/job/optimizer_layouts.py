"""The optimizers' state layouts as torch optimizers on CPU / meta tensors, where the real
library cannot run (the trace tier, the harness's CPU stand-in): Lion as lucidrains/lion-pytorch
writes it, and bitsandbytes' 8-bit / 32-bit / paged state layout.

Why its own module: the rules (`optimizer_kinds.py`) build these only off CUDA; what a layout
allocates is the rule's (`optimizer_rule.py` constants), read here from one place.
"""

from __future__ import annotations

from hybridmem.job.optimizer_rule import (
    BNB_BLOCK, BNB_MIN_8BIT, BNB_PAGED_MIN, BNB_QMAP, LR,
)


def lion_pytorch(params):
    """lucidrains/lion-pytorch `Lion` (pure torch, so the same code on CUDA and CPU)."""
    import torch
    from torch.optim import Optimizer

    class Lion(Optimizer):
        """lion_pytorch.py `Lion.step` / `update_fn`, weight decay 0."""

        def __init__(self, params, lr=LR, betas=(0.9, 0.99), weight_decay=0.0):
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

    return Lion(params)


def BnbLayout(params, n_states: int, bits: int, paged: bool):  # noqa: N802 - a class factory
    """Memory layout of a bitsandbytes optimizer without its CUDA kernels, written after
    bitsandbytes/optim/optimizer.py `init_state` / `get_state_buffer` (see `Bnb`): the
    states, absmax and qmaps it allocates, and its paged states listed in `paged` (bnb keeps
    them in `page_mng.paged_tensors`), which the trace tier keeps out of the allocator stream.
    The update is in place (the fused kernel's effect on memory: none)."""
    import torch
    from torch.optim import Optimizer

    class Layout(Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": LR})
            self.qmaps: list[torch.Tensor] = []
            self.paged: list[torch.Tensor] = []

        def _buffer(self, p, dtype):  # `get_state_buffer`
            buf = torch.zeros_like(p, dtype=dtype)
            if paged and p.numel() >= BNB_PAGED_MIN:
                self.paged.append(buf)
            return buf

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if not state:
                        eight = bits == 8 and p.numel() >= BNB_MIN_8BIT
                        keys = ("state1", "state2")[:n_states]
                        if eight and not self.qmaps:  # `fill_qmap` + `.to(p.device)`
                            self.qmaps = [torch.zeros(BNB_QMAP, dtype=torch.float32,
                                                      device=p.device) for _ in keys]
                        for k in keys:
                            state[k] = self._buffer(p, torch.uint8 if eight else torch.float32)
                        if eight:
                            blocks = -(-p.numel() // BNB_BLOCK)
                            for i in range(n_states):
                                state[f"absmax{i + 1}"] = torch.zeros(
                                    blocks, dtype=torch.float32, device=p.device)
                    p.add_(p.grad, alpha=-group["lr"])

    return Layout(params)
