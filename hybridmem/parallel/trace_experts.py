"""The trace tier's expert-parallel ranks: transformers' own expert parallelism, one rank alone.

torch has no expert-parallel style; torchtitan's (`torchtitan/distributed/expert_parallel.py::
ExpertParallel`) shards each expert weight `Shard(0)` over the ep mesh (`distribute_tensor`)
and wraps its `GroupedExperts` module's input and output: `_token_dispatch` exchanges the
per-expert token counts (`all_to_all_single`), reads the split sizes back to the host
(`.tolist()`) and sends the routed rows with `all_to_all_single_autograd`; `_token_combine`
sends the outputs back. That style cannot wrap transformers' Mixtral experts as they are:
torchtitan's `GroupedExperts.forward(x, num_tokens_per_expert)` receives rows already sorted
by expert with their counts (its MoE block routes and `_permute`s outside the experts), while
`MixtralExperts.forward(hidden_states, top_k_index, top_k_weights)` receives the unsorted
tokens and the routing and sorts inside (`integrations/moe.py::grouped_mm_experts_forward`).
transformers 5 ships the same design for its own experts, used here unchanged:
`MixtralConfig.base_model_ep_plan` (`grouped_gemm` on `gate_up_proj` / `down_proj`:
`MoEParamShard`, `distribute_tensor(..., [Shard(0)])` and `num_experts` = the local count;
`ep_dispatch_experts` on the experts module: `AllToAllEP`, whose `_dispatch_tokens` is
torchtitan's `_token_dispatch` step for step), applied by
`transformers.distributed.expert_parallel.apply_expert_parallelism`.

What a rank alone cannot do: read the split sizes back (`AllToAllEP._dispatch_tokens`:
`torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()`); a fake tensor has no values.
`HostSplitsEP` answers that one read where the tensor is fake, with the balanced routing the
analytic tier prices (each rank sends `tokens x top_k / ep` rows to each rank, and, the fake
PG's `all_to_all_single` handing every rank what this one sends, receives what it sends:
`tokens x top_k` rows in all). On real tensors it is `AllToAllEP` exactly: the split sizes
are read from the router's real choices and the fake PG returns them as received; the rows
received are then `tokens x top_k` as well, so the bytes agree whatever the routing.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

IMPLEMENTATION = "hybridmem-host-splits"
"""The name `HostSplitsEP` is registered under (`EPImplementationInterface.register`)."""


class _HostSplits(TorchFunctionMode):
    """Answers the reads of a fake split-size tensor with the balanced sizes. A fake tensor's
    `tolist` reaches the mode as `unbind` and one `item` per element (rows: sent, then
    received), so each `item` of a fake tensor takes the next size of the two rows."""

    def __init__(self, rows: int, ep: int) -> None:
        super().__init__()
        share, extra = divmod(rows, ep)
        self.sizes = [share + (r < extra) for r in range(ep)]
        self.read = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor

        if func is torch.Tensor.item and isinstance(args[0], FakeTensor):
            size = self.sizes[self.read % len(self.sizes)]
            self.read += 1
            return size
        return func(*args, **(kwargs or {}))


def _register() -> str:
    from transformers.distributed.expert_parallel import AllToAllEP, EPImplementationInterface

    class HostSplitsEP(AllToAllEP):
        """transformers' `AllToAllEP`, the split sizes answered on the host under fake
        tensors (module docstring)."""

        def _dispatch_tokens(self, hidden_states, top_k_index, top_k_weights):
            with _HostSplits(top_k_index.numel(), self.ep_mesh.size()):
                return super()._dispatch_tokens(hidden_states, top_k_index, top_k_weights)

    EPImplementationInterface.register(IMPLEMENTATION, HostSplitsEP)
    return IMPLEMENTATION


def apply_ep(model: torch.nn.Module, ep_mesh, tp_mesh) -> None:
    """The model's own expert-parallel plan (`base_model_ep_plan`, with the layer numbers
    filled in as `from_pretrained(distributed_config=...)` does) over `ep_mesh`."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    plan = model._expand_parallel_plan(model.ep_plan)
    apply_expert_parallelism(model, ep_mesh, tp_mesh, plan, ep_implementation=_register())
