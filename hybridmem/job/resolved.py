"""`Job`: a `TrainingSpec` whose model-dependent defaults are decided, as its type says.

Why a type: a `TrainingSpec` may leave `attn` and `precision` open ("follow the model"), and
before this type every tier, `parallel/`, `batches/`, the learned tier and the harness filled
them in again at its own entry, since nothing told it whether the caller had. A `Job` is made
only where the defaults are decided (`families.defaults.resolve_defaults`, called by
`intake.resolve.resolve_once`); below, a function typed `Job` reads the fields and never
resolves them. It is a subclass with no new field, so every rule that reads a spec reads a job;
a copy (`job.with_(micro_batch=4)`) is a job again, with the decided values kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridmem.job.spec import TrainingSpec

DECIDED = ("attn", "precision")
"""The fields a job may leave to the model (`families.defaults`), decided in every `Job`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Job(TrainingSpec):
    """A `TrainingSpec` with `attn` and `precision` decided (given, or the model's default)."""

    def __post_init__(self) -> None:
        TrainingSpec.__post_init__(self)
        # an internal invariant, not user input: only the resolver builds a Job
        open_ = [name for name in DECIDED if getattr(self, name) is None]
        assert not open_, f"a Job decides {open_} (families.defaults.resolve_defaults)"

    @classmethod
    def of(cls, spec: TrainingSpec) -> Job:
        """`spec`, whose `attn` and `precision` are set, as a Job (the resolver's constructor)."""
        return spec if isinstance(spec, cls) else cls(**{
            name: getattr(spec, name) for name in TrainingSpec.__dataclass_fields__})
