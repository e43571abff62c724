"""The trace tier's pipeline ranks: torch's own `torch.distributed.pipelining`, one stage alone.

A pipeline rank is run as torchtitan runs it (`torchtitan/distributed/pipeline_parallel.py`:
`pipeline_module_split` keeps a copy of the model per stage with the other stages' modules
removed, each wrapped in a `PipelineStage`; `build_pipeline_schedule` picks the schedule class;
`torchtitan/train.py::forward_backward_step` calls `schedule.step(inputs, target=...)` on the
rank with the first stage, `step(target=...)` on the one with the last, `step()` elsewhere),
in this process under torch's fake process group: the schedule's own action order (warm-up
forwards, one-forward-one-backward, cool-down backwards) runs, its activation and gradient
receive buffers are allocated by the stage, and its point-to-point sends and receives complete
at once without moving data (the fake PG's `isend` / `irecv` are no-ops; a received buffer
keeps what the stage allocated, of the right shape).

One thing does not run alone: the stage's start-up vote (`PipelineStage._warmup_forward_vote`
/ `_warmup_backward_result`, torch/distributed/pipelining/stage.py), where every stage sends
its vote (static shapes given, or shapes inferred by exchanging pickled metadata) round the
pipeline. Under the fake PG nothing is received (the vote reads 0, "dynamic", and the
metadata exchange `recv_object_list` unpickles an empty buffer). Every stage here is given its
shapes (`input_args` / `output_args`, plain tensors: `InferenceMode.needs_dynamic` is False),
so every real stage votes static and the real vote's answer is static: `AloneStage` answers
the vote with its own. Nothing else of the stage or the schedule is replaced.

The HF model is split the way transformers' own pipeline split does
(`transformers/distributed/pipeline_parallel.py::apply_pipeline_parallelism`: the layers and
edge modules of other stages replaced by `PipelineIdentityLayer`); a non-first stage feeds the
received hidden states as `inputs_embeds`, the last stage returns the logits and the schedule
runs HF's causal-LM loss on them.
"""

from __future__ import annotations

import torch
from torch import nn

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
             "interleaved-1f1b": "ScheduleInterleaved1F1B",
             "zero-bubble": "ScheduleInterleavedZeroBubble"}
"""`pp_schedule` -> the torch.distributed.pipelining class (torchtitan `get_schedule_class`)."""


class StageModule(nn.Module):
    """One stage of an HF causal LM: ids (first stage) or hidden states in; hidden states, or
    the logits on the last stage, out (torchtitan's stage models take and return tensors)."""

    def __init__(self, model: nn.Module, first: bool, last: bool) -> None:
        super().__init__()
        self.model, self.first, self.last = model, first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kwargs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        if self.last:
            return self.model(**kwargs).logits
        return self.model.model(**kwargs).last_hidden_state


def split_stage(part: nn.Module, layers: list[int], first: bool, last: bool) -> StageModule:
    """`part` (a model of its own for this stage: torchtitan deep-copies the whole model per
    stage, which fake tensors cannot do, so each stage builds one) keeping only decoder layers
    `layers` (and the embedding on the first stage, the final norm and `lm_head` on the
    last)."""
    from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

    keep = set(layers)
    base = part.model
    for i in range(len(base.layers)):
        if i not in keep:
            base.layers[i] = PipelineIdentityLayer()
    if not first:
        base.embed_tokens = PipelineIdentityLayer()
    if not last:
        base.norm = PipelineIdentityLayer()
        part.lm_head = PipelineIdentityLayer()
    return StageModule(part, first, last)


def alone_stage_class():
    """`PipelineStage` whose start-up vote is answered by the stage itself (module docstring);
    it also marks the tracker's phase as each chunk's forward or backward starts."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._utils import InferenceMode

    class AloneStage(PipelineStage):
        tracker = None
        iteration = 0

        def _vote(self) -> torch.Tensor:
            dynamic = InferenceMode.needs_dynamic(self._user_meta, self._vote_backward)
            return torch.tensor([0 if dynamic else 1], dtype=torch.int32)

        def _warmup_forward_vote(self, has_backward, received_acc=None):
            self._vote_backward = has_backward
            return self._vote()

        def _warmup_backward_result(self, received_result=None):
            return self._vote()

        def forward_one_chunk(self, *args, **kwargs):
            if self.tracker is not None:
                self.tracker.mark("forward", self.iteration)
            return super().forward_one_chunk(*args, **kwargs)

        def backward_one_chunk(self, *args, **kwargs):
            if self.tracker is not None:
                self.tracker.mark("backward", self.iteration)
            return super().backward_one_chunk(*args, **kwargs)

    return AloneStage


def stage_layers(num_layers: int, ps):
    """`layers_of(stage)`: the decoder layers of pipeline stage `stage`, torchtitan's split
    (`layout.stage_sizes`) over `pp x pp_virtual_stages` stages."""
    from hybridmem.parallel.layout import stage_sizes

    sizes = stage_sizes(num_layers, ps.pp * ps.pp_virtual_stages)

    def layers_of(stage: int) -> list[int]:
        start = sum(sizes[:stage])
        return list(range(start, start + sizes[stage]))

    return layers_of


def build(new_model, ps, rank: int, layers_of, micro: int, seq: int, hidden: int,
          vocab: int, dtype: torch.dtype, device: torch.device | None = None):
    """(schedule, stage modules, stages) of pipeline rank `rank`: its `pp_virtual_stages`
    stages `rank + c x pp` (loop style), each a model from `new_model()` cut to the stage and
    given its input and output shapes.

    `device` None: the trace tier's rank alone (`AloneStage`, CPU, fake or real tensors);
    a device: a real rank among real ones (the harness, `harness.distributed.pipeline`), torch's
    `PipelineStage` itself, whose start-up vote and p2p run over the real process group, its
    example shapes given on the meta device (the stage only reads their shapes and dtypes:
    `stage._make_tensor_from_meta` allocates its receive buffers on `device`)."""
    from torch.distributed.pipelining import PipelineStage, schedules

    total = ps.pp * ps.pp_virtual_stages
    cls = alone_stage_class() if device is None else PipelineStage
    where = torch.device("cpu") if device is None else torch.device("meta")
    parts, stages = [], []
    for c in range(ps.pp_virtual_stages):
        index = rank + c * ps.pp
        first, last = index == 0, index == total - 1
        part = split_stage(new_model(), layers_of(index), first, last)
        # the shapes one micro-batch has at the stage's boundaries (plain tensors requiring
        # grad: the gradients travel back through them)
        inp = (torch.zeros(micro, seq, dtype=torch.long, device=where) if first
               else torch.empty(micro, seq, hidden, dtype=dtype, device=where,
                                requires_grad=True))
        out = torch.empty(micro, seq, vocab if last else hidden, dtype=dtype,
                          device=where).requires_grad_()
        stages.append(cls(part, index, total, device or torch.device("cpu"),
                          input_args=(inp,), output_args=(out,)))
        parts.append(part)
    loss_function = parts[-1].model.loss_function

    def loss_fn(logits, target):
        # HF's causal-LM loss (`ForCausalLMLoss`: shift, upcast, cross entropy), as the model's
        # own `labels=` path runs it
        return loss_function(logits, target, vocab_size=vocab)

    schedule_cls = getattr(schedules, SCHEDULES[ps.pp_schedule])
    stage_arg = stages if ps.pp_virtual_stages > 1 else stages[0]
    schedule = schedule_cls(stage_arg, n_microbatches=ps.microbatches, loss_fn=loss_fn)
    return schedule, parts, stages


def step(schedule, stages, ids: torch.Tensor, labels: torch.Tensor) -> None:
    """One pipeline step on this rank (torchtitan `Trainer.forward_backward_step`): the inputs
    where a stage is first, the targets and a `losses` list where one is last, and
    `return_outputs=False` (recent torchtitan: the last stage does not keep every
    micro-batch's logits for `_merge_outputs`, `PipelineStage.output_chunks`)."""
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    kwargs = {"target": labels, "losses": []} if last else {}
    if first:
        schedule.step(ids, return_outputs=False, **kwargs)
    else:
        schedule.step(return_outputs=False, **kwargs)
