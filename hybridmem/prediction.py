"""The answer every tier gives: `Prediction`, and its JSON form (a contract for other tools)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hybridmem.categories import CATEGORIES, PHASES

FIT_OUTCOMES: tuple[str, ...] = ("yes", "after-retry", "no")
"""`Prediction.fit`: fits; fits only after the allocator frees its cache and retries; does not."""


TIER_ERROR: dict[str, float] = {"analytic": 0.040, "trace": 0.048, "hybrid": 0.037}
"""Each tier's stated error of the device peak: its median absolute error against the
published real-GPU device peaks (docs/accuracy.md, "device peak | <tier> | all": 4.0 %, 4.8 %,
3.7 % over 24 runs; `tests/test_verdict.py` checks these against docs/accuracy-published.json).
Headroom below it fits only within the error (`Prediction.within_error`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModuleMemory:
    """Memory of one top-level module (vision tower, projector, language model, lm_head).

    `param`/`grad`/`optimizer`: bytes of the module's own tensors when they all exist;
    `activation`: tensors the module saves for backward (the analytic tier reports what it
    carries into backward, the trace tier what is live at the peak). The run-wide snapshot at
    the peak is `Prediction.breakdown`.
    """

    name: str
    params: int
    trainable_params: int
    param: int
    grad: int
    optimizer: int
    activation: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Peak:
    allocated_bytes: int
    """Peak of `torch.cuda.memory_allocated` (PyTorch tensors, 512 B-rounded)."""
    reserved_bytes: int
    """Peak of `torch.cuda.memory_reserved` (allocator segments)."""
    device_bytes: int
    """Whole process on the GPU (what nvidia-smi shows, what OOM is decided against)."""
    phase: str
    """Phase of the peak: forward, backward or optimizer."""
    iteration: int
    """Training iteration (0-based) at which the peak happens."""

    def __post_init__(self) -> None:
        assert self.phase in PHASES, self.phase
        assert self.allocated_bytes <= self.reserved_bytes <= self.device_bytes, self


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    model: str
    method: str
    params_total: int
    params_trainable: int
    peak: Peak
    breakdown: dict[str, int]
    """Bytes per category at the device peak; sums to `peak.device_bytes`."""
    modules: tuple[ModuleMemory, ...]
    gpu_name: str | None = None
    gpu_memory_bytes: int | None = None
    max_micro_batch: int | None = None
    notes: tuple[str, ...] = ()
    """Caveats a user should read: fallbacks, known limitations, which model was used."""
    extras: dict = field(default_factory=dict)
    """Tier-specific extras (e.g. per-rank info, upper bound, timeline path)."""
    paged_bytes: int = 0
    """Optimizer state in CUDA unified memory (bitsandbytes paged optimizers, cudaMallocManaged):
    outside PyTorch's allocator (not in allocated / reserved), in `device_bytes` and
    `breakdown["context"]` while resident. The driver pages it out to host memory under pressure
    instead of failing, so `fits` does not count it (docs/design.md, "Optimizers")."""
    job: dict | None = None
    """The job as priced, with the job schema's names (`hybridmem.job.schema.job_dict`, plus
    `warnings`: the config readers' warnings); set by the front door that resolved it."""

    def __post_init__(self) -> None:
        assert tuple(self.breakdown) == CATEGORIES, tuple(self.breakdown)
        assert sum(self.breakdown.values()) == self.peak.device_bytes, (
            sum(self.breakdown.values()), self.peak.device_bytes)

    @property
    def fit(self) -> str | None:
        """The verdict, one of `FIT_OUTCOMES` (None without a GPU): "no" when it does not fit
        (`fits`); "after-retry" when it fits only because the allocator, at the GPU's limit,
        frees its cached blocks and retries cudaMalloc (`extras["allocator"]`, the replay within
        the GPU's capacity: slower steps, each retry synchronizes the device); else "yes"."""
        if self.fits is None:
            return None
        if not self.fits:
            return "no"
        allocator = self.extras.get("allocator") or {}
        return "after-retry" if allocator.get("num_alloc_retries") else "yes"

    @property
    def fits(self) -> bool | None:
        if self.gpu_memory_bytes is None:
            return None
        return self.fits_within(self.gpu_memory_bytes)

    @property
    def verdict_bytes(self) -> int:
        """What the fit verdict compares with the GPU: the stated upper bound of the device peak
        where a tier gives one (`extras["bound_bytes"]`, the learned tier), else the peak."""
        bound = self.extras.get("bound_bytes")
        return int(bound) if bound is not None else self.peak.device_bytes

    def fits_within(self, memory_bytes: int) -> bool:
        """Whether the job runs in `memory_bytes` of GPU memory: `verdict_bytes` without the
        paged optimizer state, which is evicted to the host rather than causing an OOM."""
        return self.verdict_bytes - self.paged_bytes <= memory_bytes

    @property
    def error_bytes(self) -> int | None:
        """The tier's stated error of the device peak in bytes (`TIER_ERROR` x the figure the
        verdict compares); None where the verdict already uses a stated upper bound (the
        learned tier's `bound_bytes`) or the tier states none."""
        if self.extras.get("bound_bytes") is not None or self.method not in TIER_ERROR:
            return None
        return int(TIER_ERROR[self.method] * self.verdict_bytes)

    @property
    def within_error(self) -> bool | None:
        """It fits, by less headroom than the tier's stated error (`error_bytes`): a real run
        may well run out of memory. After allocator retries the reserved bytes sit at the
        allocator's capacity by construction, so there the headroom is that of the tensors
        (the device peak without its fragmentation). None without a GPU."""
        if self.fits is None:
            return None
        error = self.error_bytes
        if not self.fits or error is None:
            return False
        headroom = self.headroom_bytes
        if self.fit == "after-retry":
            headroom += self.peak.reserved_bytes - self.peak.allocated_bytes
        return headroom < error

    @property
    def headroom_bytes(self) -> int | None:
        if self.gpu_memory_bytes is None:
            return None
        return self.gpu_memory_bytes - self.verdict_bytes

    def to_dict(self) -> dict:
        """The `--json` object (schema in README.md; names are a contract)."""
        out = {
            "model": self.model,
            "method": self.method,
            "params": {"total": self.params_total, "trainable": self.params_trainable},
            "peak": asdict(self.peak),
            "breakdown": dict(self.breakdown),
            "modules": [asdict(m) for m in self.modules],
            "gpu": (None if self.gpu_name is None
                    else {"name": self.gpu_name, "memory_bytes": self.gpu_memory_bytes}),
            "fits": self.fits,
            "fit": self.fit,
            "headroom_bytes": self.headroom_bytes,
            "within_error": self.within_error,
            "error_bytes": self.error_bytes,
            "max_micro_batch": self.max_micro_batch,
            "notes": list(self.notes),
            "paged_bytes": self.paged_bytes,
            "job": self.job,
        }
        out.update({k: v for k, v in self.extras.items() if k not in out})
        return out
