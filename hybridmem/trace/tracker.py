"""The storage tracker: every storage's birth and death, as the CUDA allocator would see it.

A `TorchDispatchMode` sees each op's outputs after autograd; a new untyped storage is a new
allocation, and a weakref finaliser on it marks its free (PyTorch keeps one Python object per
live storage, so the finaliser fires when the allocator would get the block back). Sizes are
rounded as `c10/cuda/CUDACachingAllocator.cpp::round_size` does (kMinBlockSize = 512).
Categories are labels set by the runner when it learns what a storage is (parameter, .grad,
optimizer state, saved for backward); anything never labelled is a temporary.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_iter
from torch.utils.weak import WeakIdKeyDictionary

from hybridmem.allocator.config import K_MIN_BLOCK_SIZE
from hybridmem.trace import metacache

# Label precedence: a storage that is both saved for backward and a parameter is a parameter.
RANK = {"param": 5, "workspace": 5, "host": 6, "paged": 6, "grad": 4, "optimizer": 3,
        "activation": 2,
        "temporary": 0}


# Labels of storages that CUDA would not place through PyTorch's caching allocator: host-side
# scalars, and bitsandbytes' paged state (cudaMallocManaged, `job.optimizers.Bnb`)
OFF_ALLOCATOR: frozenset[str] = frozenset({"host", "paged"})


def round_size(nbytes: int) -> int:
    """Bytes the CUDA caching allocator hands out for a request of `nbytes`.

    CUDACachingAllocator.cpp `round_size`: up to a multiple of kMinBlockSize (512; sizes below
    512 become 512), with the default `roundup_power2_divisions` (none).
    """
    return -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


@dataclass(slots=True)
class Storage:
    """One allocation: requested bytes, label, where and when it was born."""

    nbytes: int
    category: str
    part: str | None
    phase: str
    iteration: int
    birth: int
    death: int = -1
    op: object = None


class StorageTracker(TorchDispatchMode):
    """Records allocations/frees of every storage created while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: list[Storage] = []
        self.events: list[int] = []  # sid for a birth, ~sid for a death
        self.marks: list[tuple[int, str, int]] = []  # (event index, phase, iteration)
        self.empty_caches: list[int] = []  # event index before which empty_cache() ran
        self.phase, self.iteration = "setup", 0  # births before the first mark: model, batch
        self.part_stack: list[str | None] = [None]
        self._sid = WeakIdKeyDictionary()

    # -- recording -------------------------------------------------------------------------
    def track(self, storage: torch.UntypedStorage, category: str = "temporary") -> int | None:
        """Start following `storage` (no-op if already followed); returns its id."""
        sid = self._sid.get(storage)
        if sid is not None:
            self.label_sid(sid, category)
            return sid
        nbytes = storage.nbytes()
        if nbytes == 0:
            return None
        sid = len(self.storages)
        self.storages.append(Storage(nbytes, category, self.part_stack[-1], self.phase,
                                     self.iteration, len(self.events)))
        self.events.append(sid)
        self._sid[storage] = sid
        weakref.finalize(storage, self._free, sid)
        return sid

    def _free(self, sid: int) -> None:
        self.storages[sid].death = len(self.events)
        self.events.append(~sid)

    def label(self, tensor: torch.Tensor, category: str, part: str | None = None) -> None:
        """Label the storage behind `tensor` (tracking it if it predates the tracker)."""
        sid = self.track(tensor.untyped_storage(), category)
        if sid is not None and part is not None:
            self.storages[sid].part = part

    def category_of(self, tensor: torch.Tensor) -> str | None:
        """Label of the storage behind `tensor` (None if never tracked)."""
        sid = self._sid.get(tensor.untyped_storage())
        return None if sid is None else self.storages[sid].category

    def label_sid(self, sid: int, category: str) -> None:
        st = self.storages[sid]
        if RANK[category] > RANK[st.category]:
            st.category = category

    def mark(self, phase: str, iteration: int) -> None:
        """Phase boundary: later births belong to `phase` of `iteration`."""
        self.phase, self.iteration = phase, iteration
        self.marks.append((len(self.events), phase, iteration))

    def empty_cache(self) -> None:
        """`torch.cuda.empty_cache()` here: frees nothing a tensor holds (no event), but the
        allocator simulator returns its free cached segments at this point."""
        self.empty_caches.append(len(self.events))

    def add_external(self, nbytes: int, category: str) -> int:
        """An allocation no tensor stands for (e.g. a cuBLAS workspace), never freed."""
        sid = len(self.storages)
        self.storages.append(Storage(nbytes, category, None, self.phase, self.iteration,
                                     len(self.events)))
        self.events.append(sid)
        return sid

    def label_alive_since(self, event: int, category: str) -> None:
        """Label storages born at or after `event` and still alive (e.g. saved for backward)."""
        for sid in range(len(self.storages) - 1, -1, -1):
            st = self.storages[sid]
            if st.birth < event:
                break
            if st.death < 0:
                self.label_sid(sid, category)

    @contextlib.contextmanager
    def watching(self, parts: dict[str, torch.nn.Module]):
        """Attribute births inside each top-level module's forward to that module."""
        handles = []
        for name, module in parts.items():
            handles.append(module.register_forward_pre_hook(
                lambda *_, n=name: self.part_stack.append(n)))
            handles.append(module.register_forward_hook(lambda *_: self._pop_part()))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @contextlib.contextmanager
    def attached(self, job):
        """Called with the prepared job before anything is labelled (a subclass hooks layers)."""
        yield

    def _pop_part(self) -> None:  # returns None: a forward hook's return replaces the output
        self.part_stack.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = metacache.call(func, args, kwargs)
        for t in tree_iter(out):
            if isinstance(t, torch.Tensor):
                sid = self.track(t.untyped_storage())
                if sid is not None and self.storages[sid].op is None:
                    self.storages[sid].op = func
        return out

    # -- results ---------------------------------------------------------------------------
    def live_curve(self, device_only: bool = True, rounded: bool = True) -> np.ndarray:
        """Allocated bytes (512-rounded; storages off the allocator excluded) after each event."""
        size = round_size if rounded else int
        sizes = np.array([0 if device_only and s.category in OFF_ALLOCATOR else size(s.nbytes)
                          for s in self.storages], dtype=np.int64)
        ev = np.asarray(self.events, dtype=np.int64)
        born = ev >= 0
        delta = np.where(born, sizes[np.where(born, ev, 0)], -sizes[np.where(born, 0, ~ev)])
        return np.cumsum(delta)

    def live_at(self, index: int) -> list[Storage]:
        """Storages alive right after event `index`."""
        return [s for s in self.storages
                if s.birth <= index and (s.death < 0 or s.death > index)]

    def phase_at(self, index: int) -> tuple[str, int]:
        """(phase, iteration) that event `index` belongs to."""
        phase, it = "forward", 0
        for at, p, i in self.marks:
            if at > index:
                break
            phase, it = p, i
        return phase, it
