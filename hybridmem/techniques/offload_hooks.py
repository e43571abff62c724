"""Activation offloading: tensors saved for backward kept in host memory, brought back in backward.

Two variants, one spec field (`TrainingSpec.offload_activations`):

- `"all"` (`--offload-activations`; TRL SFTConfig `activation_offloading=True`): TRL's
  `OffloadActivations` as `SFTTrainer` builds it (trl/models/activation_offloading.py
  `get_act_offloading_ctx_manager`, defaults `use_pin_memory=True, use_streams=True,
  min_offload_size=1024, max_fwd_stash_size=5`), a `saved_tensors_hooks` context around the
  whole `training_step`. TRL's version of torchtune's class
  (torchtune/training/_activation_offloading.py) is priced because it is what SFTTrainer users
  run; it differs from torchtune's in that it also offloads the loss's saved tensors (the whole
  step is wrapped), does not offload one storage twice, and does not need checkpointing on
  (torchtune's recipes refuse offloading without it). What stays on the GPU (pack_tensor):
  tensors < `min_offload_size` bytes, parameters / buffers (and tensors on a parameter's
  storage), a storage already offloaded in this forward (a second save of it keeps a device
  reference: `storage_to_tensor_id`), the lm_head's own saved tensors (`NoOpManager` around
  `model.lm_head`), and the in-flight tensors of the streams: in forward an offloaded tensor's
  device copy stays in `fwd_stash` until a tensor `max_fwd_stash_size` ids later is offloaded
  (and the last ones until the first backward node); in backward a brought-back tensor stays
  in `bwd_tensor_stash` until the next node that brings one back has run (double buffer).
- `"ckpt-inputs"` (`--training-args` `activation_checkpointing_kwargs.offload=true`):
  transformers 5.x `_activation_checkpointing_enable(offload=True)` (modeling_utils.py) wraps
  each checkpointed layer's `checkpoint(...)` call in `torch.autograd.graph.save_on_cpu(
  pin_memory=True)`: only what the checkpoint itself saves (the layer's inputs; the recompute's
  tensors are packed by checkpoint's own inner hooks) goes to the host, copied on every pack
  (no dedup) and brought back as a new device tensor when the recompute unpacks it.

The rules and a device-agnostic port of both hook pairs live here once: the trace tier runs
them on meta / fake / real CPU tensors (TRL's class leaves CPU tensors alone and needs CUDA
streams, and `save_on_cpu` is a no-op copy on CPU), the CUDA harness runs TRL's own class when
`trl` is installed (else this port with real host copies) and transformers' own `offload=True`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.weak import WeakIdKeyDictionary


from hybridmem.techniques.kernels import MAX_FWD_STASH_SIZE, MIN_OFFLOAD_SIZE


def offloadable(t: torch.Tensor) -> bool:
    """TRL pack_tensor's size test (tensors below it stay on the GPU)."""
    return t.element_size() * t.nelement() >= MIN_OFFLOAD_SIZE


class Offload(saved_tensors_hooks):
    """TRL `OffloadActivations(use_streams=True)` with the device copies made by callables.

    `to_host(t)` returns the host copy of `t` (the trace tier makes it outside the tracker);
    `to_device(h, like)` a new device tensor from a host copy. Streams and events are gone
    (they change when, not whether, a device copy is dropped: the stash rules below decide).
    Tensor ids, the forward stash, the per-node backward stash and the node hook that frees the
    previous node's tensors follow TRL line by line; the dedup key is the live storage (TRL's
    `data_ptr() + storage_offset()`, which meta tensors do not have)."""

    def __init__(self, to_host: Callable, to_device: Callable, params=(),
                 on_unpack: Callable | None = None) -> None:
        self.tracker: dict[int, tuple] = {}  # id -> (tensor or host copy, offloaded, key)
        self.tensor_id = 0
        self.first_forward_call, self.first_backward_call = True, True
        self.fwd_stash: dict[int, torch.Tensor] = {}
        self.bwd_stash: dict[int, torch.Tensor] = {}
        self.seen = WeakIdKeyDictionary()  # storage -> {(offset, dtype)} offloaded this forward
        self.params = WeakIdKeyDictionary({p.untyped_storage(): True for p in params})
        self.curr_node = None
        self.graph_id = None
        self.offloaded = 0  # tensors offloaded (for tests and notes)

        def pack(t: torch.Tensor) -> int:
            if self.first_forward_call:
                self.first_forward_call, self.first_backward_call = False, True
                self.seen = WeakIdKeyDictionary()
            self.tensor_id += 1
            tid = self.tensor_id
            storage = t.untyped_storage()
            key = (t.storage_offset(), t.dtype)
            if (key in self.seen.get(storage, ()) or not offloadable(t)
                    or isinstance(t, (nn.Parameter, nn.Buffer)) or storage in self.params):
                self.tracker[tid] = (t, False)
                return tid
            for old in list(self.fwd_stash):  # TRL: drop device copies offloaded long enough ago
                if old <= tid - MAX_FWD_STASH_SIZE:
                    del self.fwd_stash[old]
                else:
                    break
            self.tracker[tid] = (_to_host(t, to_host), True)
            self.fwd_stash[tid] = t
            self.seen.setdefault(storage, set()).add(key)
            self.offloaded += 1
            return tid

        def unpack(tid: int) -> torch.Tensor:
            if self.first_backward_call:
                self.graph_id = torch._C._current_graph_task_id()
                torch.autograd.Variable._execution_engine.queue_callback(self.bwd_stash.clear)
                self.first_backward_call = False
            held, offloaded = self.tracker.pop(tid)
            if not self.tracker:
                self.first_forward_call = True
            if not offloaded:
                return held
            node = torch._C._current_autograd_node()
            prev = []
            if torch._C._current_graph_task_id() == self.graph_id and self.curr_node != node:
                self.curr_node = node
                prev = list(self.bwd_stash)
            if tid in self.fwd_stash:  # still on the device: used as is
                out = self.fwd_stash[tid]
            else:
                out = _to_device(held, to_device)
                if on_unpack is not None:
                    on_unpack(out)
                self.bwd_stash[tid] = out

            def hook(outputs, inputs, prev=prev):
                self.fwd_stash.clear()  # TRL: nothing of the forward stash outlives a node
                for old in prev:
                    self.bwd_stash.pop(old, None)
                return outputs

            if node is not None:
                node.register_hook(hook)
            return out

        super().__init__(pack, unpack)


def _to_host(t: torch.Tensor, to_host: Callable) -> tuple:
    """TRL's host copy: the tensor (`empty_like`), or its whole storage when a stride is 0
    (`has_broadcast`: the storage is copied, not the materialised broadcast); with the view
    (size, stride, offset) the device copy is rebuilt with (`as_strided`)."""
    view = (t.size(), t.stride(), t.storage_offset())
    if 0 in t.stride():
        flat = torch.as_strided(t, (t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
        return to_host(flat), view
    return to_host(t), None


def _to_device(held: tuple, to_device: Callable) -> torch.Tensor:
    host, view = held
    out = to_device(host)
    return out if view is None else torch.as_strided(out, *view)


class NoOp(saved_tensors_hooks):
    """TRL `NoOpManager`: the innermost hooks win, so a region under it is not offloaded."""

    def __init__(self) -> None:
        super().__init__(lambda t: t, lambda t: t)


def head_of(model: nn.Module) -> nn.Module | None:
    """The output head TRL keeps on the device (get_act_offloading_ctx_manager: `output`,
    else `lm_head`, ...; a PeftModel's base_model first)."""
    m = model.module if hasattr(model, "module") else model
    if hasattr(m, "base_model") and hasattr(m, "peft_config"):
        m = m.base_model
    for name in ("output", "lm_head"):
        if isinstance(getattr(m, name, None), nn.Module):
            return getattr(m, name)
    inner = getattr(m, "model", None)  # peft LoraModel.model is the transformers model
    return getattr(inner, "lm_head", None) if isinstance(inner, nn.Module) else None


@contextlib.contextmanager
def keep_head(model: nn.Module):
    """TRL's hack: a NoOp around the output head's forward (its input stays on the device)."""
    head = head_of(model)
    if head is None:
        yield
        return
    noop = NoOp()
    handles = [head.register_forward_pre_hook(lambda *a: noop.__enter__()),
               head.register_forward_hook(lambda *a: noop.__exit__(), always_call=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class SaveOnHost(saved_tensors_hooks):
    """`torch.autograd.graph.save_on_cpu(pin_memory=True)` with the copies made by callables:
    every packed tensor is copied to the host (no size test, no dedup) and unpacked into a new
    device tensor (torch/autograd/graph.py `pack_to_cpu` / `unpack_from_cpu`)."""

    def __init__(self, to_host: Callable, to_device: Callable,
                 on_unpack: Callable | None = None) -> None:
        def pack(t):
            return to_host(t)

        def unpack(h):
            out = to_device(h)
            if on_unpack is not None:
                on_unpack(out)
            return out

        super().__init__(pack, unpack)


def offloaded_checkpoint(hooks: Callable[[], saved_tensors_hooks]) -> Callable:
    """transformers' `checkpoint_func` under `offload=True`: `with save_on_cpu(...):
    return checkpoint(function, *args, **kwargs)` (non-reentrant, Trainer's default)."""
    from torch.utils.checkpoint import checkpoint

    def checkpoint_func(function, *args, **kwargs):
        kwargs.setdefault("use_reentrant", False)
        with hooks():
            return checkpoint(function, *args, **kwargs)

    return checkpoint_func


def enable_ckpt_offload(model: nn.Module, hooks: Callable[[], saved_tensors_hooks]) -> None:
    """Hand every checkpointing layer `offloaded_checkpoint(hooks)` (after
    `job.checkpointing.enable_checkpointing` chose the layers), as `_set_gradient_checkpointing`
    hands each GradientCheckpointingLayer its `_gradient_checkpointing_func`."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    func = offloaded_checkpoint(hooks)
    for m in model.modules():
        if isinstance(m, GradientCheckpointingLayer):
            m._gradient_checkpointing_func = func


class Copies:
    """(to_host, to_device) for a CPU run (the trace tier, its real-CPU oracle). The host copy
    is made with the dispatch modes off, so no tracker or counter sees it (it is host memory);
    the device copy is an ordinary op they see, handed to `label` (the tracker's
    "activation" label) if set. Meta / fake tensors copy no data, real ones do."""

    def __init__(self) -> None:
        self.label: Callable | None = None

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            h = torch.empty_like(t)
            h.copy_(t)
        return h

    def to_device(self, h: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(h)
        out.copy_(h)
        if self.label is not None:
            self.label(out)
        return out


def cuda_copies(device) -> tuple[Callable, Callable]:
    """TRL's copies on a GPU: pinned host tensor filled non-blocking; back with `.to`."""
    def to_host(t):
        h = torch.empty_like(t, pin_memory=True, device="cpu")
        h.copy_(t, non_blocking=True)
        return h

    return to_host, lambda h: h.to(device, non_blocking=True)


def offload_context(model: nn.Module, device) -> saved_tensors_hooks:
    """The `all` context the CUDA harness enters around each forward (the packs happen there;
    each unpack runs the hooks captured at pack time): TRL's own
    `get_act_offloading_ctx_manager(model)` when `trl` is installed and the device is CUDA,
    else the port above (CUDA copies, or `Copies` on the CPU stand-in) with the head kept."""
    if torch.device(device).type == "cuda":
        try:
            from trl.models.activation_offloading import get_act_offloading_ctx_manager
        except ImportError:
            pass
        else:
            return get_act_offloading_ctx_manager(model)
        to_host, to_device = cuda_copies(device)
    else:
        c = Copies()
        to_host, to_device = c.to_host, c.to_device
    keep_head(model).__enter__()  # as TRL: the head's hooks stay for the model's life
    return Offload(to_host, to_device, params=[*model.parameters(), *model.buffers()])
