"""The trace tier: run the real HF training step on CPU under FakeTensorMode, CUDA rules applied.

`run_trace(spec)` builds the model from its config (no weights, no real memory), runs
`runner.ITERATIONS` full training iterations and records every storage's birth and death;
`estimate(spec)` turns that into a `Prediction` in the same schema as the analytic tier, with
reserved memory from the caching-allocator simulator (`hybridmem.allocator`).
"""

from __future__ import annotations

import os
import time

import numpy as np

from hybridmem.allocator import AllocatorConfig
from hybridmem.allocator.overheads import CONTEXT_BYTES, CUBLAS_WORKSPACE_BYTES, cublas_workspace
from hybridmem.allocator.reserved import (
    FROM_GPU, Bounded, allocator_extras, capacity_notes, capacity_source, capped_replay,
    gpu_capacity,
)
from hybridmem.categories import CATEGORIES
from hybridmem.families.defaults import as_job
from hybridmem.gpus import GPU
from hybridmem.job.optimizers import paged_notes
from hybridmem.models import build_graph, load_config
from hybridmem.prediction import Peak, Prediction
from hybridmem.job.spec import TrainingSpec
from hybridmem.trace.corrections import KNOWN_LIMITATIONS
from hybridmem.trace.result import TraceResult, summarize
from hybridmem.trace.timeline import save_timeline, title_of

__all__ = ["KNOWN_LIMITATIONS", "TraceResult", "estimate", "run_trace", "save_timeline"]


def _validate(spec: TrainingSpec):
    """Same boundary checks and errors as the analytic tier, then this tier's own refusal
    (`trace.scope`); returns the HF config. A family without closed forms has no model graph:
    the runner checks it on the built model."""
    from hybridmem.models.loader import is_analytic, model_type_of
    from hybridmem.trace.scope import refusal

    if is_analytic(model_type_of(spec.model)):
        build_graph(spec)
    refused = refusal(spec)
    if refused is not None:
        raise refused
    return load_config(spec.model)


def _simulate_reserved(result: TraceResult, capacity: int | None = None, batch: int = 1
                       ) -> Bounded:
    """Reserved bytes from the caching-allocator simulator, on the stream with the loop's
    `empty_cache()` calls (`TraceResult.replay_events`); the curve stays indexed on `events`
    (an empty_cache entry only lowers reserved, so the running max skips it). With a
    `capacity` (the GPU's, `overheads.allocator_capacity`) the replay frees cached blocks and
    retries at the limit as PyTorch does; a replay that runs out of memory there is redone
    unlimited (`allocator.reserved.capped_replay`). Returns what the allocator went through
    (`batch`: the traced micro-batch, named in an OOM note)."""
    config = AllocatorConfig.from_environ()  # PYTORCH_ALLOC_CONF, else PYTORCH_CUDA_ALLOC_CONF
    stream = result.replay_events()
    sim, oom = capped_replay(stream, config, capacity)
    result.peak_reserved = sim.peak_reserved
    reserved = np.zeros(len(result.events), dtype=np.int64)
    index = -1
    for (action, _, _), (_, _, res) in zip(stream, sim.timeline):
        if action != "empty_cache":
            index += 1
            reserved[index] = res
    result.reserved_curve = np.maximum.accumulate(reserved) if len(reserved) else reserved
    return Bounded(sim.peak_reserved - sim.peak_allocated, sim.num_alloc_retries,
                   (batch,) if oom else (), capacity,
                   over_capacity=capacity is not None and sim.peak_reserved > capacity)


def run_trace(spec: TrainingSpec, *, backend: str = "meta",
              workspace: int = CUBLAS_WORKSPACE_BYTES, capacity: int | None = None
              ) -> TraceResult:
    """Trace `spec`'s training step; allocated and simulated reserved bytes over time.

    `backend="meta"` (fast; CUDA autocast emulated) falls back to `"fake"` (FakeTensorMode,
    torch's own CPU autocast) if the model's code does not run on meta tensors; both give the
    same bytes on every config tests compare (tests/test_trace_backends.py). `workspace`: bytes
    of one cuBLAS workspace (`allocator.overheads.cublas_workspace`, the analytic tier's too);
    `capacity`: bytes the allocator may reserve (None: unlimited), `_simulate_reserved`.
    """
    spec = as_job(spec)  # the tier's Python entry: a Job as it is (families.defaults)
    from hybridmem.environment import trace_refusal
    from hybridmem.errors import SpecError, UnsupportedModelError
    from hybridmem.trace import repeat, runner

    too_old = trace_refusal()  # the supported range (pyproject.toml), before any import
    if too_old is not None:
        raise SpecError("method", "trace", reason=f"the trace tier {too_old}")

    config = _validate(spec)
    # the runner places one workspace per cuBLAS handle a training step holds (forward thread,
    # autograd device thread): allocator.overheads.CUBLAS_HANDLES_TRAINING = 2
    start = time.perf_counter()
    notes = []
    if backend == "meta":
        try:
            tracker, job, weight, after, category_of, note = repeat.trace(spec, config, workspace)
        except repeat.NotRepeatable as why:
            notes.append(f"trace: every layer traced ({why})")
        except UnsupportedModelError:
            pass  # the full trace below says it (or falls back to FakeTensorMode)
        else:
            result = summarize(tracker, job, weight=weight, after_step=after,
                               category_of=category_of)
            result.notes.append(note)
            result.allocator = _simulate_reserved(result, capacity, spec.micro_batch)
            result.notes.append(f"trace: {runner.ITERATIONS} iterations on meta tensors in "
                                f"{time.perf_counter() - start:.1f} s")
            return result
    try:
        tracker, job = runner.trace(spec, config, backend=backend, workspace=workspace)
    except UnsupportedModelError as err:
        if backend != "meta":
            raise
        notes.append(f"meta backend failed ({err.reason}); traced under FakeTensorMode")
        backend = "fake"
        tracker, job = runner.trace(spec, config, backend=backend, workspace=workspace)
    result = summarize(tracker, job)
    result.notes.extend(notes)
    result.allocator = _simulate_reserved(result, capacity, spec.micro_batch)
    result.notes.append(f"trace: {runner.ITERATIONS} iterations on {backend} tensors in "
                        f"{time.perf_counter() - start:.1f} s")
    return result


def estimate(spec: TrainingSpec, *, timeline: str | os.PathLike | None = None,
             backend: str = "meta", gpu: GPU | None = None,
             capacity: int | str | None = FROM_GPU) -> Prediction:
    """`Prediction` from a trace: allocated and reserved peak, breakdown at the peak. `gpu` sets
    the cuBLAS workspace as in the analytic tier (Hopper's when None) and, unless `capacity`
    says otherwise, the allocator capacity the recorded stream is replayed within
    (`analytic.estimate.gpu_capacity`: the GPU's memory minus the CUDA context)."""
    spec = as_job(spec)  # the tier's Python entry: a Job as it is (families.defaults)
    limit = gpu_capacity(gpu, capacity)
    result = run_trace(spec, backend=backend, workspace=cublas_workspace(gpu), capacity=limit)
    allocated = result.peak_allocated
    reserved = max(result.peak_reserved, allocated)
    breakdown = {c: result.breakdown.get(c, 0) for c in CATEGORIES}
    breakdown["fragmentation"] = reserved - allocated
    breakdown["context"] = CONTEXT_BYTES + result.paged  # paged state: Prediction.paged_bytes
    notes = list(result.notes) + list(paged_notes(result.paged)) + [
        f"context: {CONTEXT_BYTES} bytes (hybridmem.allocator.overheads.CONTEXT_BYTES)"]
    notes += [f"known limitation: {x}" for x in KNOWN_LIMITATIONS]
    notes += capacity_notes(result.allocator, allocated, capacity_source(gpu)
                            if capacity == FROM_GPU else "as given")
    extras = {"trace": {"events": len(result.events), "peak_event": result.peak_index,
                        "peak_by_phase": result.by_phase, "peak_by_module": result.by_part},
              "after_step_allocated_bytes": result.after_step_allocated,
              **allocator_extras(result.allocator)}
    if timeline is not None:
        extras["timeline"] = str(save_timeline(result, timeline, title_of(spec), gpu))
    vllm = 0
    from hybridmem import objectives

    if not objectives.lm_loss(spec):  # the reference and generation lines (objectives)
        from hybridmem.objectives import rules

        vllm = rules.vllm_bytes(spec, gpu.memory_bytes if gpu is not None else None)
        breakdown["context"] += vllm
        notes.append(objectives.note(spec))
        if spec.vllm_gpu_memory_utilization and gpu is None:
            notes.append(rules.VLLM_WITHOUT_GPU)
        extras["objective"] = objectives.summary(
            spec, result.by_part.get("reference", 0), result.by_part.get("generation", 0),
            _phase_peak(result, "generation"), vllm)
    return Prediction(
        model=spec.model, method="trace", params_total=result.params_total,
        params_trainable=result.params_trainable,
        peak=Peak(allocated_bytes=allocated, reserved_bytes=reserved,
                  device_bytes=reserved + CONTEXT_BYTES + result.paged + vllm,
                  phase=result.peak_phase,
                  iteration=result.peak_iteration),
        breakdown=breakdown, paged_bytes=result.paged,
        modules=tuple(result.modules),
        notes=tuple(notes), extras=extras)


def _phase_peak(result: TraceResult, phase: str) -> int:
    """Allocated peak over the events of every `phase` span (0 if it never ran)."""
    marks = result.marks + [(len(result.curve), "end", -1)]
    spans = [(a, b) for (a, p, _), (b, _, _) in zip(marks, marks[1:]) if p == phase and b > a]
    return max((int(result.curve[a:b].max()) for a, b in spans), default=0)
