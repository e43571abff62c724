"""One job's answer as `hybridmem predict --json` gives it: the options -> the resolved job ->
the prediction with the config warnings, the sources and the fit advice.

Why its own module: the CLI and the HTTP service (`hybridmem.serve`) must answer the same job
with the same object, so both call these functions rather than each building it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridmem.errors import SpecError
from hybridmem import plausible
from hybridmem.gpus import GPU, custom_gpu, gpu_by_name

if TYPE_CHECKING:  # the CLI imports this module before parsing its options: nothing heavy
    from hybridmem.intake.merge import Resolved
    from hybridmem.intake.resolve import ResolvedJob
    from hybridmem.prediction import Prediction


def resolve_job(values: dict) -> tuple[Resolved, list[str]]:
    """The job of `predict`'s option values (job-schema keys, the config files, `zero_stage`;
    None = not given) and the config readers' warnings (keys of the user's files not read)."""
    from hybridmem.intake.config_keys import collect_warnings
    from hybridmem.intake.resolve import resolve_cli
    from hybridmem.techniques.quantize import KBIT_CHECKPOINTING, kbit_checkpointing

    with collect_warnings() as warnings:
        resolved = resolve_cli(**values)
    if kbit_checkpointing(resolved.spec, values):  # QLoRA as peft's preparation leaves it
        resolved = dataclasses.replace(
            resolved, spec=resolved.spec.with_(grad_ckpt=True),
            sources={**resolved.sources, "grad_ckpt": KBIT_CHECKPOINTING})
    return resolved, list(warnings)


def resolve_gpu(gpu: str | None, gpu_mem: float | None) -> GPU | None:
    """The GPU of `--gpu NAME` (the catalogue) or `--gpu-mem GIB`; None without either."""
    if gpu is not None and gpu_mem is not None:
        raise SpecError("gpu", gpu, reason="give --gpu or --gpu-mem, not both")
    if gpu is not None:
        return gpu_by_name(gpu)
    if gpu_mem is not None:
        return custom_gpu(gpu_mem)
    return None


@dataclass(frozen=True)
class Answer:
    """The prediction (its `job` with the warnings and sources) and the fit advice."""

    result: Prediction
    advice: dict | None = None

    def to_dict(self) -> dict:
        """The `--json` object (schema in README.md; names are a contract)."""
        out = self.result.to_dict()
        if self.advice is not None:
            out["advice"] = self.advice
        return out


def answer(resolved: Resolved | ResolvedJob, warnings: list[str], gpu: GPU | None, method: str | None = None,
           find_max_batch: bool = False, timeline: str | None = None) -> Answer:
    """Predict the resolved job; with a GPU, the smallest setup that fits when the job is
    parallel or does not fit as given (`hybridmem.parallel.fit`). `timeline`: a file the trace
    tier writes its memory timeline to."""
    from hybridmem.intake.resolve import ResolvedJob, resolve_once
    from hybridmem.parallel.fit import smallest_fitting_setup
    from hybridmem.predict import predict

    # the defaults and the tier, once (the service resolves before it picks a worker)
    job = resolved if isinstance(resolved, ResolvedJob) else resolve_once(resolved, method)
    spec, chosen = job.given, job.method
    options = {}
    if timeline is not None:
        if chosen != "trace":
            raise SpecError("timeline", timeline, reason="--timeline needs --method trace")
        options["timeline"] = timeline
    result = predict(job, gpu=gpu, find_max_batch=find_max_batch, **options)
    warnings = [*warnings, *plausible.warnings(spec, result.peak.device_bytes,
                                                     searched=find_max_batch)]
    result = dataclasses.replace(result, job={**result.job, "warnings": warnings,
                                              "sources": job.sources})
    advice = None
    if gpu is not None and (spec.parallel.strategy != "none" or not result.fits):
        advice = smallest_fitting_setup(spec, gpu, lambda s: predict(s, method=chosen, gpu=gpu),
                                        job=job.spec)
    return Answer(result, advice)
