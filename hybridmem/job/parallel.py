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
        1, help="Data-parallel GPUs; priced per GPU.", group="parallel",
        unit="GPUs", feature=True, echo=True,
        keys={"training_args": ("world_size",),
              "deepspeed": ("train_batch_size", "gradient_accumulation_steps")},
        doc="data-parallel ranks; memory is predicted per GPU. A TrainingArguments file's "
        "`world_size` key, else `$WORLD_SIZE`; a numeric DeepSpeed `train_batch_size` fixes it "
        "(micro-batch x accumulation x world size)")
    """Number of data-parallel ranks (GPUs)."""
    strategy: Literal["none", "ddp", "zero1", "zero2", "zero3", "fsdp"] = job_field(
        "none", help="Sharding (data-parallel flavour; --zero-stage N = zeroN).", group="parallel",
        feature=True, echo=True, keys={"training_args": ("fsdp", "deepspeed"),
                                       "deepspeed": ("zero_optimization.stage",)},
        doc="`none` (one process), `ddp`, `zero1`, `zero2`, `zero3` (DeepSpeed ZeRO), `fsdp` "
        "(FSDP2); TrainingArguments `fsdp` (`full_shard`, `shard_grad_op`, `no_shard`) and "
        "`deepspeed`, a DeepSpeed JSON's `zero_optimization.stage`; a world size > 1 without "
        "either is DDP. Details and sources: [docs/parallel.md](docs/parallel.md)")
    """Data-parallel flavour; `none` is a single process."""

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
        if self.strategy not in STRATEGIES:
            raise SpecError("parallel.strategy", self.strategy, STRATEGIES)
        for name in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                     "stage3_max_live_parameters", "stage3_max_reuse_distance",
                     "sub_group_size"):
            _check_count(f"parallel.{name}", getattr(self, name))
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

    def _check_combination(self) -> None:
        s, n = self.strategy, self.world_size
        offload = self.offload_optimizer != "none" or self.offload_param != "none"
        if s == "none" and n > 1:
            raise SpecError("parallel.strategy", s, STRATEGIES[1:],
                            reason=f"world_size={n} needs a data-parallel strategy")
        if offload and s not in ZERO_STAGES:
            raise SpecError("parallel.strategy", s, tuple(ZERO_STAGES),
                            reason="CPU offload is a DeepSpeed ZeRO feature")
        if self.offload_param != "none" and s != "zero3":
            # DeepSpeed: `offload_param` is only valid with stage 3 (zero/config.py validator)
            raise SpecError("parallel.offload_param", self.offload_param, ["none"],
                            reason=f"parameter offload needs zero3, not {s}")
        if n == 1 and (s == "fsdp" or (s in ZERO_STAGES and not offload)):
            raise SpecError("parallel.world_size", n,
                            reason=f"{s} over one GPU shards nothing; give world_size > 1 (--world-size) "
                            "or strategy=none")

    @property
    def zero_stage(self) -> int:
        """0 for anything that is not DeepSpeed ZeRO."""
        return ZERO_STAGES.get(self.strategy, 0)

    @property
    def overlap(self) -> bool:
        """`overlap_comm` as DeepSpeed resolves None (DeepSpeedZeroConfig: True iff stage 3)."""
        return self.zero_stage == 3 if self.overlap_comm is None else self.overlap_comm
