"""The optimizer rule's shape, shared by every optimizer (`job/optimizers.py` is the registry):
what one optimizer answers for the tiers (state, paged state, shared state, step temporaries and
their alloc/free order, its torch constructor, its TrainingArguments names), and the sizes and
library defaults the rules read.

Why its own module: the rules per library (`optimizer_kinds.py`), their CPU / meta layouts
(`optimizer_layouts.py`) and the registry all build on it, and none on each other's internals.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
