"""Per-rank bytes of parameters, gradients, optimizer state and communication buffers.

One function per scheme; each returns a `RankStates`. Notation of the ZeRO paper
(Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", Sec. 5.1 / Fig. 1): Psi = trainable parameters, N = data-parallel degree,
K = optimizer bytes per parameter (12 for mixed-precision Adam: fp32 master + two fp32 states).

    baseline DP   (2 + 2 + K) Psi
    P_os          2 Psi + 2 Psi + K Psi / N
    P_os+g        2 Psi + (2 + K) Psi / N
    P_os+g+p      (2 + 2 + K) Psi / N

with 2 = bf16 bytes; here the 2s are the precision policy's param/grad bytes, and the real
DeepSpeed / PyTorch buffers (reduce buckets, gathered parameters, ...) come on top, each citing
the code that allocates it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hybridmem.allocator import alloc
from hybridmem.job.optimizers import Stepped, flat, raw, rule
from hybridmem.job.parallel import ParallelSpec
from hybridmem.job.precision import DTYPE_BYTES
from hybridmem.parallel.states import ModelTensors, Tensor
from hybridmem.job.resolved import Job
from hybridmem.job.spec import POLICIES, TrainingSpec

# DeepSpeed keeps an fp32 partition of the trainable params whatever the model dtype
# (stage_1_and_2.py `single_partition_of_fp32_groups`, stage3.py `fp32_partitioned_groups_flat`).
DS_MASTER_BYTES = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class RankStates:
    """Bytes one rank holds on its GPU, split by when they are alive."""

    param: int
    """Parameters resident all the time (replicated or this rank's shard)."""
    grad: int
    """Gradient storage and buckets held from backward through the optimizer step."""
    optimizer: int
    """Master weights and optimizer state on the GPU."""
    grad_fixed: int = 0
    """Part of `grad` allocated up front (buckets, partition buffers) rather than growing with
    the backward pass like `.grad` tensors do."""
    gathered: int = 0
    """Parameters unsharded only during forward/backward (ZeRO-3 live set, FSDP units)."""
    comm: int = 0
    """Gradient reduction buffers alive only during backward."""
    step_temporary: int = 0
    """Transient tensors of the optimizer step (fp32 grad partition, foreach temporaries)."""
    paged: int = 0
    """Optimizer state in CUDA unified memory (bitsandbytes paged), outside the allocator."""
    detail: dict[str, int] = field(default_factory=dict)
    """Named buffers, for the JSON output and the docs."""


def param_elem_bytes(spec: TrainingSpec, t: Tensor, cast_all: bool = False) -> int:
    """Bytes per element of a parameter; DeepSpeed casts the whole module (`cast_all`)."""
    policy = POLICIES[spec.precision]
    return policy.param_bytes if cast_all or t.itemsize is None else t.itemsize


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _shape(t: Tensor) -> tuple[int, ...]:
    """`t`'s shape; a Tensor given without one is (dim0, rest) (1-D when numel == dim0)."""
    if t.shape:
        return t.shape
    return (t.numel,) if t.numel == t.dim0 else (t.dim0, t.numel // t.dim0)


def _stepped(spec: TrainingSpec, t: Tensor, shape: tuple[int, ...] | None = None) -> Stepped:
    """What the optimizer steps for tensor `t` (or its shard of `shape`): state in the param's
    dtype when it is fixed (fp32 LoRA adapters), else the policy's (as `analytic.states`)."""
    shape = shape if shape is not None else _shape(t)
    state = 4 if t.itemsize is not None else POLICIES[spec.precision].state_bytes
    return Stepped(math.prod(shape), shape, state)


def _optimizer(spec: TrainingSpec, stepped: list[Stepped]) -> tuple[int, int, int]:
    """(allocator state + shared, paged state, step temporary) of the spec's optimizer over
    `stepped` (`job.optimizers`): states in raw bytes as the ZeRO formulas count them; the step
    temporary as allocations (512 B-rounded), so a replica's equals the single-GPU tier's."""
    r = rule(spec.optimizer)
    state = sum(raw(*a) for s in stepped for a in r.state(s)) + sum(
        raw(*a) for a in r.shared(stepped))
    paged = sum(raw(*a) for s in stepped for a in r.paged_state(s))
    return state, paged, r.temporary(stepped, alloc.t) if stepped else 0


def replicated(spec: TrainingSpec, mt: ModelTensors) -> RankStates:
    """One GPU (or any replica): every tensor whole. Grads and state in the param's dtype when it
    is fixed (fp32 LoRA adapters), else the policy's."""
    policy = POLICIES[spec.precision]
    param = sum(t.numel * param_elem_bytes(spec, t) for t in mt.tensors)
    grad = opt = 0
    for t in mt.tensors:
        if not t.trainable:
            continue
        grad += t.numel * (t.itemsize or policy.grad_bytes)
        opt += t.numel * policy.master_bytes
    state, paged, temp = _optimizer(spec, [_stepped(spec, t) for t in mt.tensors if t.trainable])
    return RankStates(param=param, grad=grad, optimizer=opt + state, step_temporary=temp,
                      paged=paged)


def ddp(spec: TrainingSpec, mt: ModelTensors) -> RankStates:
    """torch DDP: a full replica plus the reducer's flat bucket buffers.

    With `gradient_as_bucket_view=False` (default) `Reducer::initialize_buckets`
    (torch/csrc/distributed/c10d/reducer.cpp) allocates `bucket.gradients` as one flat tensor per
    bucket covering every grad, i.e. a second copy of all grads; with True, `.grad`s are views
    into the buckets and there is no copy. `bucket_cap_mb` only sets how the copy is split.
    """
    base = replicated(spec, mt)
    ps = spec.parallel
    buckets = 0 if ps.gradient_as_bucket_view else base.grad
    n_buckets = max(1, _ceil_div(base.grad, int(ps.bucket_cap_mb * 2**20)))
    return RankStates(param=base.param, grad=base.grad + buckets, optimizer=base.optimizer,
                      grad_fixed=buckets,
                      step_temporary=base.step_temporary, paged=base.paged,
                      detail={"ddp_bucket_bytes": buckets, "ddp_buckets": n_buckets})


def _ipg_buffers(ps: ParallelSpec, p: int, stage: int) -> int:
    """DeepSpeed reduce ("ipg") buckets of `reduce_bucket_size` elements in the model dtype.

    Stage 1/2: `DeepSpeedZeroOptimizer.backward` allocates `ipg_buffer` when contiguous_gradients,
    a second one ("double buffers") when overlap_comm. Stage 3: one `__ipg_bucket_flat_buffer`
    (`DeepSpeedZeroOptimizer_Stage3._setup_for_real_optimizer`).
    """
    # CPU offload forces contiguous gradients (`contiguous_gradients or self.cpu_offload`)
    if not (ps.contiguous_gradients or ps.offload_optimizer != "none"):
        return 0
    copies = 1 if stage == 3 else (2 if ps.overlap else 1)
    return copies * ps.reduce_bucket_size * p


def zero(spec: TrainingSpec, mt: ModelTensors) -> RankStates:
    """DeepSpeed ZeRO stage 1, 2 or 3 (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py)."""
    ps, n, stage = spec.parallel, spec.parallel.world_size, spec.parallel.zero_stage
    policy = POLICIES[spec.precision]
    p = policy.param_bytes  # the engine casts the module to bf16/fp16 (`module.bfloat16()`)
    g = p  # grads and reduce buckets are in the model dtype (`self.dtype`)
    psi_all, psi_t = mt.params, mt.trainable
    shard_t = _ceil_div(psi_t, n)  # flat partitions, padded to equal size
    offload_opt = ps.offload_optimizer != "none"
    # K per element of the fp32 partition: master copy + state on the flat 1-D partition
    # (DeepSpeed hands the wrapped optimizer one flat fp32 tensor per group)
    state, paged, _ = _optimizer(spec, [flat(shard_t)])
    optimizer = 0 if offload_opt else DS_MASTER_BYTES * shard_t + state
    paged = 0 if offload_opt else paged
    ipg = _ipg_buffers(ps, p, stage)
    detail = {"ipg_bucket_bytes": ipg}
    gathered = 0
    if stage in (1, 2):
        param = p * psi_all  # `bit16_groups_flat` (trainable) + frozen params, all replicated
        if stage == 1:
            grad_store = g * psi_t  # P_os keeps full gradients until the step
        elif offload_opt:
            # grads go to the CPU as they are reduced; one GPU staging buffer of the largest param
            # (`temp_grad_buffer_for_gpu_offload`)
            grad_store = p * max((t.numel for t in mt.tensors if t.trainable), default=0)
        else:
            grad_store = g * shard_t  # `grads_in_partition` (contiguous_gradients)
        stepped = shard_t
    else:
        persist = sum(t.numel for t in mt.tensors
                      if t.numel <= ps.stage3_param_persistence_threshold)
        sharded = psi_all - persist
        # `ds_tensor` partitions (zero.Init partitions frozen params too); small params persist
        param = p * persist + (0 if ps.offload_param != "none" else p * _ceil_div(sharded, n))
        gathered = p * _zero3_live(ps, mt, sharded)
        grad_store = 0 if offload_opt else g * shard_t  # `grad_partitions_flat_buffer`
        # the optimizer steps one sub-group at a time; a sub-group holds whole parameter
        # partitions, at least one (stage3.py `_create_fp16_sub_groups` closes a group once it
        # reaches sub_group_size: 0 puts each parameter in its own)
        largest_part = max((_ceil_div(t.numel, n) for t in mt.tensors if t.trainable), default=0)
        stepped = min(max(ps.sub_group_size, largest_part), shard_t)
        detail.update(persistent_param_bytes=p * persist, gathered_param_bytes=gathered)
    # step: the flat grad partition is upcast to fp32 (`single_grad_partition ... .to(fp32)`,
    # stage3 `_prepare_fp32_grad_for_sub_group`), then the wrapped optimizer runs on it
    step = 0 if offload_opt else (DS_MASTER_BYTES * stepped
                                  + _optimizer(spec, [flat(stepped)])[2])
    detail.update(grad_partition_bytes=grad_store, fp32_partition_bytes=0 if offload_opt
                  else DS_MASTER_BYTES * shard_t)
    # ZeRO-1 grads are ordinary .grad tensors; stage 2/3 partition buffers exist from the first
    # reduction (stage 2) or from initialisation (stage 3): counted for the whole backward
    fixed = ipg + (0 if stage == 1 else grad_store)
    return RankStates(param=param, grad=grad_store + ipg, optimizer=optimizer, gathered=gathered,
                      grad_fixed=fixed, paged=paged,
                      step_temporary=step, detail=detail)


def _zero3_live(ps: ParallelSpec, mt: ModelTensors, sharded: int) -> int:
    """Elements gathered at once under ZeRO-3 (PartitionedParameterCoordinator).

    A module's params are fetched whole, plus `stage3_prefetch_bucket_size` ahead; params whose
    next use is within `stage3_max_reuse_distance` elements are not released, which at the
    forward->backward turn keeps that many elements gathered; `stage3_max_live_parameters`
    caps the total. An approximation of the coordinator's trace-based policy.
    """
    largest = max((t.numel for t in mt.tensors
                   if t.numel > ps.stage3_param_persistence_threshold), default=0)
    live = max(largest + ps.stage3_prefetch_bucket_size, min(ps.stage3_max_reuse_distance, sharded))
    return min(max(largest, min(live, ps.stage3_max_live_parameters)), sharded)


def fsdp_shard(t: Tensor, n: int) -> int:
    """Elements of one rank's FSDP2 shard: dim 0 chunked with `torch.chunk` and padded to the
    first chunk's size (`FSDPParam._init_sharded_param`: padded_sharded_size = chunks[0].size())."""
    return _ceil_div(t.dim0, n) * (t.numel // t.dim0)


def fsdp(spec: TrainingSpec, mt: ModelTensors) -> RankStates:
    """PyTorch FSDP2 (`fully_shard` on each repeated layer and on the root).

    Sharded params, grads and optimizer state stay in the params' own dtype; the unsharded
    all-gather output is in `MixedPrecisionPolicy.param_dtype`; the reduce-scatter input in
    `reduce_dtype` (`_fsdp_collectives.foreach_reduce`).
    """
    ps, n = spec.parallel, spec.parallel.world_size
    policy = POLICIES[spec.precision]
    m = policy.compute_bytes if ps.mp_param_dtype == "auto" else DTYPE_BYTES[ps.mp_param_dtype]
    r = m if ps.mp_reduce_dtype == "auto" else DTYPE_BYTES[ps.mp_reduce_dtype]
    param = grad = opt = 0
    shards: list[Stepped] = []
    for t in mt.tensors:
        s = param_elem_bytes(spec, t)
        k = fsdp_shard(t, n)
        param += s * k
        if t.trainable:
            grad += s * k  # reduce output is cast back to the param's dtype (`_to_dtype_if_needed`)
            opt += policy.master_bytes * k
            # the optimizer steps the local shard (a DTensor's local tensor: dim 0 chunked)
            shards.append(_stepped(spec, t, (_ceil_div(t.dim0, n), *_shape(t)[1:])))
    units = mt.units()
    root, _ = units.pop("root", (0, 0))
    largest, largest_t = max(units.values(), default=(0, 0))
    if ps.reshard_after_forward:
        # the root is never resharded after forward (`FSDPState._lazy_init`: root
        # post_forward_mesh_info = None); one unit computes while the next is all-gathered
        unsharded = root + 2 * largest
    else:
        unsharded = mt.params  # every unit stays unsharded from its forward to its backward
    gathered = m * unsharded + m * _ceil_div(largest, n)  # + all-gather copy-in of the next unit
    # backward of one unit: unsharded grads (m) copied into the reduce-scatter input (r), whose
    # output shard (r / N) is then viewed as the sharded grads
    comm = largest_t * (m + r) + r * _ceil_div(largest_t, n)
    state, paged, temp = _optimizer(spec, shards)
    return RankStates(param=param, grad=grad, optimizer=opt + state, gathered=gathered, comm=comm,
                      step_temporary=temp, paged=paged,
                      detail={"unsharded_param_bytes": m * unsharded, "reduce_scatter_bytes": comm,
                              "gather_dtype_bytes": m, "reduce_dtype_bytes": r})


SCHEMES = {"none": replicated, "ddp": ddp, "zero1": zero, "zero2": zero, "zero3": zero,
           "fsdp": fsdp}


def rank_states(spec: Job, mt: ModelTensors) -> RankStates:
    """Per-rank states of `spec` (its precision decided: a `Job`) under its `parallel.strategy`."""
    return SCHEMES[spec.parallel.strategy](spec, mt)
