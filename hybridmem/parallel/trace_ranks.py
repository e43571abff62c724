"""The trace tier for tensor-parallel layouts: torch's own DTensor code, one rank at a time.

A tp (optionally sequence-parallel) or FSDP2 x tp rank is run as torchtitan runs it, in this
process, under torch's fake process group (`torch.testing._internal.distributed.fake_pg`: every
collective returns at once, its output allocated with the right shape): the HF model is built
on fake (or, for tests, real CPU) tensors, `parallelize_module` applies torchtitan's plan
(`torchtitan/models/llama3/infra/parallelize.py::apply_tp`), `fully_shard` wraps each decoder
layer and the root over the data-parallel sub-mesh (`apply_fsdp`), and two training iterations
run (forward with HF's loss, backward, AdamW, `zero_grad`). The storage tracker
(`trace.tracker`) sees each DTensor op's output by its local shard, so what it counts is what the
rank's allocator would hold. Rank 0 is traced: DTensor's and FSDP2's uneven shards put the
`ceil` rows on the first ranks (`torch.chunk` semantics, `_StridedShard` aside), so rank 0 is the
highest; every other rank is the same shape or smaller.

Pipeline ranks run torch's pipelining stages and schedules (`parallel.trace_pipeline`), each
pipeline rank traced alone, the highest answered; expert-parallel ranks run transformers' own
expert parallelism (`parallel.trace_experts`) under FSDP2, torchtitan's MoE layout. Context
parallelism runs torch's `context_parallel` around forward and backward, as torchtitan's train
context does (`torchtitan/distributed/utils.py::create_context_parallel_ctx`: the batch and the
position buffer sharded on the sequence, the `allgather` rotate method), with torch's ring
attention on the CPU flash kernel (`parallel.ring_cpu`); FSDP2 then shards over the flattened
`dp_shard x cp` mesh (torchtitan's `dp_shard_cp`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_iter

from hybridmem.allocator.overheads import CONTEXT_BYTES, cublas_workspace
from hybridmem.errors import SpecError
from hybridmem.gpus import GPU
from hybridmem.job.spec import TrainingSpec
from hybridmem.prediction import Peak, Prediction
from hybridmem.trace.tracker import StorageTracker, round_size

TRACED = ("tp / sequence parallelism / cp with dp_shard (FSDP2) or alone; pp alone; ep with "
          "dp_shard (FSDP2)")
"""What this tier runs; other layouts are refused with this line's choices."""

PRECISIONS = ("fp32", "bf16", "bf16-mixed")
"""`bf16-mixed` only with FSDP2: `MixedPrecisionPolicy(bf16, fp32)`, torchtitan's default."""

ITERATIONS = 2  # as `trace.runner.ITERATIONS`: AdamW's state appears in the first step


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own tensor behind a DTensor (and behind a pending functional collective)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    t = t._local_tensor if hasattr(t, "_local_tensor") else t
    return t.trigger_wait() if isinstance(t, AsyncCollectiveTensor) else t


class RankTracker(StorageTracker):
    """The storage tracker, seeing through DTensors: an op on DTensors is one dispatch here
    (DTensor's own dispatch runs its local ops below this mode), so its outputs are followed by
    their local shards; collectives issued on local tensors (redistributes) are seen as ops."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops._c10d_functional.wait_tensor.default:
            # wait_tensor returns its input (`_c10d_functional` CPU/CUDA kernels); the fake
            # kernel makes a new tensor, whose storage would be counted twice
            return args[0]
        for t in tree_iter(out):
            if isinstance(t, torch.Tensor):
                sid = self.track(_local(t).untyped_storage())
                if sid is not None and self.storages[sid].op is None:
                    self.storages[sid].op = func
        return out

    def _free(self, sid: int) -> None:
        if self.storages[sid].death < 0:  # not a storage FSDP2 resized to 0 already
            super()._free(sid)

    def resized(self, storage: torch.UntypedStorage, category: str) -> None:
        """FSDP2 frees and re-allocates its unsharded params by resizing their storage
        (`_fsdp_param.free_storage` / `alloc_storage`: `untyped_storage().resize_(0)` and back,
        the same Python object throughout), which the caching allocator sees as a free and a
        new allocation but a weakref finaliser never does: record both as such."""
        sid = self._sid.get(storage)
        if sid is not None:
            self._free(sid)
            del self._sid[storage]
        if storage.nbytes():
            self.track(storage, category)


@contextlib.contextmanager
def fsdp_storage_events(tracker: RankTracker):
    """While active, FSDP2's storage resizes are births and deaths in `tracker`: the unsharded
    params live from their unit's all-gather copy-out to its reshard, as on CUDA."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def alloc_storage(tensor):
        alloc(tensor)
        tracker.resized(tensor.untyped_storage(), "param")

    def free_storage(tensor):
        free(tensor)
        tracker.resized(tensor.untyped_storage(), "param")

    _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = alloc_storage
    _fsdp_param.free_storage = free_storage
    try:
        yield
    finally:
        _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = alloc
        _fsdp_param.free_storage = free


def apply_tp(model: torch.nn.Module, mesh, sequence_parallel: bool) -> None:
    """torchtitan's tensor-parallel plan (`apply_tp`) on an HF Llama-shaped model: q/k/v and
    gate/up `ColwiseParallel`, o and down `RowwiseParallel`, the embedding `RowwiseParallel`, the
    `lm_head` `ColwiseParallel` left vocabulary-sharded for the parallel loss; with
    sequence parallelism the norms are `SequenceParallel` and each block's input is
    all-gathered (`PrepareModuleInput` -> `Replicate`), the row-parallel outputs `Shard(1)`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    seq = Shard(1) if sequence_parallel else Replicate()
    for layer in model.model.layers:
        plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(output_layouts=seq),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=seq)}
        if sequence_parallel:
            plan.update({
                "input_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                "post_attention_layernorm": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                          desired_input_layouts=(Replicate(),))})
        parallelize_module(layer, mesh, plan)
    top = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
           # loss parallel (torchtitan's default, `disable_loss_parallel = false`): the logits
           # stay vocabulary-sharded DTensors and the cross entropy runs on the shards
           "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                      use_local_output=False)}
    if sequence_parallel:
        top["model.norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)


def refusal(spec: TrainingSpec) -> SpecError | None:
    """The layouts and jobs this tier does not run, as one-line errors."""
    ps = spec.parallel
    for name in ("dp_replicate",):
        if getattr(ps, name) > 1:
            return SpecError(name, getattr(ps, name), (1,), reason="the trace tier runs "
                             f"{TRACED}; use --method analytic for this layout")
    axes = [n for n in ("tp", "cp", "pp", "ep") if getattr(ps, n) > 1]
    if len(axes) > 1:
        return SpecError(axes[1], getattr(ps, axes[1]), (1,), reason=f"the trace tier runs "
                         f"one model-parallel axis at a time ({TRACED}); with {axes[0]} use "
                         "--method analytic")
    if ps.cp > 1 and spec.attn == "eager":  # torch's ring attention replaces SDPA only
        return SpecError("attn", spec.attn, ("sdpa", "flash_attention_2"), reason="context "
                         "parallelism (torch's context_parallel) runs SDPA's ring attention")
    if ps.pp > 1 and ps.data_shard > 1:
        return SpecError("dp_shard", ps.data_shard, (1,), reason="the trace tier runs a "
                         "pipeline alone (no data-parallel ranks); use --method analytic")
    if ps.data_shard > 1 and ps.strategy != "fsdp":
        return SpecError("strategy", ps.strategy, ("fsdp",), reason="the trace tier shards "
                         "tp x dp and ep x dp layouts with FSDP2 (torchtitan's)")
    if spec.precision not in PRECISIONS or (spec.precision == "bf16-mixed"
                                            and ps.data_shard == 1):
        return SpecError("precision", spec.precision, PRECISIONS[:2] if ps.data_shard == 1
                         else PRECISIONS, reason="the trace tier's model-parallel ranks run "
                         "one dtype (bf16-mixed: FSDP2's MixedPrecisionPolicy)")
    if spec.train != "full" or spec.grad_ckpt or spec.optimizer != "adamw":
        return SpecError("method", "trace", ("analytic",), reason="the trace tier's "
                         "model-parallel ranks run full training with AdamW, no checkpointing")
    from hybridmem.trace.scope import refusal as single_gpu_refusal

    return single_gpu_refusal(spec)  # the MoE experts' bf16-only grouped mm, as on one GPU


@dataclass
class RankTrace:
    """One traced rank: its tracker and the bytes counted from its tensors."""

    tracker: RankTracker
    param: int = 0
    grad: int = 0
    optimizer: int = 0
    layer_saved: list[int] = field(default_factory=list)
    """Unique storages autograd saves while each decoder layer runs, parameters excluded."""

    def peak(self, rounded: bool = True) -> tuple[int, int]:
        """(peak allocated bytes, event index); CUDA's 512 B rounding unless `rounded=False`."""
        curve = self.tracker.live_curve(rounded=rounded)
        at = int(curve.argmax())
        return int(curve[at]), at


@contextlib.contextmanager
def _real_meshes():
    """FSDP2 x tp joins the two sub-meshes (`FSDPParam._init_sharding_spec_tp` ->
    `DeviceMesh._concatenate`), which computes on the rank table's values: done on real tensors,
    outside the fake mode (a mesh's rank table is host data, no device memory)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh._concatenate

    def concatenate(meshes):
        with unset_fake_temporarily():
            return original(meshes)

    DeviceMesh._concatenate = staticmethod(concatenate)
    try:
        yield
    finally:
        DeviceMesh._concatenate = original


@contextlib.contextmanager
def _fake_world(rank: int, world: int):
    """torch's fake process group for this process, torn down afterwards."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise SpecError("method", "trace", ("analytic",), reason="a process group is already "
                        "initialised in this process; the trace tier needs its own fake one")
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def trace_rank(spec: TrainingSpec, rank: int = 0, backend: str = "fake") -> RankTrace:
    """Run `spec`'s rank `rank` on `backend` ("fake" or "real" CPU tensors): a tp / FSDP2 x tp
    or FSDP2 x ep rank (rank 0 is the highest), or pipeline rank `rank`."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    from hybridmem.models.loader import load_config

    refused = refusal(spec)
    if refused is not None:
        raise refused
    ps = spec.parallel
    dp, cp, tp = ps.data_shard, ps.cp, ps.tp
    config = load_config(spec.model)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if backend == "fake" else contextlib.nullcontext()
    if ps.pp > 1:
        with _fake_world(rank, ps.pp):
            return _traced_pipeline(spec, config, rank, mode)
    with _fake_world(rank, dp * cp * tp), _real_meshes():
        # the mesh reads its rank table's values: built on real tensors, before the fake mode
        if ps.ep > 1:
            # torchtitan's MoE meshes (`ParallelDims`): experts over ep, their FSDP over
            # dp_shard / ep ("dp_shard_mod_ep"), the dense layers' FSDP over all of dp_shard;
            # transformers' dispatch reads the group holding the same batch (tp, here 1 rank)
            world = init_device_mesh("cpu", (dp // ps.ep, ps.ep),
                                     mesh_dim_names=("efsdp", "ep"))
            alone = init_device_mesh("cpu", (dp, 1), mesh_dim_names=("batch", "tp"))
            return _traced_experts(spec, config, (world._flatten("dp"), world["efsdp"],
                                                  world["ep"], alone["tp"]), mode)
        mesh = init_device_mesh("cpu", (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
        # FSDP2 shards over dp x cp (torchtitan `parallel_dims`: the `dp_shard_cp` mesh)
        shard_mesh = mesh["dp", "cp"]._flatten("dp_cp") if cp > 1 else mesh["dp"]
        return _traced(spec, config, (shard_mesh, mesh["tp"], mesh["cp"]), mode)


def _mp_policy(spec: TrainingSpec):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if spec.precision == "bf16-mixed" else MixedPrecisionPolicy())


def _model_step(model, batch: dict, tracker, train_context=None) -> callable:
    """forward (HF's loss) and backward of one iteration, inside `loss_parallel` (torchtitan's
    train context; nothing changes without DTensor logits) and `train_context(batch)`, which
    yields the batch the step sees (`cp_step`), if given."""
    from torch.distributed.tensor.parallel import loss_parallel

    def run(it: int) -> None:
        tracker.mark("forward", it)
        with loss_parallel(), (train_context(batch) if train_context
                               else contextlib.nullcontext(batch)) as inputs:
            loss = model(**inputs).loss
            tracker.mark("backward", it)
            loss.backward()
            del loss

    return run


def _traced(spec: TrainingSpec, config, meshes, mode) -> RankTrace:
    from torch.distributed.fsdp import fully_shard

    from hybridmem.trace.inputs import make_batch
    from hybridmem.trace.model import build_model

    ps = spec.parallel
    dp_mesh, tp_mesh, cp_mesh = meshes
    with mode:
        built = spec.with_(precision="fp32") if spec.precision == "bf16-mixed" else spec
        model = build_model(built, config)
        if ps.tp > 1:
            apply_tp(model, tp_mesh, ps.sequence_parallel)
        if ps.data_shard * ps.cp > 1 and ps.strategy == "fsdp":
            mp = _mp_policy(spec)
            for layer in model.model.layers:
                fully_shard(layer, mesh=dp_mesh, mp_policy=mp)
            fully_shard(model, mesh=dp_mesh, mp_policy=mp)
        batch = make_batch(spec, config, model, torch.float32)[0]
        ids = batch["input_ids"]
        if ps.sequence_parallel or ps.cp > 1:  # a sequence shard cannot derive its positions
            batch["position_ids"] = torch.arange(ids.shape[1])[None].expand_as(ids).contiguous()
        # foreach (`--optimizer adamw`) refuses a mix of DTensors and plain tensors: FSDP2 makes
        # every param a DTensor; under tp alone the norms stay plain and AdamW runs per
        # parameter; under cp alone no param is a DTensor
        kinds = {hasattr(p, "_local_tensor") for p in model.parameters()}
        foreach = len(kinds) == 1
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
        tracker = RankTracker()
        train_context = cp_step(cp_mesh) if ps.cp > 1 else None
        return _run([model], list(model.model.layers), opt, batch.values(), tracker,
                    _model_step(model, batch, tracker, train_context))


def cp_step(cp_mesh):
    """torchtitan's context-parallel train context for one step: a fresh copy of the batch
    (the data loader's) is sharded on the sequence by torch's `context_parallel` (buffers
    `input_ids`, `labels`, `position_ids` on dim 1, not restored: torchtitan's
    `no_restore_buffers={inputs, labels}`; the position ids stand in for its `freqs_cis`), and
    SDPA runs torch's ring attention (`ring_cpu.cpu_ring_attention`) until the backward ends."""
    from torch.distributed.tensor.experimental import context_parallel

    from hybridmem.parallel.ring_cpu import cpu_ring_attention

    @contextlib.contextmanager
    def step(batch: dict):
        local = {k: v.clone() for k, v in batch.items()}
        names = [k for k in ("input_ids", "labels", "position_ids") if k in local]
        buffers = [local[k] for k in names]
        with cpu_ring_attention(), context_parallel(
                cp_mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                no_restore_buffers=set(buffers)):
            yield local

    return step


def _traced_experts(spec: TrainingSpec, config, meshes, mode) -> RankTrace:
    """An FSDP2 x ep rank as torchtitan lays a MoE model out (`apply_fsdp` with ep: each
    layer's experts `fully_shard`ed over `dp_shard / ep` first, then the layer and the root
    over `dp_shard`), the experts split by transformers' own plan (`trace_experts`)."""
    from torch.distributed.fsdp import fully_shard

    from hybridmem.parallel.trace_experts import apply_ep
    from hybridmem.trace.inputs import make_batch
    from hybridmem.trace.model import build_model

    dp_mesh, efsdp_mesh, ep_mesh, tp_mesh = meshes
    with mode:
        built = spec.with_(precision="fp32") if spec.precision == "bf16-mixed" else spec
        model = build_model(built, config)
        apply_ep(model, ep_mesh, tp_mesh)
        mp = _mp_policy(spec)
        for layer in model.model.layers:
            fully_shard(layer.mlp.experts, mesh=efsdp_mesh, mp_policy=mp)
            fully_shard(layer, mesh=dp_mesh, mp_policy=mp)
        fully_shard(model, mesh=dp_mesh, mp_policy=mp)
        batch = make_batch(spec, config, model, torch.float32)[0]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        tracker = RankTracker()
        return _run([model], list(model.model.layers), opt, batch.values(), tracker,
                    _model_step(model, batch, tracker))


def _traced_pipeline(spec: TrainingSpec, config, rank: int, mode) -> RankTrace:
    """Pipeline rank `rank`: its stages of the model (`trace_pipeline.build`) stepped by the
    spec's schedule over `pp_microbatches` micro-batches of `micro_batch` samples each."""
    from hybridmem.models.loader import load_config_dict
    from hybridmem.parallel import trace_pipeline
    from hybridmem.parallel.layout import stage_sizes
    from hybridmem.torch_dtype import PARAM_DTYPE
    from hybridmem.trace.inputs import make_batch
    from hybridmem.trace.model import build_model

    ps = spec.parallel
    layers = int(load_config_dict(spec.model)[1]["num_hidden_layers"])
    sizes = stage_sizes(layers, ps.pp * ps.pp_virtual_stages)

    def layers_of(stage: int) -> list[int]:
        start = sum(sizes[:stage])
        return list(range(start, start + sizes[stage]))

    with mode:
        step_batch = make_batch(spec.with_(micro_batch=spec.micro_batch * ps.microbatches),
                                config, None, torch.float32)[0]
        schedule, parts, stages = trace_pipeline.build(
            lambda: build_model(spec, config), ps, rank, layers_of, spec.micro_batch,
            spec.seq_len, config.hidden_size, config.vocab_size, PARAM_DTYPE[spec.precision])
        params = [p for part in parts for p in part.parameters()]
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
        tracker = RankTracker()
        for stage in stages:
            stage.tracker = tracker

        def run(it: int) -> None:
            for stage in stages:
                stage.iteration = it
            tracker.mark("forward", it)
            trace_pipeline.step(schedule, stages, step_batch["input_ids"],
                                step_batch["labels"])

        decoder = [layer for part in parts for layer in part.model.model.layers
                   if type(layer).__name__ != "PipelineIdentityLayer"]
        return _run(parts, decoder, opt, step_batch.values(), tracker, run)


def _run(modules, layers, opt, inputs, tracker: RankTracker, step) -> RankTrace:
    """Two iterations of `step` (forward and backward) and the optimizer, everything labelled
    as `trace.runner` labels it; `layers`' saved activations counted per layer."""
    out = RankTrace(tracker)
    current, seen, saved = [None], set(), {}

    def pack(t):
        # storages are told apart by the tracker's ids (a fake storage has no data pointer)
        x = _local(t)
        tracker.label(x, "activation")
        sid = tracker.track(x.untyped_storage())
        if current[0] is not None and sid is not None and sid not in seen \
                and tracker.storages[sid].category != "param":
            seen.add(sid)
            saved[current[0]] = saved.get(current[0], 0) + tracker.storages[sid].nbytes
        # a detached alias (same storage, no grad_fn): returning `t` itself would store, in
        # the SavedVariable of the node that produced `t`, a tensor pointing back at that
        # node, a cycle outside Python's gc that only releasing the saved variables breaks.
        # A full backward releases them all; zero bubble's input-gradient step keeps the graph
        # (`stage_backward_input`: `retain_graph=True`) and its weight step releases only the
        # nodes on the way to a weight, so every other saved output would leak, step after
        # step, where torch without the hook frees it (measured: 3 steps, rank 1 grows
        # 5.74 -> 7.16 MB with `t`, flat with the alias)
        return t.detach()

    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, *k, i=i: current.__setitem__(0, i)))
        hooks.append(layer.register_forward_hook(lambda m, a, *k: current.__setitem__(0, None)))
    params = [p for m in modules for p in m.parameters()]
    count = lambda ts: sum(_local(t).numel() * _local(t).element_size() for t in ts)  # noqa: E731
    with tracker, fsdp_storage_events(tracker):
        for p in params:
            tracker.label(_local(p), "param")
        for m in modules:
            for b in m.buffers():
                tracker.label(_local(b), "param")
        for t in inputs:
            if isinstance(t, torch.Tensor):
                tracker.label(t, "activation")
        for it in range(ITERATIONS):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                step(it)
            for p in params:
                if p.grad is not None:
                    tracker.label(_local(p.grad), "grad")
            if it == 0:
                out.layer_saved = [saved[i] for i in sorted(saved)]
                out.param = count(params)
                out.grad = count(p.grad for p in params if p.grad is not None)
            tracker.mark("optimizer", it)
            opt.step()
            for state in opt.state.values():
                for k, v in state.items():
                    if k != "step" and isinstance(v, torch.Tensor):
                        tracker.label(_local(v), "optimizer")
                    elif isinstance(v, torch.Tensor):  # AdamW's scalar steps stay on the host
                        tracker.label(_local(v), "host")
            if it == 0:
                out.optimizer = count(v for s in opt.state.values()
                                      for k, v in s.items() if k != "step")
            opt.zero_grad(set_to_none=True)
            current[0] = None
    for h in hooks:
        h.remove()
    return out


def replayed(tracker: RankTracker, capacity: int | None):
    """The rank's own alloc/free stream (every tracked storage's birth and death, host and
    paged ones left out, as `trace.result` leaves them) replayed through the caching-allocator
    simulator within `capacity` (`allocator.reserved.capped_replay`): (replay, ran out)."""
    from hybridmem.allocator import AllocatorConfig
    from hybridmem.allocator.reserved import capped_replay
    from hybridmem.trace.tracker import OFF_ALLOCATOR

    events = []
    for e in tracker.events:
        sid = e if e >= 0 else ~e
        st = tracker.storages[sid]
        if st.category not in OFF_ALLOCATOR:
            events.append(("alloc", sid, st.nbytes) if e >= 0 else ("free", sid, 0))
    return capped_replay(events, AllocatorConfig.from_environ(), capacity)


def estimate(spec: TrainingSpec, gpu: GPU | None = None) -> Prediction:
    """The trace tier's answer for a tp / FSDP2 x tp `spec`: rank 0's traced peak."""
    from hybridmem.parallel.phases import NCCL_BYTES
    from hybridmem.parallel.ranks import layout_dict, layout_text
    from hybridmem.parallel.states import model_tensors
    from hybridmem.job.parallel import ParallelSpec

    ps = spec.parallel
    # every pipeline rank holds different layers and in-flight micro-batches: each traced,
    # the highest answered; tp / ep ranks are the same shape, rank 0 the highest of them
    traced_ranks = [trace_rank(spec, rank=r) for r in range(ps.pp)]
    peaks = [t.peak()[0] for t in traced_ranks]
    highest = max(range(ps.pp), key=peaks.__getitem__)
    traced = traced_ranks[highest]
    tracker = traced.tracker
    allocated, at = traced.peak()
    breakdown = dict.fromkeys(("param", "grad", "optimizer", "activation", "temporary",
                               "workspace", "context", "fragmentation"), 0)
    for s in tracker.live_at(at):
        if s.category not in ("host", "paged"):
            key = s.category if s.category in breakdown else "temporary"
            breakdown[key] += round_size(s.nbytes)
    assert sum(breakdown.values()) == allocated
    from hybridmem.parallel.phases import rank_capacity

    sim, oom = replayed(tracker, rank_capacity(spec, gpu))
    breakdown["fragmentation"] = max(0, sim.peak_reserved - allocated)
    breakdown["context"] = CONTEXT_BYTES + NCCL_BYTES
    # cuBLAS's two workspaces (the forward thread's and the autograd device thread's, as
    # `trace.runner.train` adds them), outside the allocated peak as the analytic tier has them
    breakdown["workspace"] = 2 * cublas_workspace(gpu)
    phase, iteration = tracker.phase_at(at)
    params = model_tensors(spec.with_(parallel=ParallelSpec()))
    peak = Peak(allocated_bytes=allocated, reserved_bytes=allocated + breakdown["fragmentation"],
                device_bytes=sum(breakdown.values()), phase=phase, iteration=iteration)
    notes = (f"per rank of {ps.world_size} GPUs: {layout_text(ps)}", _traced_note(ps, peaks),
             "fragmentation per rank: the traced rank's own alloc/free stream replayed "
             "through the allocator simulator" + (" (it ran out of memory within the GPU's "
                                                  "capacity: the unlimited replay's)" if oom else ""),
             f"NCCL buffers outside PyTorch: nominal {NCCL_BYTES >> 20} MiB in context")
    extras = {"world_size": ps.world_size, "strategy": ps.strategy, "per_rank": True,
              "layout": layout_dict(ps), "highest_rank": highest,
              "layer_saved": traced.layer_saved}
    if ps.pp > 1:
        extras["ranks"] = [{"pp_rank": r, "allocated_bytes": b} for r, b in enumerate(peaks)]
    return Prediction(
        model=spec.model, method="trace+layout", params_total=params.params,
        params_trainable=params.trainable, breakdown=breakdown, peak=peak, notes=notes,
        extras=extras, modules=(), gpu_name=gpu.name if gpu else None,
        gpu_memory_bytes=gpu.memory_bytes if gpu else None)


def _traced_note(ps, peaks: list[int]) -> str:
    """What ran, and why the answered rank is the highest."""
    if ps.pp > 1:
        top = max(range(len(peaks)), key=peaks.__getitem__)
        rest = ", ".join(f"rank {r} {b / 2**20:.2f} MiB" for r, b in enumerate(peaks) if r != top)
        why = (f"holds {min(ps.microbatches, ps.pp - top)} micro-batches in flight"
               if ps.pp_schedule == "1f1b" and top < ps.pp - 1 else
               "holds the lm_head + loss" if top == ps.pp - 1 else "its stages' layers")
        return (f"traced: torch.distributed.pipelining {ps.pp_schedule} stages under the fake "
                f"process group, every pipeline rank; highest: pipeline rank {top} "
                f"({peaks[top] / 2**20:.2f} MiB, {why}; {rest})")
    what = ("transformers' expert-parallel plan and fully_shard (torchtitan's MoE layout)"
            if ps.ep > 1 else "torch's " + " and ".join(
                w for w, on in (("parallelize_module (torchtitan's plan)", ps.tp > 1),
                                ("context_parallel (ring attention, allgather)", ps.cp > 1),
                                ("fully_shard", ps.data_shard * ps.cp > 1
                                 and ps.strategy == "fsdp")) if on))
    return (f"traced: {what} under the fake process group, rank 0 (DTensor and FSDP2 put the "
            "uneven shards' extra rows on the first ranks, so rank 0 is the highest)")
