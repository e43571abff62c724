"""Every optimizer a spec can name, owned once: state layout, step temporaries, constructor, names.

Each `Rule` answers, for one optimizer, what every tier needs:

- `state(s)`: the allocations (elements, itemsize) of the state of one stepped tensor `s` that go
  through PyTorch's caching allocator; valid for a model tensor and for one flat 1-D ZeRO
  partition alike (a 1-D tensor: e.g. Adafactor is unfactored on it);
- `paged_state(s)`: state in CUDA unified memory (bitsandbytes `paged_*`), outside the
  allocator: not in `memory_allocated`/`reserved`, resident on the device until the driver pages
  it out under pressure (docs/design.md, "Optimizers");
- `shared(stepped)`: state shared by all tensors (bitsandbytes' quantisation maps);
- `temporary(stepped, size)`: the peak of the step's short-lived tensors over the stepped tensors
  (foreach vs per-tensor rules), each priced by `size(elements, itemsize)`;
  `temporary_stream(stepped, size)`: the same tensors as an alloc/free order for the allocator
  replay (a rule that keeps only its peak gives it as one block, priced by `size`);
- `build(params, cuda)`: the torch optimizer: the real library on CUDA (bitsandbytes imported
  lazily), the layout emulations below on CPU / meta tensors (trace tier, harness stand-in);
- `hf`: the TrainingArguments `optim` names (transformers 5.x `OptimizerNames`,
  `trainer_optimizer.py`) that build it.

The analytic tier (`analytic/states.py`, `events.py`), the per-rank layer
(`parallel/sharding.py`), the trace tier (`trace/optimizers.py`) and the harness
(`harness/workload.py`) read these rules; none keeps its own copy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hybridmem.errors import SpecError

FP32 = 4
BF16 = 2
LR = 1e-5  # any value; learning rates change no memory
# bitsandbytes/optim/optimizer.py (0.48): `Optimizer8bit.__init__` / `Optimizer2State` defaults
BNB_MIN_8BIT = 4096   # `min_8bit_size`: smaller tensors keep fp32 states
BNB_BLOCK = 256       # `init_state`: block_wise absmax per 256 elements
BNB_QMAP = 256        # `F.create_dynamic_map`: 256 fp32 entries per map
BNB_PAGED_MIN = 100_000  # `get_state_buffer`: `if not self.is_paged or p.numel() < 1e5`: device

Alloc = tuple[int, int]
"""(elements, itemsize) of one allocation."""
Size = Callable[[int, int], int]
"""Bytes of one allocation of (elements, itemsize): raw, or 512 B-rounded (`allocator.alloc.t`);
the caller chooses, so the job layer keeps no allocator rule."""


def raw(numel: int, itemsize: int) -> int:
    return numel * itemsize



class LoopLocals:
    """The loop locals of an optimizer's per-tensor `step` (Python names bound one tensor at a
    time): a tensor lives until its name is bound again, so the previous tensor's stays alive
    while the next one is made; `peak` is the most bytes alive at once."""

    def __init__(self) -> None:
        self.local: dict[str, int] = {}
        self.peak = 0

    def touch(self, nbytes: int, *alongside: int) -> None:
        """A temporary of `nbytes` made (and dropped) while the locals and `alongside` live."""
        self.peak = max(self.peak, sum(self.local.values()) + nbytes + sum(alongside))

    def bind(self, name: str, nbytes: int, *alongside: int) -> None:
        """`name = <new tensor of nbytes>`, made while `alongside` are alive; then the old dies."""
        self.touch(nbytes, *alongside)
        self.local[name] = nbytes

    def drop(self, name: str) -> None:
        """`name` rebound to a tensor that is not new (e.g. `grad = p.grad`)."""
        self.local[name] = 0

@dataclass(frozen=True, slots=True)
class Stepped:
    """One tensor the optimizer steps (a parameter, its fp32 master copy, or a flat partition)."""

    numel: int
    shape: tuple[int, ...]
    state: int
    """Itemsize of the stepped tensor (and its grad): the fp32 master under bf16-master."""
    lora_b: bool = False
    """A LoRA B matrix (out x r): LoRA-FA projects its gradient (`lorafa_temporary`)."""


def flat(numel: int, itemsize: int = FP32) -> Stepped:
    """One flat 1-D partition (DeepSpeed ZeRO `single_partition_of_fp32_groups`)."""
    return Stepped(numel, (numel,), itemsize)


@dataclass(frozen=True)
class Rule:
    """Base: no state, no temporaries (plain SGD). Subclasses override what differs."""

    name: str
    summary: str
    """One line for `--optimizer` help and the docs: what it is and where it comes from."""
    hf: tuple[str, ...] = ()
    host_keys: tuple[str, ...] = ()
    """State entries that live on the host on CUDA (no device memory)."""
    paged: bool = False
    """bitsandbytes `is_paged`: large states in CUDA unified memory (`paged_state`)."""
    trains: str | None = None
    """The only `train` mode it exists for (LoRA-FA: 'lora')."""

    def state(self, s: Stepped) -> list[Alloc]:
        return []

    def paged_state(self, s: Stepped) -> list[Alloc]:
        return []

    def shared(self, stepped: Sequence[Stepped]) -> list[Alloc]:
        return []

    def temporary(self, stepped: Sequence[Stepped], size: Size = raw) -> int:
        """Peak bytes of the step's temporaries; by default the largest group of the stream."""
        return max((sum(size(*a) for a in group)
                    for group in self.temporary_stream(stepped, size)), default=0)

    def temporary_stream(self, stepped: Sequence[Stepped], size: Size) -> list[list[Alloc]]:
        """Groups allocated together and freed before the next group (in step order); `size`
        prices a rule's peak given as one block (`(bytes, 1)`)."""
        return []

    def build(self, params: list, cuda: bool):
        raise NotImplementedError(self.name)


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


# --- layout emulations (CPU / meta tensors: trace tier, harness CPU stand-in) -----------------


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


# --- the registry -----------------------------------------------------------------------------

_RULES: tuple[Rule, ...] = (
    AdamW("adamw", "torch foreach AdamW (the CUDA default)", hf=("adamw_torch",),
          host_keys=("step",)),
    AdamW("adamw-fused", "torch fused AdamW", hf=("adamw_torch_fused",), fused=True),
    Bnb("adamw-8bit", "bitsandbytes AdamW8bit", hf=("adamw_bnb_8bit", "adamw_8bit"), bits=8),
    Bnb("paged-adamw-8bit", "bitsandbytes PagedAdamW8bit (states in unified memory)",
        hf=("paged_adamw_8bit",), bits=8, paged=True),
    Bnb("paged-adamw", "bitsandbytes PagedAdamW32bit (fp32 states in unified memory)",
        hf=("paged_adamw_32bit",), bits=32, paged=True),
    SGD("sgd", "torch SGD, no momentum", hf=("sgd",)),
    SGD("sgd-momentum", "torch SGD with momentum", momentum=0.9),
    TorchAdafactor("adafactor", "torch.optim.Adafactor (foreach)", host_keys=("step",)),
    HFAdafactor("hf-adafactor", "transformers' Adafactor (TrainingArguments optim=adafactor)",
                hf=("adafactor",)),
    LionPytorch("lion", "Lion as lucidrains/lion-pytorch"),
    Bnb("lion-32bit", "bitsandbytes Lion (fp32 state)", hf=("lion_32bit",), algo="lion",
        bits=32),
    Bnb("lion-8bit", "bitsandbytes Lion8bit", hf=("lion_8bit",), algo="lion", bits=8),
    Bnb("paged-lion", "bitsandbytes PagedLion (fp32 state in unified memory)",
        hf=("paged_lion_32bit",), algo="lion", bits=32, paged=True),
    Bnb("paged-lion-8bit", "bitsandbytes PagedLion8bit", hf=("paged_lion_8bit",), algo="lion",
        bits=8, paged=True),
    LoraFA("lora-fa", "peft LoRA-FA (train=lora only)", trains="lora"),
)
OPTIMIZERS: dict[str, Rule] = {r.name: r for r in _RULES}
"""Our optimizer names (`TrainingSpec.optimizer`, `--optimizer`) -> their rule."""

HF_OPTIMS: dict[str, str] = {hf: r.name for r in _RULES for hf in r.hf}
"""TrainingArguments `optim` -> our optimizer name."""
# transformers 5.x default `optim` (training_args.py: adamw_torch_fused for torch >= 2.8)
HF_DEFAULT_OPTIM = "adamw_torch_fused"
# `OptimizerNames` the trainer builds from packages we cannot price soundly here: GaLore needs
# `galore-torch` (trainer_optimizer.py `_get_galore_optimizer`), whose projector layout we have
# not read against its source; refused in one line (docs/design.md, "Optimizers")
HF_REFUSED: dict[str, str] = {
    name: "GaLore (galore-torch) is not priced" for name in (
        "galore_adamw", "galore_adamw_8bit", "galore_adafactor", "galore_adamw_layerwise",
        "galore_adamw_8bit_layerwise", "galore_adafactor_layerwise")}


def rule(name: str) -> Rule:
    """The rule of optimizer `name`; a SpecError naming the valid ones otherwise."""
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise SpecError("optimizer", name, tuple(OPTIMIZERS)) from None


def from_hf(optim: str, optim_args: str | None = None, field_name: str = "training_args.optim"
            ) -> str:
    """Our optimizer name for TrainingArguments `optim` (+ `optim_args`, "k=v,k=v" as
    trainer_optimizer.py `_parse_optim_args` reads it: `sgd` with `momentum` > 0 is our
    `sgd-momentum`, `_get_sgd`)."""
    if optim in HF_REFUSED:
        raise SpecError(field_name, optim, sorted(HF_OPTIMS), reason=HF_REFUSED[optim])
    if optim not in HF_OPTIMS:
        raise SpecError(field_name, optim, sorted(HF_OPTIMS))
    name = HF_OPTIMS[optim]
    if name == "sgd" and optim_args:
        args = dict(kv.split("=", 1) for kv in optim_args.replace(" ", "").split(",") if "=" in kv)
        try:
            momentum = float(args.get("momentum", 0))
        except ValueError:
            raise SpecError("training_args.optim_args", optim_args,
                            reason="momentum must be a number") from None
        if momentum:  # the value changes no memory
            return "sgd-momentum"
    return name


def stepped_sizes(name: str, stepped: Sequence[Stepped], size: Size = raw) -> dict[str, int]:
    """Bytes of one optimizer over `stepped`: device state, paged state, shared, temporary."""
    r = rule(name)
    return {"state": sum(size(*a) for s in stepped for a in r.state(s)),
            "paged": sum(raw(*a) for s in stepped for a in r.paged_state(s)),
            "shared": sum(size(*a) for a in r.shared(stepped)),
            "temporary": r.temporary(stepped, size)}


def paged_notes(paged: int) -> tuple[str, ...]:
    """The note every tier gives a job with paged optimizer state."""
    if not paged:
        return ()
    return (f"paged optimizer state: {paged / 2**30:.2f} GiB in CUDA unified memory "
            "(bitsandbytes paged_*, cudaMallocManaged), outside PyTorch's allocator: not in "
            "allocated/reserved, in context and the device peak while resident; the driver "
            "pages it to host memory under pressure instead of OOM, so the fit verdict does not "
            "count it",)


__all__ = ["OPTIMIZERS", "HF_OPTIMS", "HF_DEFAULT_OPTIM", "Rule", "Stepped", "flat", "from_hf",
           "rule", "raw", "stepped_sizes", "lorafa_temporary", "paged_notes"]
