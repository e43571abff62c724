"""Per-rank peak of a model-parallel job (tp, sequence parallel, cp, pp, ep, over dp), analytic.

Why this shape: one rank of a tensor/expert-parallel job runs the same layers as one GPU, only
narrower (a rank's column/row-parallel linears are the full model's with `heads / tp`,
`intermediate / tp` ...; `hybridmem.parallel.layout.rank_config`), on fewer tokens (`seq_len /
cp`), and a pipeline rank runs only its stage's layers. So the analytic tier's own closed forms
price the rank: the narrow model's graph is priced (`analytic.estimate.setup`), the stage's
layers are chosen from it, its timeline is walked with the activations of the micro-batches its
schedule keeps in flight held throughout (`layout.in_flight`), and its model states are sharded
over the data-parallel ranks by `hybridmem.parallel.sharding` (the data-parallel rules, on the
stage's tensors). Every pipeline rank is priced; the answer is the highest one, named with why.

Activations per rank (sources in `docs/parallel.md`, "Model parallelism"):

- tensor parallelism without sequence parallelism: the narrow layer's saved tensors, i.e. the
  norms and residual stream whole and everything between a column- and a row-parallel linear
  divided by tp (Korthikanti et al. 2022, Table 2: `sbh(10 + 24/t + 5as/(ht))`);
- with sequence parallelism: the whole layer's divided by tp (Table 2: `sbh(34/t + 5as/(ht))`),
  priced as the full-width layer on `seq / (cp x tp)` tokens (exact where attention is linear
  in the sequence: sdpa and flash; eager's scores are priced narrow at the full sequence),
  plus the two all-gathered block inputs torch's DTensor plan saves whole (`_gathered_inputs`);
- context parallelism: `seq / cp` tokens, plus torch's ring attention K/V exchange
  (`_AllGatherRotater`, the default `allgather` rotate method: the full sequence's K and V of
  one layer during its attention; the backward adds the dK/dV chunks sent round the ring);
- expert parallelism: `experts / ep` expert weights; the routed rows stay `tokens x top_k` per
  rank (balanced routing) and travel in all-to-all send and receive buffers;
- pipeline parallelism: the stage's layers; the schedule's in-flight micro-batches (zero bubble
  priced action by action in torch's order, `_zero_bubble_points`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math

from hybridmem.allocator.alloc import t
from hybridmem.allocator.overheads import CUDA_CONTEXT_DEFAULT, cublas_workspace
from hybridmem.categories import TENSOR_CATEGORIES, empty_breakdown
from hybridmem.gpus import GPU
from hybridmem.job.parallel import INTERLEAVED, ParallelSpec
from hybridmem.job.resolved import Job
from hybridmem.job.spec import POLICIES, TrainingSpec
from hybridmem.parallel.layout import (
    check_layout, in_flight, model_shape, rank_config, stage_layers, stage_sizes,
    zero_bubble_order,
)
from hybridmem.parallel.sharding import RankStates, rank_states
from hybridmem.parallel import fsdp_points
from hybridmem.parallel.states import UNIT_KINDS, layer_tensors, model_tensors
from hybridmem.prediction import Peak, Prediction

from hybridmem.parallel.phases import NCCL_BYTES, ActPoint, forward_precision, fwd_bwd
from hybridmem.parallel.phases import step as step_phase

EDGE_KINDS = {"embedding": "first", "norm": "last", "rmsnorm": "last", "lm_head": "last"}
"""Non-repeated layers and the pipeline stage that holds them (torchtitan
`pipeline_module_split`: `tok_embeddings` on the first stage, `norm` and `output` on the last;
the rotary table is rebuilt on every stage)."""


SEQUENCE_SHARDED = ("embedding", "norm", "rmsnorm")
"""Non-repeated layers whose tensors sequence parallelism shards (torchtitan `apply_tp`:
`tok_embeddings` `RowwiseParallel(output_layouts=Shard(1))`, `norm` `SequenceParallel()`); the
`lm_head` all-gathers its input and keeps the vocabulary shard of the logits."""


@dataclasses.dataclass(frozen=True, slots=True)
class RankAnswer:
    """One pipeline rank's priced peak (all its tp/cp/dp peers are the same)."""

    rank: int
    layers: tuple[int, int]
    """(first, last) decoder layer index held (interleaved: over all its chunks)."""
    in_flight: float
    holds: tuple[str, ...]
    breakdown: dict[str, int]
    phase: str

    @property
    def device_bytes(self) -> int:
        return sum(self.breakdown.values())


def _dp_spec(spec: TrainingSpec, ranks: int) -> TrainingSpec:
    """The spec as the data-parallel rules see it: `ranks` data-parallel GPUs, nothing else."""
    ps = spec.parallel
    strategy = ps.strategy if ranks > 1 else "none"
    ranks = 1 if strategy == "none" else ranks  # no data-parallel strategy: states whole
    offload = ps.offload_optimizer if strategy in ("zero1", "zero2", "zero3") else "none"
    flat = dataclasses.replace(
        ps, world_size=ranks, strategy=strategy, tp=1, cp=1, pp=1, ep=1,
        sequence_parallel=False, pp_schedule="1f1b", pp_virtual_stages=1, pp_microbatches=None,
        dp_replicate=1, dp_shard=None, offload_optimizer=offload,
        offload_param=ps.offload_param if strategy == "zero3" else "none")
    return spec.with_(parallel=flat)


def _sum_states(a: RankStates, b: RankStates) -> RankStates:
    fields = ("param", "grad", "optimizer", "grad_fixed", "gathered", "comm",
              "step_temporary", "paged")
    # byte counts add; a dtype's width (`*_dtype_bytes`) is the same on both sides
    detail = {k: a.detail[k] if k.endswith("_dtype_bytes") and k in a.detail
              else a.detail.get(k, 0) + b.detail.get(k, 0) for k in {*a.detail, *b.detail}}
    return RankStates(**{f: getattr(a, f) + getattr(b, f) for f in fields}, detail=detail)


def _states(spec: TrainingSpec, layers: list) -> RankStates:
    """Model states of a stage's layers, sharded over the data-parallel ranks: the dense
    params over `dp_shard x cp` (torchtitan's FSDP mesh `dp_shard_cp`; Megatron's distributed
    optimizer shards over the data-and-context-parallel group), the experts over
    `dp_shard x cp / ep` (torchtitan's expert FSDP mesh)."""
    ps = spec.parallel
    dense_n = ps.data_shard * ps.cp
    dense_layers, expert_layers = _split_experts(layers)
    dense = rank_states(_dp_spec(spec, dense_n), layer_tensors(dense_layers))
    if not any(l.params for _, l in expert_layers):
        return dense
    experts = rank_states(_dp_spec(spec, max(1, dense_n // ps.ep)), layer_tensors(expert_layers))
    return _sum_states(dense, experts)


def _split_experts(layers: list) -> tuple[list, list]:
    """(the layers without their expert weights, the layers with only those): the experts
    shard over their own mesh (torchtitan `apply_fsdp`: `fully_shard(transformer_block.moe.
    experts, mesh=dp_mod_ep_mesh)`)."""
    def part(keep):
        return [(m, dataclasses.replace(l, params=tuple(p for p in l.params if keep(p.name))))
                for m, l in layers]
    return part(lambda n: "experts" not in n), part(lambda n: "experts" in n)


def _embedding_grad(spec: TrainingSpec, layers: list, shape) -> int:
    """Extra gradient bytes of a tensor-parallel token embedding: torch's `RowwiseParallel` on
    `nn.Embedding` (torchtitan's plan) shards the weight on dim 0 but its backward gives a
    `Replicate` gradient of the whole vocabulary on every rank (measured under the fake process
    group, tests/test_parallel_tp_trace.py), where Megatron's VocabParallelEmbedding keeps
    `vocab / tp` rows. Priced without a sharding data-parallel strategy, whose reduce-scatter
    of that gradient is not modelled."""
    ps = spec.parallel
    if ps.tp == 1 or _dp_spec(spec, ps.data_shard * ps.cp).parallel.strategy not in ("none", "ddp"):
        return 0
    emb = [l for _, l in layers if l.kind == "embedding" and l.gets_grads]
    rows = math.ceil(shape.vocab / ps.tp)
    return sum((shape.vocab - rows) * shape.hidden * POLICIES[spec.precision].grad_bytes
               for _ in emb)


def _comm(spec: TrainingSpec, shape, e: int, top_k: int) -> tuple[int, int]:
    """(forward, backward) transient communication buffers of the layer running now."""
    ps = spec.parallel
    b, s = spec.micro_batch, spec.seq_len
    kvd = shape.kv_heads // ps.tp * shape.head_dim
    fwd = bwd = 0
    if ps.cp > 1:
        # _AllGatherRotater: every K/V chunk gathered (the full sequence's K and V); the
        # backward gathers them again and rotates dK/dV chunks (`dkv_rotater`, all-to-all)
        kv = 2 * t(b * s * kvd, e)
        fwd, bwd = kv, kv + 2 * t(b * (s // ps.cp) * kvd, e)
    if ps.ep > 1 and shape.experts:
        # token dispatch and combine: the routed rows (tokens x top_k x hidden) in a send and a
        # receive buffer (torchtitan `ExpertParallel._token_dispatch`: all_to_all_single)
        rows = b * (s // ps.cp) * top_k * shape.hidden
        fwd += 2 * t(rows, e)
        bwd += 2 * t(rows, e)
    if ps.tp > 1 and ps.sequence_parallel:
        # all-gather of the sequence-sharded layer input before the column-parallel linears
        # (Megatron `gather_from_sequence_parallel_region`; torchtitan PrepareModuleInput)
        full = t(b * (s // ps.cp) * shape.hidden, e)
        fwd += full
        bwd += full
    return fwd, bwd


def _expert_parallel_saved(spec: TrainingSpec, top_k: int, w: int) -> int:
    """Bytes an expert-parallel MoE layer saves beyond the same experts run locally
    (`families.decoders.acts.moe_saved`, transformers' `grouped_mm_experts_forward` on the
    rank's tokens), as transformers' `AllToAllEP` runs them (transformers 5
    `distributed/expert_parallel.py`, `integrations/moe.py`; op by op under the fake process
    group, tests/test_parallel_ep_trace.py). `S` = the rank's tokens x top_k, which balanced
    routing also makes the rows received.

    - `_dispatch_tokens` sorts the pairs itself (`order = argsort(expert_ids)`; `order //
      top_k` indexes the sent rows and is saved by that `index`), and the experts then run
      top-1 on the received rows, sorting them again (`perm // 1`, saved by its `index`):
      three S-row int64 permutations where the local block saves two (`perm`, `perm // k`);
      `perm` itself is not saved, the receiver's unit weights (`ones_like`) needing no grad.
    - the sentinel mask (`_is_expert_parallel`: `expert_ids_g >= num_experts`, S bools),
      saved by the `masked_fill` after each grouped matmul.
    - the weighting moves to the sender (`_combine_tokens`: `token_outputs * top_k_weights`),
      so that multiply saves the reordered outputs (S x hidden) and the router's renormalised
      top-k weights (tokens x top_k, dtype `w`), where the local block's multiply saves the
      down projection's output (S x hidden); the receiver's multiply by unit weights saves
      no rows.
    """
    rows = spec.micro_batch * (spec.seq_len // spec.parallel.cp) * top_k
    # + order (int64) + sentinel mask (bool) + top-k weights; the S x hidden rows cancel
    return t(rows, 8) + t(rows, 1) + t(rows, w)


def _stage_steps(spec: TrainingSpec, narrow, wide, ids: set[int], first: bool, last: bool,
                 shape, e_top) -> list:
    """The stage's (priced layer, step) pairs: its decoder layers (`ids`) and the edge layers
    of the first / last stage, each step's activations as the rank's layout keeps them
    (sequence parallelism's sharded and gathered tensors, expert parallelism's dispatch)."""
    ps = spec.parallel
    chosen, layer_no = [], 0
    acts_of = {p.layer.name: p.step.acts for p in wide} if wide else {}
    for p in narrow:
        kind = p.layer.kind
        if kind in ("decoder_layer",):
            keep = layer_no in ids
            layer_no += 1
        else:
            side = EDGE_KINDS.get(kind)
            keep = side is None or (first if side == "first" else last)
        if keep:
            step = p.step
            if kind == "decoder_layer" and p.layer.name in acts_of:
                step = dataclasses.replace(step, acts=_sequence_parallel(
                    acts_of[p.layer.name], step.acts, _gathered_inputs(spec, shape)))
            if kind == "decoder_layer" and ps.ep > 1 and any(
                    "experts" in q.name for q in p.layer.params):
                extra = _expert_parallel_saved(spec, e_top[1], e_top[2])
                step = dataclasses.replace(step, acts=dataclasses.replace(
                    step.acts, saved=step.acts.saved + extra,
                    mlp_saved=step.acts.mlp_saved + extra))
            elif kind in SEQUENCE_SHARDED and p.layer.name in acts_of:
                # torchtitan's plan: the embedding's output `Shard(1)`, the final norm
                # `SequenceParallel`; both run on the rank's seq / tp tokens
                step = dataclasses.replace(step, acts=dataclasses.replace(
                    acts_of[p.layer.name], cache=step.acts.cache))
            chosen.append((p, step))
    return chosen


def _stage(spec: TrainingSpec, rank: int, narrow, wide, st, shape, comm, e_top) -> RankAnswer:
    """Price pipeline rank `rank` from the priced narrow graph (`narrow`: the rank's shard at
    `seq / cp`) and, under sequence parallelism, the full-width one at `seq / (cp x tp)`."""
    from hybridmem.analytic.timeline import walk

    ps = spec.parallel
    ids = set(stage_layers(ps, shape.layers, rank))
    first, last = rank == 0, rank == ps.pp - 1
    chosen = _stage_steps(spec, narrow, wide, ids, first, last, shape, e_top)
    steps = [s for _, s in chosen]
    k = in_flight(ps, rank)
    per_micro = sum(s.kept for s in steps)
    buffers = _pipeline_buffers(spec, shape, rank)
    stage_st = dataclasses.replace(
        st, param=sum(p.states.param for p, _ in chosen),
        master=sum(p.states.master for p, _ in chosen))
    graph_layers = [(p.module, p.layer) for p, _ in chosen]
    states = _states(spec, graph_layers)
    per_point = _fsdp_units(spec, graph_layers, states)  # None with a pipeline
    step_grads = [s.grad for s in steps]
    # two moments of a pipeline step (torch `Schedule1F1B` / `ScheduleGPipe` action order): the
    # first backward, with `k` micro-batches in flight and none of this step's gradients yet;
    # and the later backwards, every gradient accumulated (`grad_accum` 2 in the walk), with
    # `min(k, m - 1)` in flight (1F1B's steady state refills to k until the last k; GPipe's
    # backwards drain them). Interleaved schedules: k in flight at both.
    m = ps.microbatches
    later = k if ps.pp_schedule in INTERLEAVED else min(k, m - 1)
    moments = [(round((k - 1) * per_micro), st.grad_accum)]
    if ps.pp > 1 and m > 1:
        moments.append((round((later - 1) * per_micro), 2))
    acts, points = [], []
    for held, accum in moments:
        walked = walk(steps, dataclasses.replace(stage_st, grad_accum=accum))
        full = max((p.bytes["grad"] for p in walked), default=0)
        # the earlier micro-batches' activations are held through this one's forward and
        # backward (not at the step: the schedule has run every backward by then); FSDP2's
        # gathers and reduce buffers per point (`fsdp_points`) where it applies
        for p in walked:
            if p.phase == "optimizer":
                continue
            at = (fsdp_points.at_point(per_point, p.phase, p.step, p.bytes["grad"], step_grads)
                  if per_point else (None, None))
            acts.append(ActPoint(p.phase, p.bytes["grad"] / full if full else 1.0,
                                 p.bytes["activation"] + held + buffers,
                                 p.bytes["temporary"]
                                 + (comm[0] if p.phase == "forward" else comm[1]), *at))
        points = walked
    if ps.pp_schedule == "zero-bubble" and ps.pp > 1:
        # the split backward keeps each chunk's saved tensors from its forward to its weight
        # step: priced action by action (`_zero_bubble_points`), not by the two moments
        acts, leftover = _zero_bubble_points(spec, shape, rank, chosen, comm,
                                             buffers + st.inputs)
        buffers += leftover  # the input gradients on the receive buffers, through the step
    extra_grad = _embedding_grad(spec, graph_layers, shape)
    states = dataclasses.replace(states, grad=states.grad + extra_grad, detail={
        **states.detail, "replicated_embedding_grad_bytes": extra_grad}) if extra_grad else states
    extra = {"workspace": max(p.bytes["workspace"] for p in points),
             "context": CUDA_CONTEXT_DEFAULT + states.paged + NCCL_BYTES}
    best_phase, best = max(((p.phase, fwd_bwd(states, p, extra)) for p in acts),
                           key=lambda pb: sum(pb[1].values()))
    base = _Base(points)
    step_bd = step_phase(states, base, extra)
    step_bd["activation"] += buffers  # allocated once, kept across steps
    if sum(step_bd.values()) > sum(best.values()):
        best_phase, best = "optimizer", step_bd
    holds = tuple(n for n, on in (("embedding", first), ("lm_head + loss", last)) if on)
    span = (min(ids), max(ids)) if ids else (0, -1)
    out = empty_breakdown()
    out.update(best)
    return RankAnswer(rank, span, k, holds, out, best_phase)


def _chunk_of(spec: TrainingSpec, shape, rank: int, chosen: list) -> list[set[int]]:
    """The local chunks (stage `rank + c x pp`) each chosen layer runs in: a decoder layer its
    stage's; the embedding the first stage's, the final norm and `lm_head` the last's
    (`EDGE_KINDS`); the rotary table every chunk's (each stage module rebuilds it)."""
    ps = spec.parallel
    v = ps.pp_virtual_stages
    by_layer = {i: c for c in range(v) for i in _chunk_layers(ps, shape.layers, rank, c)}
    decoder = iter(sorted(by_layer))  # the chosen decoder layers, in graph order
    out = []
    for p, _ in chosen:
        kind = p.layer.kind
        if kind == "decoder_layer":
            out.append({by_layer[next(decoder)]})
        elif kind in EDGE_KINDS:
            out.append({0 if EDGE_KINDS[kind] == "first" else v - 1})
        else:
            out.append(set(range(v)))
    return out


def _chunk_layers(ps: ParallelSpec, layers: int, rank: int, chunk: int) -> set[int]:
    sizes = stage_sizes(layers, ps.pp * ps.pp_virtual_stages)
    stage = rank + chunk * ps.pp
    start = sum(sizes[:stage])
    return set(range(start, start + sizes[stage]))


def _stashed_grads(layer, tokens: int, e: int) -> int:
    """Bytes of the gradients zero bubble's input-gradient step stashes for one layer until its
    weight step: `stage_backward_input` (torch/distributed/pipelining/_backward.py) finds, per
    parameter, the autograd nodes where the weight's path meets the input's
    (`get_param_groups`: a linear's `mm`, a norm's `mul` by its weight) and a pre-hook keeps
    the gradient flowing into each (`param_group["grads"]`), i.e. the op's output gradient:
    `tokens x out_features` per linear weight `(out, in)`, `tokens x n` per norm weight `(n,)`;
    `stage_backward_weight` starts from them. Grouped expert weights (3-D) are not priced."""
    total = 0
    for q in layer.params:
        if q.frozen or len(q.shape) not in (1, 2):
            continue
        total += t(tokens * q.shape[0], e)
    return total


def _chunk_stashes(spec: TrainingSpec, shape, rank: int, chosen: list, chunks: list,
                   tokens: int, e: int) -> list[list[int]]:
    """Per chunk of the rank, per layer, the op-output gradients its I stashes until W: none
    on the first stage (it runs no I), and a non-last stage's last linear's is the receive
    buffer it was passed (`_zero_bubble_points`)."""
    ps = spec.parallel
    v, total = ps.pp_virtual_stages, ps.pp * ps.pp_virtual_stages
    stash = [[_stashed_grads(p.layer, tokens, e) if p.layer.kind != "embedding" else 0
              for (p, _), cs in zip(chosen, chunks) if c in cs] for c in range(v)]
    for c in range(v):
        stage = rank + c * ps.pp
        if stage == 0:
            stash[c] = [0] * len(stash[c])
        elif stage < total - 1 and stash[c]:
            stash[c][-1] -= t(tokens * shape.hidden, e)
    return stash


def _chunk_outputs(spec: TrainingSpec, shape, rank: int, tokens: int, e: int) -> list[int]:
    """Per chunk of the rank, its output, held in `fwd_cache` from its forward until
    `backward_one_chunk` returns (the first stage: until W, through `backward_state`): hidden
    states, or the last stage's logits (vocab shard)."""
    ps = spec.parallel
    total = ps.pp * ps.pp_virtual_stages
    vocab = math.ceil(shape.vocab / ps.tp)
    return [t(tokens * (vocab if rank + c * ps.pp == total - 1 else shape.hidden), e)
            for c in range(ps.pp_virtual_stages)]


def _zero_bubble_points(spec: TrainingSpec, shape, rank: int, chosen: list, comm,
                        constant: int) -> tuple[list[ActPoint], int]:
    """Every forward / backward point of rank `rank`'s zero-bubble step, action by action
    (torch 2.13 `ScheduleInterleavedZeroBubble` order, `layout.zero_bubble_order`).

    What each action leaves (torch/distributed/pipelining/stage.py `backward_one_chunk(...,
    full_backward=False)` / `backward_weight_one_chunk`, _backward.py):
    - F: the chunk's saved tensors (its layers' `kept`), alive until its W;
    - I (a non-first stage): `stage_backward_input` computes the input gradient with
      `retain_graph=True`, so nothing the forward saved is freed; the op-output gradients of
      every weight are stashed (`_stashed_grads`) until W. The first stage skips I (its input,
      the token ids, needs no gradient) and runs the whole backward at W;
    - W: `stage_backward_weight` (first stage: `stage_backward`) frees the chunk's graph and
      stash and accumulates its weight gradients.
    Its one-chunk backward transients are the layer's own (`bwd_mlp` / `bwd_extra`). A
    non-last stage's last linear's stashed gradient is the received gradient buffer (autograd
    passes it through the residual add), already a receive buffer."""
    ps = spec.parallel
    v = ps.pp_virtual_stages
    tokens = spec.micro_batch * (spec.seq_len // ps.cp)
    if ps.sequence_parallel:
        tokens //= ps.tp
    e = POLICIES[forward_precision(spec)].compute_bytes
    chunks = _chunk_of(spec, shape, rank, chosen)
    steps = [[s for (_, s), cs in zip(chosen, chunks) if c in cs] for c in range(v)]
    kept = [sum(s.kept for s in cs) for cs in steps]
    stash = _chunk_stashes(spec, shape, rank, chosen, chunks, tokens, e)
    grads = [sum(s.grad for s in cs) for cs in steps]
    all_grads = sum(s.grad for _, s in chosen) or 1
    output = _chunk_outputs(spec, shape, rank, tokens, e)
    # the input gradient `stage_backward_input` leaves on the stage's input, the receive
    # buffer (`inp.grad = dinput`), until the next step's `clear_runtime_states`
    dinput = t(tokens * shape.hidden, e)
    alive, stashed, open_out, done, out = set(), set(), set(), set(), []
    inputs_done = 0

    def held(skip):
        return (constant + inputs_done * dinput
                + sum(kept[c] for c, b in alive if (c, b) != skip)
                + sum(sum(stash[c]) for c, b in stashed if (c, b) != skip)
                + sum(output[c] for c, b in open_out if (c, b) != skip))

    for kind, c, b in zero_bubble_order(ps, rank):
        frac = sum(grads[x] for x in done) / all_grads
        first = rank + c * ps.pp == 0
        if kind == "F":
            base, act = held(None), 0
            for s in steps[c]:
                out.append(ActPoint("forward", frac, base + act + s.kept,
                                    s.acts.fwd_extra + comm[0]))
                act += s.kept
            alive.add((c, b))
            open_out.add((c, b))
        elif kind == "I" and not first:
            base, built = held((c, b)) + kept[c] + output[c], 0
            for s, g in zip(reversed(steps[c]), reversed(stash[c])):
                out.append(ActPoint("backward", frac, base + built,
                                    max(s.acts.bwd_mlp, s.acts.bwd_extra) + comm[1]))
                built += g
            out.append(ActPoint("backward", frac, base + built + dinput, comm[1]))
            stashed.add((c, b))
            open_out.discard((c, b))
            inputs_done += 1
        elif kind == "W":
            base = held((c, b))
            if first:  # the whole backward now, freeing as it goes
                act = kept[c] + output[c]
                for s in reversed(steps[c]):
                    out.append(ActPoint("backward", frac, base + act,
                                        max(s.acts.bwd_mlp, s.acts.bwd_extra) + comm[1]))
                    act -= s.kept
            else:
                out.append(ActPoint("backward", frac, base + kept[c] + sum(stash[c]), comm[1]))
            alive.discard((c, b))
            stashed.discard((c, b))
            open_out.discard((c, b))
            done.add(c)
    return out, inputs_done * dinput


def _fsdp_units(spec: Job, graph_layers: list, states: RankStates):
    """FSDP2's units of the stage, for pricing its gathers per timeline point
    (`fsdp_points`); None where the states' constants stay: not FSDP2, units kept unsharded
    from forward to backward (`reshard_after_forward=False`), or a pipeline (several
    micro-batches' units in flight). With ep, each layer's experts are a unit nested in it,
    sharded over their own mesh (`dp_shard x cp / ep`, as `_states`; `fsdp_points.with_inner`)."""
    ps = spec.parallel
    n = ps.data_shard * ps.cp
    flat = _dp_spec(spec, n)
    if flat.parallel.strategy != "fsdp" or not ps.reshard_after_forward or ps.pp > 1:
        return None
    from hybridmem.parallel.sharding import param_elem_bytes

    of_step = tuple(f"{m}.{l.name}" if l.kind in UNIT_KINDS else "root" for m, l in graph_layers)
    gather, reduce = states.detail["gather_dtype_bytes"], states.detail["reduce_dtype_bytes"]
    param_bytes = lambda t: param_elem_bytes(flat, t)  # noqa: E731  (flat: a Job, the stage's)
    dense, experts = _split_experts(graph_layers)
    out = fsdp_points.units(layer_tensors(dense), of_step, n, gather, reduce, param_bytes)
    if not any(l.params for _, l in experts):
        return out
    n_experts = max(1, n // ps.ep)
    nested = fsdp_points.units(layer_tensors(experts), of_step, n_experts, gather, reduce,
                               param_bytes)
    return fsdp_points.with_inner(out, nested, n_experts)


def replayable(ps: ParallelSpec) -> bool:
    """Whether a rank's stream is the narrow model's (`rank_events`): tp without sequence
    parallelism, cp, FSDP2 / data-parallel sharding over them. Not: sequence parallelism (its
    layers' activations are the full-width ones on seq / tp tokens, which the narrow stream does
    not have), pipelines (stage layers, micro-batches in flight), experts (their own mesh)."""
    return not ps.sequence_parallel and ps.pp == 1 and ps.ep == 1


def rank_events(spec: Job, workspace: int) -> tuple[int, list[tuple]]:
    """(peak live bytes, alloc/free stream) of one model-parallel rank: the analytic stream of
    the rank's narrow model at `seq / cp` tokens (`layout.rank_config`; the single-GPU tier's
    own events, `analytic.estimate.stream`), its model states rewritten to the rank's
    (`_states`, over dp x cp) and its gathers and reduce buffers added, as `parallel.stream`
    does for data-parallel ranks; the ring's K/V and the tp all-gathers are transients of the
    layer running, not in it."""
    from hybridmem.allocator.replay import peak_requested
    from hybridmem.analytic.estimate import setup, stream
    from hybridmem.models.loader import load_config_dict, materialize_config
    from hybridmem.parallel.stream import classify, rewrite, setup_counts

    ps = spec.parallel
    _, data = load_config_dict(spec.model)
    compute = forward_precision(spec)
    narrow = spec.with_(model=materialize_config(json.dumps(rank_config(data, ps.tp, ps.ep))),
                        seq_len=spec.seq_len // ps.cp, parallel=ParallelSpec(),
                        precision=compute)
    _, priced, _ = setup(narrow, workspace)
    events, marks = stream(narrow, workspace)
    n_param, n_master = setup_counts(priced, POLICIES[compute])
    states = _states(spec, [(p.module, p.layer) for p in priced])
    out = rewrite(events, marks, classify(events, marks, n_param, n_master), states)
    return peak_requested(out), out


@functools.lru_cache(maxsize=None)
def _measure_with(workspace: int):
    """`rank_events` for one workspace, one function object (`allocator.reserved.bounded`'s
    replay cache is keyed by it)."""
    return lambda spec: rank_events(spec, workspace)


def rank_fragmentation(spec: TrainingSpec, gpu: GPU | None):
    """The rank's fragmentation: `rank_events` replayed through the allocator simulator
    within the rank's capacity (`phases.rank_capacity`), monotone in the micro-batch
    (`allocator.reserved.bounded`); None where the stream is not the rank's (`replayable`)."""
    from hybridmem.allocator.config import alloc_conf_string
    from hybridmem.allocator.reserved import at_batch, bounded
    from hybridmem.parallel.phases import rank_capacity

    if not replayable(spec.parallel):
        return None
    measure = _measure_with(cublas_workspace(gpu))
    capacity = rank_capacity(spec, gpu)
    allocated = at_batch(spec, spec.micro_batch, measure, alloc_conf_string(), capacity)[0]
    return bounded(spec, allocated, measure, capacity)


def _pipeline_buffers(spec: TrainingSpec, shape, rank: int) -> int:
    """Receive buffers torch's pipelining allocates once per stage and keeps: one per
    micro-batch for the hidden states a non-first stage receives (`PipelineStage.
    _setup_forward_recv_info`: `_make_tensor_from_meta` for each `chunk_id in
    range(num_microbatches)`; the received buffer is the stage's input, so it doubles as the
    first layer's saved input) and one per micro-batch for the gradient a non-last stage
    receives (`_setup_backward_recv_info` -> `_create_grad_recv_info`). Measured by the trace
    tier (`parallel.trace_pipeline`, tests/test_parallel_pp_trace.py)."""
    ps = spec.parallel
    if ps.pp == 1:
        return 0
    total = ps.pp * ps.pp_virtual_stages
    stages = [rank + c * ps.pp for c in range(ps.pp_virtual_stages)]
    ends = sum((s > 0) + (s < total - 1) for s in stages)
    tokens = spec.micro_batch * (spec.seq_len // ps.cp)
    if ps.sequence_parallel:
        tokens //= ps.tp
    e = POLICIES[forward_precision(spec)].compute_bytes
    return ends * ps.microbatches * t(tokens * shape.hidden, e)


def _gathered_inputs(spec: TrainingSpec, shape) -> int:
    """Bytes a sequence-parallel layer saves beyond its `1 / tp` share: torch's DTensor
    sequence parallelism (torchtitan's plan: `PrepareModuleInput` to `Replicate` before the
    attention and the MLP) all-gathers each block's input, and the column-parallel linears'
    matmuls save that whole input, once for q/k/v and once for gate/up (measured under the fake
    process group, tests/test_parallel_tp_trace.py); Megatron-LM saves the sharded input and
    gathers it again in backward (`LinearWithGradAccumulationAndAsyncCommunication`), which
    this leaves out."""
    from hybridmem.allocator.alloc import t as rounded

    ps = spec.parallel
    tokens = spec.micro_batch * (spec.seq_len // ps.cp)
    e = POLICIES[forward_precision(spec)].compute_bytes
    return 2 * (rounded(tokens * shape.hidden, e) - rounded(tokens // ps.tp * shape.hidden, e))


def _sequence_parallel(wide, narrow, gathered: int):
    """A layer's activations under sequence parallelism: the full-width layer's on `1 / tp`
    of the tokens, with the rank's own weight copies (autocast's casts of its weight shards,
    saved by the matmuls or cached: `parts[0]` and `cache`), not the full layer's, and the
    all-gathered block inputs the matmuls keep (`_gathered_inputs`)."""
    copies = narrow.parts[0] if narrow.parts else 0
    wide_copies = wide.parts[0] if wide.parts else 0
    return dataclasses.replace(wide, saved=wide.saved - wide_copies + copies + gathered,
                               parts=(copies, *wide.parts[1:], gathered), cache=narrow.cache)


class _Base:
    """What `phases.step` reads of a single-GPU prediction: whether its peak is in the step."""

    def __init__(self, points) -> None:
        from hybridmem.analytic.timeline import peak

        top = peak(points)
        self.peak = dataclasses.make_dataclass("P", ["phase"])(top.phase)
        self.breakdown = dict(top.bytes)


def price_ranks(spec: Job, gpu: GPU | None = None) -> tuple[Prediction, list[RankAnswer]]:
    """The highest per-rank peak of a model-parallel `spec`, and every pipeline rank's."""
    from hybridmem.analytic.estimate import setup  # the tier's public entry
    from hybridmem.models.loader import load_config_dict, materialize_config

    ps = spec.parallel
    _, data = load_config_dict(spec.model)
    shape = model_shape(data)
    check_layout(ps, shape, spec.seq_len)
    ws = cublas_workspace(gpu)
    narrow_model = materialize_config(json.dumps(rank_config(data, ps.tp, ps.ep)))
    single = ParallelSpec()
    # the activation side computes in the precision the ranks really run (FSDP2's 16-bit
    # gathers: `estimate.forward_precision`); the states below keep the spec's own
    compute = forward_precision(spec)
    narrow_spec = spec.with_(model=narrow_model, seq_len=spec.seq_len // ps.cp, parallel=single,
                             precision=compute)
    _, narrow, st = setup(narrow_spec, ws)
    wide = None
    if ps.sequence_parallel and spec.attn != "eager":
        wide_model = materialize_config(json.dumps(rank_config(data, 1, ps.ep)))
        wide_spec = spec.with_(model=wide_model, seq_len=spec.seq_len // (ps.cp * ps.tp),
                               parallel=single, precision=compute)
        wide = setup(wide_spec, ws)[1]
    e = POLICIES[compute].compute_bytes
    top_k = int(data.get("num_experts_per_tok") or 1)
    # the router's top-k weights: fp32 in Mixtral, cast back to the compute dtype otherwise
    # (`families.decoders.model.moe_dims`: `router_fp32_weights`)
    router_w = 4 if data.get("model_type") == "mixtral" else e
    comm = _comm(spec, shape, e, top_k)
    answers = [_stage(spec, r, narrow, wide, st, shape, comm, (e, top_k, router_w))
               for r in range(ps.pp)]
    top = max(answers, key=lambda a: a.device_bytes)
    params = model_tensors(spec.with_(parallel=single))
    allocated = sum(top.breakdown[c] for c in TENSOR_CATEGORIES)
    fit = rank_fragmentation(spec, gpu)
    if fit is not None:
        frag = fit.fragmentation
        if fit.capacity is not None and not fit.oom_batches:
            # a replay that completed within the capacity reserves at most the capacity
            frag = min(frag, max(0, fit.capacity - allocated))
        top = dataclasses.replace(top, breakdown={**top.breakdown, "fragmentation": frag})
        answers = [top if a.rank == top.rank else a for a in answers]
        frag_note = ("fragmentation per rank: the rank's narrow-model stream with its sharded "
                     "states and buffers, replayed through the allocator simulator")
    else:
        frag_note = ("fragmentation is not replayed for sequence-parallel, pipeline or expert "
                     "ranks (reserved = allocated)")
    peak = Peak(allocated_bytes=allocated,
                reserved_bytes=allocated + top.breakdown["fragmentation"],
                device_bytes=top.device_bytes, phase=top.phase, iteration=1)
    notes = (f"per rank of {ps.world_size} GPUs: {layout_text(ps)}",
             why(top, answers, ps), frag_note,
             f"NCCL buffers outside PyTorch: nominal {NCCL_BYTES >> 20} MiB in context")
    extras = {"world_size": ps.world_size, "strategy": ps.strategy, "per_rank": True,
              "layout": layout_dict(ps),
              "ranks": [{"pp_rank": a.rank, "layers": list(a.layers), "holds": list(a.holds),
                         "in_flight_microbatches": a.in_flight, "phase": a.phase,
                         "device_bytes": a.device_bytes, "breakdown": a.breakdown}
                        for a in answers],
              "highest_rank": top.rank}
    pred = Prediction(
        model=spec.model, method="analytic+layout", params_total=params.params,
        params_trainable=params.trainable, breakdown=top.breakdown, peak=peak, notes=notes,
        extras=extras, modules=(), gpu_name=gpu.name if gpu else None,
        gpu_memory_bytes=gpu.memory_bytes if gpu else None)
    return pred, answers


def layout_dict(ps: ParallelSpec) -> dict:
    return {"dp_replicate": ps.dp_replicate, "dp_shard": ps.data_shard, "cp": ps.cp,
            "tp": ps.tp, "sequence_parallel": ps.sequence_parallel, "pp": ps.pp,
            "pp_schedule": ps.pp_schedule, "pp_virtual_stages": ps.pp_virtual_stages,
            "pp_microbatches": ps.microbatches, "ep": ps.ep, "strategy": ps.strategy}


def layout_text(ps: ParallelSpec) -> str:
    parts = [f"dp {ps.dp_replicate}x{ps.data_shard} ({ps.strategy})" if ps.dp_replicate > 1
             else f"dp {ps.data_shard} ({ps.strategy})", f"tp {ps.tp}"
             + (" +sp" if ps.sequence_parallel else ""), f"cp {ps.cp}"]
    if ps.pp > 1:
        parts.append(f"pp {ps.pp} ({ps.pp_schedule}, {ps.microbatches} micro-batches"
                     + (f", {ps.pp_virtual_stages} stages/rank" if ps.pp_virtual_stages > 1 else "")
                     + ")")
    else:
        parts.append("pp 1")
    if ps.ep > 1:
        parts.append(f"ep {ps.ep}")
    return " x ".join(parts)


def why(top: RankAnswer, answers: list[RankAnswer], ps: ParallelSpec) -> str:
    """Which rank peaks highest and the category that puts it above the others."""
    if len(answers) == 1:
        return "every rank holds the same shards: one rank priced"
    others = [a for a in answers if a is not top]
    runner = max(others, key=lambda a: a.device_bytes)
    diff = {c: top.breakdown[c] - runner.breakdown[c] for c in top.breakdown}
    cause = max(diff, key=diff.get)
    reasons = []
    if top.in_flight > runner.in_flight:
        reasons.append(f"holds {top.in_flight:g} micro-batches' activations in flight "
                       f"({ps.pp_schedule}) against {runner.in_flight:g} on pipeline rank "
                       f"{runner.rank}")
    if top.holds:
        reasons.append("holds the " + " and the ".join(top.holds))
    gib = (top.device_bytes - runner.device_bytes) / 2**30
    return (f"highest peak: pipeline rank {top.rank} of {ps.pp} (layers {top.layers[0]}-"
            f"{top.layers[1]}), {gib:.2f} GiB above rank {runner.rank}, mostly {cause}: "
            + "; ".join(reasons or ["the same layers, its shards"]))
