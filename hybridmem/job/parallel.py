"""How a job is spread over GPUs: the `ParallelSpec` part of a TrainingSpec.

Kept in its own module so the parallelism work (DDP, ZeRO, FSDP) can grow it without touching
the single-GPU spec. Defaults are the frameworks' own defaults, each with its source, so that a
spec that names only a strategy prices what that framework does out of the box.

Checks that need the rest of the TrainingSpec (the optimizer for CPU offload) live in
`hybridmem.parallel.validate.check_parallel`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybridmem.errors import SpecError
from hybridmem.job.field import check_bounds, job_field

STRATEGIES: tuple[str, ...] = ("none", "ddp", "zero1", "zero2", "zero3", "fsdp")
PP_SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved-1f1b", "gpipe", "zero-bubble")
INTERLEAVED: frozenset[str] = frozenset({"interleaved-1f1b", "zero-bubble"})
"""Schedules with several stages per rank (torch `PipelineScheduleMulti` subclasses)."""
ADDED = 40
"""`added` number of the first model-parallel field (job.field.JobField.added)."""
ZERO_STAGES: dict[str, int] = {"zero1": 1, "zero2": 2, "zero3": 3}
OFFLOAD_DEVICES: tuple[str, ...] = ("none", "cpu")
MP_DTYPES: tuple[str, ...] = ("auto", "fp32", "bf16", "fp16")


def _check_count(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(name, value, reason=f"must be an integer >= {minimum}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelSpec:
    """How the job is spread over GPUs; memory is predicted per rank."""

    world_size: int = job_field(
        1, help="GPUs in the job (dp_replicate x dp_shard x cp x tp x pp); priced per GPU.",
        group="parallel", unit="GPUs", feature=True, echo=True,
        cli=("--world-size", "--gpu-count"),
        keys={"training_args": ("world_size",),
              "deepspeed": ("train_batch_size", "gradient_accumulation_steps")},
        doc="all ranks of the job, the product dp_replicate x dp_shard x cp x tp x pp (each "
        "axis divides it; `dp_shard` takes the rest); memory is predicted per GPU. A "
        "TrainingArguments file's `world_size` key, else `$WORLD_SIZE`; a numeric DeepSpeed "
        "`train_batch_size` fixes it (micro-batch x accumulation x data-parallel size)")
    """Number of ranks (GPUs), all parallel axes together."""
    strategy: Literal["none", "ddp", "zero1", "zero2", "zero3", "fsdp"] = job_field(
        "none", help="Sharding (data-parallel flavour; --zero-stage N = zeroN).", group="parallel",
        feature=True, echo=True, keys={"training_args": ("fsdp", "deepspeed"),
                                       "deepspeed": ("zero_optimization.stage",)},
        doc="`none` (one process), `ddp`, `zero1`, `zero2`, `zero3` (DeepSpeed ZeRO), `fsdp` "
        "(FSDP2); TrainingArguments `fsdp` (`full_shard`, `shard_grad_op`, `no_shard`) and "
        "`deepspeed`, a DeepSpeed JSON's `zero_optimization.stage`; a world size > 1 without "
        "either is DDP. Details and sources: [docs/parallel.md](docs/parallel.md)")
    """Data-parallel flavour; `none` is a single process."""

    # --- model parallelism (Megatron-LM arguments.py, torchtitan config/job_config.py) ---
    tp: int = job_field(
        1, help="Tensor-parallel degree (also --pp, --cp, --ep, --sequence-parallel).",
        group="parallel", unit="GPUs", feature=True, recorded="int64", added=ADDED,
        keys={"torchtitan": ("parallelism.tensor_parallel_degree",),
              "megatron": ("tensor_model_parallel_size",)},
        doc="tensor-parallel degree: attention heads, KV heads, the MLP's intermediate size and "
        "the vocabulary are split over `tp` ranks (Megatron-LM ColumnParallelLinear / "
        "RowParallelLinear; torchtitan `ColwiseParallel` / `RowwiseParallel`); must divide each")
    """Tensor-parallel degree."""
    sequence_parallel: bool = job_field(
        False, help="Sequence parallelism: norms and residuals split over the tp ranks.",
        group="parallel", feature=True, recorded="bool", added=ADDED + 1,
        keys={"torchtitan": ("parallelism.tensor_parallel_degree",),
              "megatron": ("sequence_parallel",)},
        doc="with `tp` > 1: the activations outside the column/row-parallel pairs (norms, "
        "residual, dropout) are split along the sequence (Korthikanti et al. 2022, Sec. 4.2.2); "
        "torchtitan always applies it with TP (`SequenceParallel` on the norms)")
    """Sequence parallelism over the tensor-parallel group."""
    cp: int = job_field(
        1, help="Context-parallel degree (sequence split, ring attention).",
        group="parallel", unit="GPUs", feature=True, recorded="int64", added=ADDED + 2,
        keys={"torchtitan": ("parallelism.context_parallel_degree",),
              "megatron": ("context_parallel_size",)},
        doc="context-parallel degree: every activation holds `seq_len / cp` tokens and "
        "attention exchanges K/V shards (torch `context_parallel`, Megatron-LM "
        "`--context-parallel-size`); must divide the sequence (2 x cp with load balancing)")
    """Context-parallel degree."""
    pp: int = job_field(
        1, help="Pipeline-parallel degree (stages of consecutive layers).",
        group="parallel", unit="GPUs", feature=True, recorded="int64", added=ADDED + 3,
        keys={"torchtitan": ("parallelism.pipeline_parallel_degree",),
              "megatron": ("pipeline_model_parallel_size",)},
        doc="pipeline-parallel degree: the layers are split into `pp` x `pp_virtual_stages` "
        "stages; the first holds the embedding, the last the norm, `lm_head` and loss; must "
        "divide the layers")
    """Pipeline-parallel degree (physical ranks of the pipeline)."""
    pp_schedule: Literal["1f1b", "interleaved-1f1b", "gpipe", "zero-bubble"] = job_field(
        "1f1b", help="Pipeline schedule (torch.distributed.pipelining).", group="parallel",
        recorded="string", added=ADDED + 4,
        keys={"torchtitan": ("parallelism.pipeline_parallel_schedule",),
              "megatron": ("num_layers_per_virtual_pipeline_stage",)},
        doc="`1f1b` (Schedule1F1B: stage r holds min(m, pp - r) micro-batches), "
        "`interleaved-1f1b` (ScheduleInterleaved1F1B / Megatron's virtual stages), `gpipe` "
        "(all m forwards first), `zero-bubble` (ScheduleInterleavedZeroBubble)")
    """Pipeline schedule."""
    pp_virtual_stages: int = job_field(
        1, help="Pipeline stages per rank (interleaved schedules).", group="parallel",
        recorded="int64", added=ADDED + 5,
        maximum=1 << 10,  # stages per rank: more than any model has layers (405B: 126)
        keys={"megatron": ("virtual_pipeline_model_parallel_size",)},
        doc="stages (model chunks) per pipeline rank: >= 2 for `interleaved-1f1b` and "
        "`zero-bubble` (Megatron `--virtual-pipeline-model-parallel-size`; torchtitan "
        "`pipeline_parallel_layers_per_stage`)")
    """Virtual stages per pipeline rank."""
    pp_microbatches: int | None = job_field(
        None, help="Micro-batches per pipeline step (default: pp).", group="parallel",
        unit="micro-batches", recorded="Int64", added=ADDED + 6,
        keys={"torchtitan": ("parallelism.pipeline_parallel_microbatch_size",),
              "megatron": ("global_batch_size",)},
        doc="micro-batches of `micro_batch` samples each that one pipeline step runs (torchtitan "
        "`local_batch_size / pipeline_parallel_microbatch_size`, Megatron "
        "`global_batch_size / (micro_batch_size x dp)`); None: `pp`")
    """Micro-batches per pipeline step (None: pp)."""
    ep: int = job_field(
        1, help="Expert-parallel degree (MoE: experts split over ep ranks).", group="parallel",
        unit="GPUs", feature=True, recorded="int64", added=ADDED + 7,
        keys={"torchtitan": ("parallelism.expert_parallel_degree",),
              "megatron": ("expert_model_parallel_size",)},
        doc="expert-parallel degree for the MoE families: each rank holds `experts / ep` "
        "experts; the routed tokens travel by all-to-all; borrowed from `dp_shard x cp` "
        "(torchtitan's constraint: `dp_shard x cp` divisible by `ep`)")
    """Expert-parallel degree."""
    dp_replicate: int = job_field(
        1, help="Replicas of the data-parallel shards (HSDP; 1: plain FSDP / DDP).",
        group="parallel", unit="GPUs", recorded="int64", added=ADDED + 8,
        keys={"torchtitan": ("parallelism.data_parallel_replicate_degree",)},
        doc="data-parallel replicas: with `fsdp` the params are sharded over `dp_shard` and "
        "replicated `dp_replicate` times (HSDP, `fully_shard(mesh=(replicate, shard))`)")
    """Data-parallel replicas (HSDP's replicate dimension)."""
    dp_shard: int | None = job_field(
        None, help="Data-parallel degree the states are sharded over (default: the rest).",
        group="parallel", unit="GPUs", recorded="Int64", added=ADDED + 9,
        keys={"torchtitan": ("parallelism.data_parallel_shard_degree",)},
        doc="ranks the data-parallel strategy shards over; None (torchtitan's -1): "
        "`world_size / (dp_replicate x cp x tp x pp)`")
    """Data-parallel shard degree (None: what the other axes leave)."""

    # --- torch DDP (torch/nn/parallel/distributed.py) ---
    bucket_cap_mb: float = job_field(
        25.0, help="DDP gradient bucket size.", group="parallel", unit="MiB", cli=False)
    """DDP gradient bucket size in MiB (torch DDP docs: default 25)."""
    gradient_as_bucket_view: bool = job_field(
        False, help="DDP: grads are views into the buckets.", group="parallel", cli=False)
    """DDP: grads are views into the buckets instead of a second copy (torch default False)."""

    # --- DeepSpeed ZeRO (deepspeed/runtime/zero/config.py defaults) ---
    reduce_bucket_size: int = job_field(
        500_000_000, help="ZeRO: elements per gradient reduce bucket.", group="parallel",
        unit="elements", cli=False, keys={"deepspeed": ("zero_optimization.reduce_bucket_size",)})
    """Elements per gradient reduce bucket (ZERO_OPTIMIZATION_REDUCE_BUCKET_SIZE_DEFAULT 5e8)."""
    allgather_bucket_size: int = job_field(
        500_000_000, help="ZeRO-1/2: elements per parameter all-gather bucket.",
        group="parallel", unit="elements", cli=False,
        keys={"deepspeed": ("zero_optimization.allgather_bucket_size",)})
    """Elements per ZeRO-1/2 parameter all-gather bucket (default 5e8)."""
    contiguous_gradients: bool = job_field(
        True, help="ZeRO: grads copied into one contiguous partition buffer.", group="parallel",
        cli=False, keys={"deepspeed": ("zero_optimization.contiguous_gradients",)})
    """Copy grads into one contiguous partition buffer as they are reduced (default True)."""
    overlap_comm: bool | None = job_field(
        None, help="ZeRO: overlap reduction with backward (default: True for stage 3).",
        group="parallel", cli=False, keys={"deepspeed": ("zero_optimization.overlap_comm",)})
    """Overlap reduction with backward; None = DeepSpeed's default (True for stage 3, else False)."""
    # DeepSpeedZeroConfig takes the stage3_ names and their short aliases
    # (`Field(alias="stage3_...")` with populate_by_name, deepspeed/runtime/zero/config.py)
    stage3_prefetch_bucket_size: int = job_field(
        50_000_000, help="ZeRO-3: elements fetched ahead of use.", group="parallel",
        unit="elements", cli=False,
        keys={"deepspeed": ("zero_optimization.stage3_prefetch_bucket_size",
                            "zero_optimization.prefetch_bucket_size")})
    """ZeRO-3: elements fetched ahead of use (default 5e7)."""
    stage3_param_persistence_threshold: int = job_field(
        100_000, help="ZeRO-3: params this small are never partitioned.", group="parallel",
        unit="elements", cli=False,
        keys={"deepspeed": ("zero_optimization.stage3_param_persistence_threshold",
                            "zero_optimization.param_persistence_threshold")})
    """ZeRO-3: params with at most this many elements are never partitioned (default 1e5)."""
    stage3_max_live_parameters: int = job_field(
        1_000_000_000, help="ZeRO-3: cap on gathered elements alive at once.", group="parallel",
        unit="elements", cli=False,
        keys={"deepspeed": ("zero_optimization.stage3_max_live_parameters",
                            "zero_optimization.max_live_parameters")})
    """ZeRO-3: cap on gathered elements alive at once (default 1e9)."""
    stage3_max_reuse_distance: int = job_field(
        1_000_000_000, help="ZeRO-3: a param reused this soon is not released.",
        group="parallel", unit="elements", cli=False,
        keys={"deepspeed": ("zero_optimization.stage3_max_reuse_distance",
                            "zero_optimization.max_reuse_distance")})
    """ZeRO-3: a param reused within this many elements is not released (default 1e9)."""
    sub_group_size: int = job_field(
        1_000_000_000, help="ZeRO-3: elements per optimizer sub-group stepped at once.",
        group="parallel", unit="elements", cli=False,
        keys={"deepspeed": ("zero_optimization.sub_group_size",)})
    """ZeRO-3: elements per optimizer sub-group stepped at once (default 1e9)."""
    offload_optimizer: Literal["none", "cpu"] = job_field(
        "none", help="ZeRO-Offload of the optimizer to the CPU.",
        group="parallel", keys={"deepspeed": ("zero_optimization.offload_optimizer",)},
        doc="`none` or `cpu` (ZeRO-Offload: fp32 master weights, optimizer state and fp32 "
        "grads on the CPU; a DeepSpeed `offload_optimizer.device` of `nvme` frees the GPU the "
        "same way)")
    """ZeRO-Offload: fp32 master weights, optimizer state and fp32 grads on the CPU."""
    offload_param: Literal["none", "cpu"] = job_field(
        "none", help="ZeRO-Infinity (zero3 only): parameter partitions on the CPU.",
        group="parallel", keys={"deepspeed": ("zero_optimization.offload_param",)})
    """ZeRO-Infinity (stage 3 only): parameter partitions on the CPU."""

    # --- PyTorch FSDP2 (torch/distributed/fsdp/_fully_shard) ---
    reshard_after_forward: bool = job_field(
        True, help="FSDP2: free unsharded params after each unit's forward.", group="parallel",
        cli=False, keys={"training_args": ("fsdp", "fsdp_config")})
    """FSDP2: free unsharded params after each unit's forward (fully_shard default True)."""
    mp_param_dtype: Literal["auto", "fp32", "bf16", "fp16"] = job_field(
        "auto", help="FSDP2 gather dtype (MixedPrecisionPolicy.param_dtype; auto: compute).",
        group="parallel",
        doc="FSDP2 `MixedPrecisionPolicy.param_dtype`: the dtype the sharded params are "
        "all-gathered and computed in (`auto`: the precision's compute dtype). torchtitan's "
        "bf16 FSDP2: `--precision bf16-mixed --mp-param-dtype bf16 --mp-reduce-dtype fp32` "
        "(fp32 shards, bf16 gathers and activations, fp32 reduce); accelerate's config file "
        "with `mixed_precision: bf16` (`--config`): bf16 / bf16 over fp32 shards",
        keys={"training_args": ("fsdp_config",)})
    """FSDP2 MixedPrecisionPolicy.param_dtype; auto = the spec's compute dtype."""
    mp_reduce_dtype: Literal["auto", "fp32", "bf16", "fp16"] = job_field(
        "auto", help="FSDP2 reduce dtype (MixedPrecisionPolicy.reduce_dtype; auto: gather).",
        group="parallel", keys={"training_args": ("fsdp_config",)})
    """FSDP2 MixedPrecisionPolicy.reduce_dtype; auto = param_dtype (FSDP2's None)."""

    def __post_init__(self) -> None:
        check_bounds(self, "parallel.")  # first: the bounds of the job schema's declarations
        _check_count("parallel.world_size", self.world_size)
        for name in ("tp", "cp", "pp", "ep", "dp_replicate", "pp_virtual_stages"):
            _check_count(f"parallel.{name}", getattr(self, name))
        for name in ("pp_microbatches", "dp_shard"):
            if getattr(self, name) is not None:
                _check_count(f"parallel.{name}", getattr(self, name))
        if self.pp_schedule not in PP_SCHEDULES:
            raise SpecError("parallel.pp_schedule", self.pp_schedule, PP_SCHEDULES)
        if self.strategy not in STRATEGIES:
            raise SpecError("parallel.strategy", self.strategy, STRATEGIES)
        for name in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size"):
            _check_count(f"parallel.{name}", getattr(self, name))
        # DeepSpeedZeroConfig takes 0 for these (`Field(..., ge=0)`, zero/config.py; axolotl's
        # deepspeed_configs/zero3_bf16.json sets all three to 0)
        for name in ("stage3_max_live_parameters", "stage3_max_reuse_distance",
                     "sub_group_size"):
            _check_count(f"parallel.{name}", getattr(self, name), minimum=0)
        _check_count("parallel.stage3_param_persistence_threshold",
                     self.stage3_param_persistence_threshold, minimum=0)
        if isinstance(self.bucket_cap_mb, bool) or not isinstance(self.bucket_cap_mb, (int, float)) \
                or not self.bucket_cap_mb > 0:
            raise SpecError("parallel.bucket_cap_mb", self.bucket_cap_mb, reason="must be > 0")
        for name in ("offload_optimizer", "offload_param"):
            if getattr(self, name) not in OFFLOAD_DEVICES:
                raise SpecError(f"parallel.{name}", getattr(self, name), OFFLOAD_DEVICES)
        for name in ("mp_param_dtype", "mp_reduce_dtype"):
            if getattr(self, name) not in MP_DTYPES:
                raise SpecError(f"parallel.{name}", getattr(self, name), MP_DTYPES)
        self._check_combination()

    def _check_layout(self) -> None:
        """The axes multiply to the world size; each schedule's own preconditions (torch
        pipelining `schedules.py`: Schedule1F1B / ScheduleInterleaved1F1B raise on too few
        micro-batches; looped schedules need >= 2 stages per rank)."""
        model = self.tp * self.cp * self.pp * self.dp_replicate
        if self.world_size % model:
            raise SpecError("parallel.world_size", self.world_size,
                            reason=f"is not divisible by dp_replicate x cp x tp x pp = {model} "
                            "(--world-size: all GPUs of the job)")
        if self.dp_shard is not None and self.dp_shard * model != self.world_size:
            raise SpecError("parallel.dp_shard", self.dp_shard,
                            reason=f"dp_replicate x dp_shard x cp x tp x pp = "
                            f"{self.dp_shard * model}, not world_size={self.world_size}")
        if self.sequence_parallel and self.tp == 1:
            raise SpecError("parallel.sequence_parallel", True,
                            reason="splits activations over the tensor-parallel group; needs tp > 1")
        if self.ep > 1 and (self.data_shard * self.cp) % self.ep:
            # torchtitan JobConfig.parallelism.expert_parallel_degree (etp = tp): ep is borrowed
            # from dp_shard x cp
            raise SpecError("parallel.ep", self.ep,
                            reason=f"must divide dp_shard x cp = {self.data_shard * self.cp}")
        interleaved = self.pp_schedule in INTERLEAVED
        if interleaved and self.pp_virtual_stages < 2:
            raise SpecError("parallel.pp_virtual_stages", self.pp_virtual_stages,
                            reason=f"{self.pp_schedule} runs >= 2 stages per rank")
        if not interleaved and self.pp_virtual_stages > 1:
            raise SpecError("parallel.pp_virtual_stages", self.pp_virtual_stages,
                            reason=f"{self.pp_schedule} runs one stage per rank; use "
                            "interleaved-1f1b or zero-bubble")
        m = self.microbatches
        if self.pp > 1 and self.pp_schedule != "gpipe" and m < self.pp:
            raise SpecError("parallel.pp_microbatches", m,
                            reason=f"{self.pp_schedule} needs at least pp={self.pp} micro-batches")
        if self.pp > 1 and interleaved and m % self.pp:
            raise SpecError("parallel.pp_microbatches", m,
                            reason=f"{self.pp_schedule} needs a multiple of pp={self.pp}")

    @property
    def data_shard(self) -> int:
        """The data-parallel shard degree: `dp_shard`, else what the other axes leave."""
        if self.dp_shard is not None:
            return self.dp_shard
        return self.world_size // (self.tp * self.cp * self.pp * self.dp_replicate)

    @property
    def data_parallel(self) -> int:
        """All data-parallel ranks (replicas x shards): the ranks that see different samples."""
        return self.data_shard * self.dp_replicate

    @property
    def microbatches(self) -> int:
        """Micro-batches per pipeline step (`pp_microbatches`, else pp)."""
        return self.pp_microbatches if self.pp_microbatches is not None else self.pp

    @property
    def model_parallel(self) -> bool:
        """Any axis besides data parallelism (tp, cp, pp, ep > 1)."""
        return max(self.tp, self.cp, self.pp, self.ep) > 1

    def _check_combination(self) -> None:
        self._check_layout()
        s, n = self.strategy, self.data_parallel
        offload = self.offload_optimizer != "none" or self.offload_param != "none"
        if s == "none" and n > 1:
            raise SpecError("parallel.strategy", s, STRATEGIES[1:],
                            reason=f"{n} data-parallel ranks need a data-parallel strategy"
                            if self.model_parallel else
                            f"world_size={n} needs a data-parallel strategy")
        if self.dp_replicate > 1 and s in ZERO_STAGES:
            raise SpecError("parallel.dp_replicate", self.dp_replicate,
                            reason=f"replicated shards (HSDP) are FSDP's, not {s}")
        if offload and s not in ZERO_STAGES:
            raise SpecError("parallel.strategy", s, tuple(ZERO_STAGES),
                            reason="CPU offload is a DeepSpeed ZeRO feature")
        if self.offload_param != "none" and s != "zero3":
            # DeepSpeed: `offload_param` is only valid with stage 3 (zero/config.py validator)
            raise SpecError("parallel.offload_param", self.offload_param, ["none"],
                            reason=f"parameter offload needs zero3, not {s}")
        if self.data_shard == 1 and (s == "fsdp" or (s in ZERO_STAGES and not offload)):
            if self.model_parallel:
                raise SpecError("parallel.world_size", self.world_size,
                                reason=f"{s} over one data-parallel rank shards nothing; give "
                                "more data-parallel GPUs (--world-size) or strategy=none")
            # launcher configs never say how many GPUs: the launch command does
            raise SpecError("parallel.world_size", n,
                            reason=f"{s} over one GPU shards nothing; give the GPUs it runs on, "
                            "--world-size N (--gpu-count N; the service's gpu_count): what "
                            "`torchrun --nproc_per_node N`, `accelerate launch --num_processes N` "
                            "or `deepspeed --num_gpus N` start; or strategy=none")

    @property
    def zero_stage(self) -> int:
        """0 for anything that is not DeepSpeed ZeRO."""
        return ZERO_STAGES.get(self.strategy, 0)

    @property
    def overlap(self) -> bool:
        """`overlap_comm` as DeepSpeed resolves None (DeepSpeedZeroConfig: True iff stage 3)."""
        return self.zero_stage == 3 if self.overlap_comm is None else self.overlap_comm
