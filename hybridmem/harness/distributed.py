"""The rank side of a multi-rank measurement: process group, one device per rank, and the model
wrapped per strategy (DDP, FSDP2, DeepSpeed ZeRO) the way users' frameworks wrap it.

The child runs this when torchrun launched it (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK). Each
rank measures itself with its own probe and writes its own result; the parent merges them
(`hybridmem.harness.ranks`). NCCL on CUDA; gloo for the CPU stand-in that tests use.

It builds on `hybridmem.harness.workload` (the single-GPU job); workload does not import it back:
the child picks `prepare` here for a multi-rank spec.
"""

from __future__ import annotations

import contextlib
import os
import sys
from functools import partial

import torch
from torch import nn

from hybridmem.errors import SpecError
from hybridmem.harness import workload
from hybridmem.harness.ranks import check_measurable
from hybridmem.harness.ranks import launched  # noqa: F401  (the child asks it here)
from hybridmem.job.optimizers import LR
from hybridmem.job.spec import TrainingSpec
from hybridmem.torch_dtype import AUTOCAST, PARAM_DTYPE

FAILED_EXIT = 3
"""Exit status of a rank whose result is not `ok`: torchrun then stops the other ranks, which
would otherwise wait for it in a collective (until the NCCL timeout, 10 min by default)."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def rank() -> int:
    return int(os.environ.get("RANK", 0))


def pid_path(result_path: str) -> str:
    """Where a rank notes its pid: torchrun starts each rank in its own session, so the parent
    can only reach a rank left behind by a killed torchrun through its process group."""
    return f"{result_path}.rank{rank()}.pid"


def init(device: torch.device, spec: TrainingSpec) -> None:
    """Join the process group: NCCL bound to this rank's GPU, else gloo."""
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    if world != spec.parallel.world_size:
        raise RuntimeError(f"launched on {world} ranks; the spec asks for "
                           f"{spec.parallel.world_size}")
    if device.type == "cuda":  # device_id: communicators are made now, inside the setup phase
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")


def barrier() -> None:
    """Every rank finished its iterations (a peer that failed shows up here as an error)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def finish(ok: bool) -> int:
    """Leave the process group; the exit status torchrun should see."""
    import torch.distributed as dist

    if not ok:  # no clean-up: a collective may hang on the failed peer; torchrun stops the rest
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(FAILED_EXIT)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _batch(spec: TrainingSpec, config, model: nn.Module, device) -> dict:
    """The batch, made next to the bare model (LLaVA-NeXT asks it for its image token count;
    a ZeRO-3 model cannot run before `deepspeed.initialize`: the model graph counts them)."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return workload.make_batch(spec, config, None, device)
    where = next(model.parameters()).device
    return {k: v.to(device) for k, v in workload.make_batch(spec, config, model, where).items()}


def prepare(spec: TrainingSpec, config, device) -> workload.Job:
    """The job of one rank: the model (built, frozen, LoRA, checkpointing) wrapped per strategy.

    FSDP2 models are built on the CPU and `fully_shard` moves each unit's shard to the GPU, so
    no rank holds a whole replica (as accelerate loads FSDP models); ZeRO-3 models are built
    under `deepspeed.zero.Init` (as transformers does under ZeRO-3); DDP and ZeRO-1/2 keep a
    whole replica per rank anyway and are built on the GPU."""
    from hybridmem import objectives

    if not objectives.lm_loss(spec):  # the objectives' steps are measured on one GPU
        raise SpecError("objective", spec.objective,
                        [n for n, o in objectives.REGISTRY.items() if o.LM_LOSS],
                        reason="the harness measures objectives beyond sft on one GPU "
                        "(strategy none)")
    strategy = spec.parallel.strategy
    if spec.parallel.model_parallel:
        return model_parallel(spec, config, device)
    if strategy == "fsdp":
        model = workload.build_trainable(spec, config, torch.device("cpu"))
        batch = _batch(spec, config, model, device)
        return workload.finish_job(fsdp(model, spec), spec, device, batch)
    if strategy == "ddp":
        model = workload.build_trainable(spec, config, device)
        batch = _batch(spec, config, model, device)
        return workload.finish_job(ddp(model, spec, device), spec, device, batch)
    return deepspeed_job(spec, config, device)


def model_parallel(spec: TrainingSpec, config, device) -> workload.Job:
    """A tp / cp (x FSDP2) rank as torchtitan builds it: the (dp, cp, tp) device mesh,
    `parallelize_module` with torchtitan's plan on "tp", `fully_shard` per decoder layer and the
    root over dp x cp, and torch's `context_parallel` around each step's forward and backward
    (`job.step_context`). The same code the trace tier runs (`parallel.trace_ranks`), here on
    this rank's GPU with NCCL. Pipeline ranks: `pipeline`; expert parallelism is refused in
    one line."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hybridmem.parallel import trace_ranks

    ps = spec.parallel
    check_measurable(ps, spec.attn)
    if ps.pp > 1:
        return pipeline(spec, config, device)
    dp = ps.data_shard
    mesh = init_device_mesh(device.type, (dp, ps.cp, ps.tp), mesh_dim_names=("dp", "cp", "tp"))
    model = workload.build_trainable(spec, config, device)
    if ps.tp > 1:
        trace_ranks.apply_tp(model, mesh["tp"], ps.sequence_parallel)
    if ps.strategy == "fsdp":
        shard_mesh = mesh["dp", "cp"]._flatten("dp_cp") if ps.cp > 1 else mesh["dp"]
        for layer in model.model.layers:
            fully_shard(layer, mesh=shard_mesh)
        fully_shard(model, mesh=shard_mesh)
    batch = _batch(spec, config, model, device)
    if ps.sequence_parallel or ps.cp > 1:  # a sequence shard cannot derive its positions
        ids = batch["input_ids"]
        batch["position_ids"] = torch.arange(ids.shape[1], device=device)[None].expand_as(
            ids).contiguous()
    job = workload.finish_job(model, spec, device, batch)
    if len({hasattr(p, "_local_tensor") for p in job.params}) > 1:
        # foreach refuses DTensor shards beside plain tensors (the norm weights under tp
        # without FSDP2): the step runs per parameter, as in the trace tier (`trace_ranks`)
        for group in job.optimizer.param_groups:
            if "foreach" in group:
                group["foreach"] = False
    job.step_context = partial(_mp_step, trace_ranks.cp_step(mesh["cp"]) if ps.cp > 1 else None)
    return job


def pipeline(spec: TrainingSpec, config, device) -> workload.Job:
    """A pipeline rank as torchtitan runs one, built by the trace tier's own builder
    (`trace_pipeline.build`: torchtitan's layer split, transformers' `PipelineIdentityLayer`
    for the other stages' modules, torch's `PipelineStage` and the `pp_schedule` class), here
    with real stages exchanging real activations and gradients with the other ranks (NCCL,
    gloo on the CPU). Each stage is cut from a model built whole on this rank's device (the
    setup phase holds one whole model for a moment; the training phases hold the stage's).
    The step feeds `pp_microbatches` micro-batches of `micro_batch` samples; the schedule runs
    forwards and backwards interleaved, recorded as the step's forward phase."""
    import torch.distributed as dist

    from hybridmem.models.loader import load_config_dict
    from hybridmem.parallel import trace_pipeline
    from hybridmem.torch_dtype import PARAM_DTYPE

    ps = spec.parallel
    layers_of = trace_pipeline.stage_layers(
        int(load_config_dict(spec.model)[1]["num_hidden_layers"]), ps)
    schedule, parts, stages = trace_pipeline.build(
        lambda: workload.build_trainable(spec, config, device), ps, dist.get_rank(), layers_of,
        spec.micro_batch, spec.seq_len, config.hidden_size, config.vocab_size,
        PARAM_DTYPE[spec.precision], device=device)
    model = nn.ModuleList(parts)  # the rank's stages: its parameters, grads, optimizer
    step_batch = workload.make_batch(spec.with_(micro_batch=spec.micro_batch * ps.microbatches),
                                     config, None, device)
    job = workload.finish_job(model, spec, device, step_batch)
    job.pipeline = partial(trace_pipeline.step, schedule, stages, step_batch["input_ids"],
                           step_batch["labels"])
    return job


@contextlib.contextmanager
def _mp_step(cp_step, batch: dict):
    """torchtitan's train context: `loss_parallel` (the vocabulary-sharded logits' cross
    entropy) and, with cp, `context_parallel` over the batch."""
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel(), (cp_step(batch) if cp_step else contextlib.nullcontext(batch)) as b:
        yield b


def ddp(model: nn.Module, spec: TrainingSpec, device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel
    from transformers import PreTrainedModel

    ps = spec.parallel
    # HF Trainer's default (`_build_accelerator_args`): find unused parameters unless a
    # PreTrainedModel checkpoints activations; any other module (a PEFT wrapper): find them
    find_unused = not spec.grad_ckpt if isinstance(model, PreTrainedModel) else True
    return DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=ps.bucket_cap_mb, gradient_as_bucket_view=ps.gradient_as_bucket_view,
        find_unused_parameters=find_unused)


def _compute_dtype(spec: TrainingSpec) -> torch.dtype:
    return AUTOCAST.get(spec.precision, PARAM_DTYPE[spec.precision])


def _wrap_classes(model: nn.Module) -> set[str]:
    """Block classes HF marks as never to be split (`_no_split_modules`: decoder and encoder
    layers); accelerate's FSDP auto-wrap policy uses the same list."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return names


def fsdp(model: nn.Module, spec: TrainingSpec) -> nn.Module:
    """FSDP2: `fully_shard` each HF block (decoder / encoder layer), then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    ps = spec.parallel
    compute = _compute_dtype(spec)
    # "auto" = the spec's compute dtype (hybridmem.parallel.sharding prices the same); reduce
    # "auto" = FSDP2's None (reduce in the param dtype)
    param_dtype = compute if ps.mp_param_dtype == "auto" else DTYPES[ps.mp_param_dtype]
    reduce_dtype = None if ps.mp_reduce_dtype == "auto" else DTYPES[ps.mp_reduce_dtype]
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kwargs = {"reshard_after_forward": ps.reshard_after_forward, "mp_policy": mp}
    wrap = _wrap_classes(model)
    for m in reversed(list(model.modules())):  # children before parents
        if type(m).__name__ in wrap:
            fully_shard(m, **kwargs)
    fully_shard(model, **kwargs)
    return model


def deepspeed_config(spec: TrainingSpec) -> dict:
    """DeepSpeed's JSON config for `spec` (ZeRO stage, buckets, offload, precision).

    bf16 / bf16-master: DeepSpeed's bf16 (bf16 params, fp32 master partitions: the LLaVA recipe);
    fp16: DeepSpeed's loss-scaled fp16; fp32 and the autocast policies: an fp32 model (the
    harness's own autocast runs the forward; no loss scaler under DeepSpeed).
    """
    ps = spec.parallel
    zero: dict = {
        "stage": ps.zero_stage, "reduce_bucket_size": ps.reduce_bucket_size,
        "allgather_bucket_size": ps.allgather_bucket_size,
        "contiguous_gradients": ps.contiguous_gradients, "overlap_comm": ps.overlap,
        "stage3_prefetch_bucket_size": ps.stage3_prefetch_bucket_size,
        "stage3_param_persistence_threshold": ps.stage3_param_persistence_threshold,
        "stage3_max_live_parameters": ps.stage3_max_live_parameters,
        "stage3_max_reuse_distance": ps.stage3_max_reuse_distance,
        "sub_group_size": ps.sub_group_size,
    }
    for name in ("offload_optimizer", "offload_param"):
        if getattr(ps, name) != "none":
            zero[name] = {"device": getattr(ps, name)}
    return {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": spec.micro_batch * ps.world_size,
        "gradient_clipping": 0.0,  # the single-GPU workload does not clip either
        "zero_optimization": zero,
        "bf16": {"enabled": spec.precision in ("bf16", "bf16-master", "bf16-autocast")},
        "fp16": {"enabled": spec.precision == "fp16"},
        # torch.optim.* and bitsandbytes optimizers are "client" optimizers to DeepSpeed
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000,
    }


def _cast_to_engine_dtype(model: nn.Module, ds_config: dict) -> None:
    """PEFT keeps LoRA adapters in fp32; under DeepSpeed bf16 / fp16 the LLaVA recipe casts the
    whole model after adding them (haotian-liu/LLaVA `llava/train/train.py`: `model.to(torch.
    bfloat16)` when `bits == 16`), and ZeRO-3 refuses mixed dtypes in one partition buffer
    (`deepspeed/runtime/zero/utils.py::defragment`). ZeRO-3's own partitioned params (`ds_id`)
    already have the dtype."""
    dtype = (torch.bfloat16 if ds_config["bf16"]["enabled"]
             else torch.float16 if ds_config["fp16"]["enabled"] else None)
    if dtype is None:
        return
    for p in model.parameters():
        if p.dtype != dtype and not hasattr(p, "ds_id"):
            p.data = p.data.to(dtype)


def deepspeed_job(spec: TrainingSpec, config, device) -> workload.Job:
    """ZeRO 1/2/3 through `deepspeed.initialize`; an `error` row when DeepSpeed is missing."""
    try:
        import deepspeed
    except ImportError as err:
        raise workload.Unavailable(f"strategy={spec.parallel.strategy!r} needs DeepSpeed, "
                                   "which is not installed") from err
    ds_config = deepspeed_config(spec)
    deepspeed.init_distributed()  # adopts the torch process group; zero.Init needs it first
    # zero.Init patches torch.Tensor.__new__; torch._dynamo (imported by transformers' modeling
    # code) refuses to register its polyfills over the patched one, so import it before
    import torch._dynamo  # noqa: F401
    # only the base model is built under zero.Init, as transformers does (`from_pretrained`);
    # LLaVA adds LoRA after it (llava/train/train.py), and DeepSpeed partitions the adapters
    init = (partial(deepspeed.zero.Init, config_dict_or_path=ds_config)
            if spec.parallel.zero_stage == 3 else contextlib.nullcontext)
    model = workload.build_trainable(spec, config, device, build_context=init)
    _cast_to_engine_dtype(model, ds_config)
    batch = _batch(spec, config, model, device)
    params = [p for p in model.parameters() if p.requires_grad]
    if spec.parallel.offload_optimizer != "none":
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # offload steps on the CPU with it

        optimizer = DeepSpeedCPUAdam(params, lr=LR, adamw_mode=True)
    else:
        optimizer = workload.make_optimizer(spec.optimizer, params, device=device)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                   config=ds_config)
    return workload.Job(engine, optimizer, batch, params, engine=engine)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds: a DTensor's shard (FSDP2), a ZeRO-3 partition."""
    if hasattr(t, "ds_tensor"):
        return t.ds_tensor
    if hasattr(t, "to_local"):
        return t.to_local()
    return t


def global_numel(p: torch.Tensor) -> int:
    """Elements of the whole parameter, however it is sharded (ZeRO-3 empties `p` itself)."""
    return int(getattr(p, "ds_numel", 0) or p.numel())


def master_tensors(optimizer) -> list[torch.Tensor]:
    """DeepSpeed's fp32 master partitions (they are not optimizer `state`): ZeRO-1/2
    (`DeepSpeedZeroOptimizer`), ZeRO-3 (`DeepSpeedZeroOptimizer_Stage3`), bf16 ZeRO-1
    (`BF16_Optimizer`). Attribute names from deepspeed/runtime; untested here."""
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat",
                 "fp32_groups_flat_partition"):
        groups = getattr(optimizer, name, None)
        if groups:
            return [t for t in groups if isinstance(t, torch.Tensor)]
    return []
