"""Per-rank param/grad/optimizer bytes against hand derivations from the ZeRO paper and the
DeepSpeed / PyTorch buffers they model."""

from __future__ import annotations

import pytest

from hybridmem.parallel.sharding import ddp, fsdp, fsdp_shard, replicated, zero
from hybridmem.job.parallel import ParallelSpec
from hybridmem.parallel.states import ModelTensors, Tensor, model_tensors
from hybridmem.job.spec import TrainingSpec

GB = 10**9  # the ZeRO paper's Figure 1 uses decimal GB


def _spec(strategy: str, n: int, precision: str = "bf16-master", optimizer: str = "adamw",
          **parallel) -> TrainingSpec:
    return TrainingSpec(model="llama-3.2-3b", precision=precision, optimizer=optimizer,
                        parallel=ParallelSpec(world_size=n, strategy=strategy, **parallel))


def _psi(numel: int, trainable: bool = True, unit: str = "root") -> ModelTensors:
    return ModelTensors((Tensor(numel, numel, None, trainable, unit),), 0)


# ZeRO paper (Rajbhandari et al. 2020), Figure 1: Psi = 7.5B, N = 64, K = 12 (mixed-precision
# Adam: fp32 master 4 + exp_avg 4 + exp_avg_sq 4), bf16 params and grads (2 + 2):
#   baseline  (2 + 2 + K) * Psi          = 16 * 7.5e9        = 120 GB
#   P_os      2Psi + 2Psi + K*Psi/N      = 15 + 15 + 1.40625 = 31.40625 GB  (paper: 31.4)
#   P_os+g    2Psi + (2 + K)*Psi/N       = 15 + 1.640625     = 16.640625 GB (paper: 16.6)
#   P_os+g+p  (2 + 2 + K)*Psi/N          = 16 * 7.5e9 / 64   = 1.875 GB     (paper: 1.9)
PSI, N = 7_500_000_000, 64
FIGURE_1 = {"ddp": 120.0, "zero1": 31.40625, "zero2": 16.640625, "zero3": 1.875}


@pytest.mark.parametrize("strategy", list(FIGURE_1))
def test_zero_paper_figure_1(strategy):
    # contiguous_gradients off and bucket views on: only the paper's model states remain
    spec = _spec(strategy, N, contiguous_gradients=False, gradient_as_bucket_view=True,
                 stage3_param_persistence_threshold=0)
    r = (ddp if strategy == "ddp" else zero)(spec, _psi(PSI))
    assert (r.param + r.grad + r.optimizer) / GB == pytest.approx(FIGURE_1[strategy], abs=1e-9)


@pytest.mark.parametrize("strategy,param,grad,opt", [
    # per-factor split of the same derivation (bytes per parameter x Psi [/ N])
    ("zero1", 2 * PSI, 2 * PSI, 12 * PSI // N),
    ("zero2", 2 * PSI, 2 * PSI // N, 12 * PSI // N),
    ("zero3", 2 * PSI // N, 2 * PSI // N, 12 * PSI // N),
])
def test_zero_factors(strategy, param, grad, opt):
    spec = _spec(strategy, N, contiguous_gradients=False, stage3_param_persistence_threshold=0)
    r = zero(spec, _psi(PSI))
    assert (r.param, r.grad, r.optimizer) == (param, grad, opt)


def test_zero_frozen_params_replicated_until_stage_3():
    # 1e9 frozen + 1e9 trainable, N = 8: stages 1/2 keep the frozen 2e9 B whole (DeepSpeed only
    # flattens requires_grad params); stage 3 partitions all params (zero.Init): 2 * 2e9 / 8
    mt = ModelTensors((Tensor(10**9, 10**9, None, False, "root"),
                       Tensor(10**9, 10**9, None, True, "root")), 0)
    z2 = zero(_spec("zero2", 8, contiguous_gradients=False), mt)
    z3 = zero(_spec("zero3", 8, contiguous_gradients=False, stage3_param_persistence_threshold=0), mt)
    assert z2.param == 2 * 2 * 10**9
    assert z3.param == 2 * 2 * 10**9 // 8
    assert z2.optimizer == z3.optimizer == 12 * 10**9 // 8  # only trainable params have state


def test_deepspeed_fp32_partition_even_without_bf16():
    # precision fp32: params 4, grads 4, and still an fp32 partition clone + 2 fp32 states = 12
    r = zero(_spec("zero2", 4, precision="fp32", contiguous_gradients=False), _psi(4 * 10**6))
    assert (r.param, r.grad, r.optimizer) == (16 * 10**6, 4 * 10**6, 12 * 10**6)


@pytest.mark.parametrize("strategy,overlap,copies", [
    ("zero1", False, 1), ("zero2", False, 1), ("zero2", True, 2), ("zero3", True, 1),
    ("zero3", None, 1),
])
def test_ipg_buckets(strategy, overlap, copies):
    # DeepSpeedZeroOptimizer.backward: one ipg buffer of reduce_bucket_size elements in the model
    # dtype, a second ("double buffers") with overlap_comm; stage 3 has one flat ipg buffer
    spec = _spec(strategy, 8, reduce_bucket_size=1000, overlap_comm=overlap)
    r = zero(spec, _psi(8 * 10**6))
    assert r.detail["ipg_bucket_bytes"] == copies * 1000 * 2


def test_overlap_comm_default_follows_deepspeed():
    assert ParallelSpec(world_size=2, strategy="zero3").overlap is True
    assert ParallelSpec(world_size=2, strategy="zero2").overlap is False


def test_zero_offload_moves_state_off_gpu():
    # ZeRO-Offload: fp32 partition + Adam state + grads on the CPU; the GPU keeps the bf16 params,
    # the ipg bucket and one staging buffer of the largest param (temp_grad_buffer_for_gpu_offload)
    mt = ModelTensors((Tensor(6 * 10**6, 6000, None, True, "root"),
                       Tensor(2 * 10**6, 2000, None, True, "root")), 0)
    r = zero(_spec("zero2", 4, offload_optimizer="cpu", reduce_bucket_size=1000), mt)
    assert r.optimizer == 0 and r.step_temporary == 0
    assert r.grad == 2 * 6 * 10**6 + 2 * 1000
    assert r.param == 2 * 8 * 10**6


def test_zero3_persistence_and_param_offload():
    # params <= stage3_param_persistence_threshold stay whole on every rank
    mt = ModelTensors((Tensor(100, 100, None, True, "root"),
                       Tensor(8 * 10**6, 8000, None, True, "root")), 0)
    spec = _spec("zero3", 8, stage3_param_persistence_threshold=100)
    r = zero(spec, mt)
    assert r.param == 2 * 100 + 2 * 10**6
    off = zero(_spec("zero3", 8, stage3_param_persistence_threshold=100, offload_param="cpu",
                     offload_optimizer="cpu"), mt)
    assert off.param == 2 * 100


def test_zero3_live_parameters():
    # a module is gathered whole, + prefetch bucket, bounded by max_live and the model size
    mt = ModelTensors(tuple(Tensor(10**6, 1000, None, True, "root") for _ in range(100)), 0)
    small = _spec("zero3", 8, stage3_prefetch_bucket_size=3 * 10**6,
                  stage3_max_reuse_distance=1, stage3_param_persistence_threshold=0)
    assert zero(small, mt).gathered == 2 * (10**6 + 3 * 10**6)
    capped = _spec("zero3", 8, stage3_max_live_parameters=2 * 10**6,
                   stage3_param_persistence_threshold=0)
    assert zero(capped, mt).gathered == 2 * 2 * 10**6
    # reuse distance 1e9 (LLaVA's zero3.json) keeps the whole 1e8-element model gathered
    assert zero(_spec("zero3", 8, stage3_param_persistence_threshold=0), mt).gathered == 2 * 10**8


def test_zero_step_fp32_grad_partition():
    # step: the bf16 grad partition is upcast to fp32 (4 B/elem) and torch foreach AdamW adds one
    # fp32 temporary, an allocation rounded up to 512 B (CUDACachingAllocator kMinBlockSize);
    # fused Adam (DeepSpeed's FusedAdam) none
    mt = _psi(8 * 10**6)
    rounded = lambda n: -(-n // 512) * 512  # noqa: E731
    assert zero(_spec("zero2", 8), mt).step_temporary == 4 * 10**6 + rounded(4 * 10**6)
    assert zero(_spec("zero2", 8, optimizer="adamw-fused"), mt).step_temporary == 4 * 10**6
    # stage 3 steps one sub-group at a time, made of whole parameter partitions
    # (stage3.py `_create_fp16_sub_groups`): 80 parameters of 10^5 elements, 12,500 per rank,
    # in sub-groups of 10^5 elements = 8 parameters' partitions
    many = ModelTensors(tuple(Tensor(10**5, 10**5, None, True, "root") for _ in range(80)), 0)
    assert zero(_spec("zero3", 8, sub_group_size=10**5), many).step_temporary == \
        4 * 10**5 + rounded(4 * 10**5)
    # one 8 * 10^6-element parameter: its 10^6-element partition is one sub-group, whatever
    # sub_group_size says (0 included: each parameter its own group)
    for size in (10**5, 0):
        assert zero(_spec("zero3", 8, sub_group_size=size), mt).step_temporary == \
            4 * 10**6 + rounded(4 * 10**6)


def test_ddp_bucket_copy():
    # bf16-mixed: fp32 params/grads; DDP reducer buckets are a second copy of all grads
    spec = _spec("ddp", 2, precision="bf16-mixed")
    mt = _psi(10**6)
    r, one = ddp(spec, mt), replicated(spec, mt)
    assert r.grad == 2 * 4 * 10**6 and r.param == one.param and r.optimizer == one.optimizer == 8 * 10**6
    view = ddp(_spec("ddp", 2, precision="bf16-mixed", gradient_as_bucket_view=True), mt)
    assert view.grad == 4 * 10**6
    # 4e6 B of grads over 25 MiB buckets: one bucket; over 1 MiB buckets: ceil(4e6 / 2**20) = 4
    assert r.detail["ddp_buckets"] == 1
    assert ddp(_spec("ddp", 2, precision="bf16-mixed", bucket_cap_mb=1), mt).detail["ddp_buckets"] == 4


def test_fsdp_dim0_padding():
    # torch.chunk(1003 rows, 4) -> first chunk ceil(1003 / 4) = 251 rows; every rank pads to it
    assert fsdp_shard(Tensor(1003 * 64, 1003, None, True, "root"), 4) == 251 * 64


def test_fsdp_states_bf16_mixed():
    # fp32 sharded params and grads, two fp32 Adam states; no master copy (params are fp32)
    mt = ModelTensors((Tensor(800, 8, None, True, "layers.0"), Tensor(80, 8, None, False, "root")), 0)
    r = fsdp(_spec("fsdp", 8, precision="bf16-mixed"), mt)
    assert (r.param, r.grad, r.optimizer) == (4 * 110, 4 * 100, 8 * 100)
    # unsharded in bf16 (mp auto = compute dtype): root (80) + 2 units (2 x 800), + copy-in 100
    assert r.gathered == 2 * (80 + 1600) + 2 * 100
    whole = fsdp(_spec("fsdp", 8, precision="bf16-mixed", reshard_after_forward=False), mt)
    assert whole.detail["unsharded_param_bytes"] == 2 * 880


def test_lora_adapters_keep_fp32_outside_deepspeed():
    spec = TrainingSpec(model="tiny-llava", train="lora", precision="bf16",
                        parallel=ParallelSpec(world_size=2, strategy="ddp"))
    mt = model_tensors(spec)
    lora = [t for t in mt.tensors if t.itemsize == 4]
    assert lora and all(t.trainable for t in lora)
    r = replicated(spec, mt)
    # grads only for adapters, in fp32
    assert r.grad == sum(4 * t.numel for t in lora)


def test_model_tensors_count_matches_meta_count():
    # LLaVA-1.5-7B parameter count from a meta-device instantiation (docs/design.md): 7,063,427,072
    mt = model_tensors(TrainingSpec(model="llava-1.5-7b", train="llm+projector"))
    assert mt.params == 7_063_427_072
    # vision tower (303,507,456) frozen: everything else trains
    assert mt.trainable == 7_063_427_072 - 303_507_456
