"""What a rank holds at each phase of a step, shared by the data-parallel estimate
(`parallel.estimate`), the model-parallel one (`parallel.ranks`) and the per-rank stream
(`parallel.stream`): NCCL's buffers, one forward/backward point of a timeline, the precision
the forward computes in, and the two phase sums (resident states + a point, and the step).
"""

from __future__ import annotations

import dataclasses

from hybridmem.allocator.overheads import CUDA_CONTEXT_DEFAULT, allocator_capacity
from hybridmem.categories import empty_breakdown
from hybridmem.gpus import GPU
from hybridmem.job.precision import DTYPE_BYTES
from hybridmem.job.spec import POLICIES, TrainingSpec
from hybridmem.parallel.sharding import RankStates

# NCCL allocates its buffers outside the caching allocator: NCCL_BUFFSIZE (default 4 MiB, NCCL
# env docs) per channel per peer connection. A ring has 2 peers; 16 channels is a typical
# intra-node NVLink count. A nominal figure: the learned tier corrects it from measurements.
NCCL_BUFFSIZE = 4 * 2**20
NCCL_CHANNELS = 16
NCCL_RING_PEERS = 2
NCCL_BYTES = NCCL_BUFFSIZE * NCCL_CHANNELS * NCCL_RING_PEERS


@dataclasses.dataclass(frozen=True, slots=True)
class ActPoint:
    """One forward/backward point of the single-GPU timeline, without the model states."""

    phase: str
    grad_fraction: float
    """Share of all gradients already produced (0 in forward, growing in backward)."""
    activation: int
    temporary: int
    gathered: int | None = None
    """Gathered params at this point (`fsdp_points.at_point`); None: the states' constant."""
    grad: int | None = None
    """Grads and reduce buffers at this point (`fsdp_points.at_point`); None: the states'
    grads scaled by `grad_fraction`, plus their reduce buffers in backward."""


def rank_capacity(spec: TrainingSpec, gpu: GPU | None) -> int | None:
    """Bytes one rank's caching allocator may reserve on `gpu`: its memory minus the CUDA
    context (`overheads.CUDA_CONTEXT_DEFAULT`) and NCCL's buffers (`NCCL_BYTES`, cudaMalloc'd
    by NCCL itself, outside PyTorch's allocator); None without a GPU (unlimited)."""
    if gpu is None:
        return None
    nccl = NCCL_BYTES if spec.parallel.world_size > 1 else 0
    return allocator_capacity(gpu, CUDA_CONTEXT_DEFAULT + nccl)


def forward_precision(spec: TrainingSpec) -> str:
    """The precision the forward and backward compute in on each rank.

    FSDP2 with a 16-bit `MixedPrecisionPolicy.param_dtype` over wider (fp32) params casts each
    shard to that dtype as it is all-gathered (`FSDPParam.init_unsharded_param`: the unsharded
    param is allocated in `param_dtype`; `_fsdp_param.py`), so the module runs on 16-bit
    params: the embedding output, the residual stream and every saved tensor are 16-bit, and
    autocast (if the trainer also enters it) has no fp32 weight to cast, hence no cast cache
    (`cached_cast` caches only casts of fp32 leaf tensors that require grad,
    aten/src/ATen/autocast_mode.cpp). Its activations are the pure 16-bit precision's; the
    sharded states stay in the params' own dtype (`sharding.fsdp`)."""
    ps = spec.parallel
    if ps.strategy != "fsdp" or ps.mp_param_dtype not in ("bf16", "fp16"):
        return spec.precision
    if POLICIES[spec.precision].param_bytes <= DTYPE_BYTES[ps.mp_param_dtype]:
        return spec.precision
    return ps.mp_param_dtype


def fwd_bwd(states: RankStates, point: ActPoint, extra: dict) -> dict:
    """One forward/backward point: gathered params and reduce buffers on top of the resident
    states; grads that grow with the backward scaled like the single-GPU grads at the point."""
    out = empty_breakdown()
    growing = states.grad - states.grad_fixed
    out["param"] = states.param + (states.gathered if point.gathered is None else point.gathered)
    out["grad"] = states.grad_fixed + (round(growing * point.grad_fraction) + (
        states.comm if point.phase == "backward" else 0) if point.grad is None else point.grad)
    out["optimizer"] = states.optimizer
    out["activation"] = point.activation
    out["temporary"] = point.temporary
    out.update(extra)
    return out


def step(states: RankStates, base: Prediction, extra: dict) -> dict:
    """Optimizer step: every grad, the state and the step's transients on this rank's shard."""
    out = empty_breakdown()
    out.update(param=states.param, grad=states.grad, optimizer=states.optimizer,
               temporary=states.step_temporary)
    if base.peak.phase == "optimizer":
        out["activation"] = base.breakdown["activation"]  # the batch, alive all iteration
    out.update(extra)
    return out
