"""The measuring subprocess: `python -m hybridmem.harness.child REQUEST.json RESULT.json`.

One fresh process per config, because the CUDA context and the allocator's cache are part of
what a user's job pays for. Protocol (docs/design.md, "Harness and importer"): read NVML before CUDA is
initialised; build, train `iterations` steps, resetting the allocator's peak statistics at each
phase boundary; report per-phase peaks, their maximum, counters and the device usage. An OOM
is a result (`outcome="oom"`), not a crash. The result file is written once, atomically.
`--env RESULT.json` only reports the probe's environment (the parent's resume key).

Launched by torchrun (a multi-rank spec), every rank does all of the above on its own device,
after joining the process group, and writes its own `RESULT.json.rank<R>`; a rank that fails
exits non-zero so that torchrun stops the others (`hybridmem.harness.distributed`).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

SETUP = "setup"  # model build, optimizer, batch: before the first forward
# Out-of-memory raised outside the caching allocator (so not as torch.OutOfMemoryError): a
# cudaMalloc inside a library, cuBLAS / cuDNN workspace allocation failures.
OOM_MARKERS = ("CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED",
               "CUDNN_STATUS_ALLOC_FAILED", "CUDA_ERROR_OUT_OF_MEMORY")


def _write(path: str, result: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(result, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:500]


def summarize(phases: list[dict]) -> dict:
    """Global peaks and the phase/iteration of the allocated peak, from per-phase peaks."""
    training = [p for p in phases if p["phase"] != SETUP]
    if not training:
        return {}
    # the phase of the peak is a training phase (categories.PHASES); setup never exceeds them
    top = max(training, key=lambda p: p["allocated"])
    devices = [p["device"] for p in phases if p["device"] is not None]
    return {"peak_allocated_bytes": top["allocated"],
            "peak_reserved_bytes": max(p["reserved"] for p in phases),
            "peak_active_bytes": max(p["active"] for p in phases),
            "peak_inactive_split_bytes": max(p["inactive_split"] for p in phases),
            "peak_device_bytes": max(devices) if devices else None,
            "peak_phase": top["phase"], "peak_iteration": top["iteration"]}


def _state_bytes(job, device) -> dict:
    """Bytes of parameters and of optimizer state (+ fp32 masters) on the device, counted; of
    a sharded job, this rank's shards."""
    import torch

    from hybridmem.harness.distributed import local_tensor, master_tensors

    def size(t) -> int:
        t = local_tensor(t)
        return t.numel() * t.element_size()

    state = sum(size(t) for st in job.optimizer.state.values() for t in st.values()
                if isinstance(t, torch.Tensor) and t.device.type == device.type)
    masters = list(job.masters) + master_tensors(job.optimizer)
    return {"param_bytes": sum(size(p) for p in job.model.parameters()),
            "optimizer_state_bytes": state + sum(size(m) for m in masters)}


def measure(request: dict, probe) -> dict:
    """Run one config under `probe`; always returns a result dict (ok / oom / error)."""
    import torch

    from hybridmem.harness import distributed
    from hybridmem.job.spec import TrainingSpec

    result: dict = {"outcome": "error", "error": "", "device_baseline_bytes": probe.baseline()}
    ranked = distributed.launched()
    if ranked:
        result["rank"] = distributed.rank()
    phases: list[dict] = []
    phase, iteration = SETUP, -1
    history = request.get("history_path")
    if history:  # each rank its own snapshot: HISTORY.rank<R>
        from hybridmem.harness.ranks import rank_path

        history = str(rank_path(history))
    try:
        device = probe.init()
        result.update(probe.environment())
        if history:
            probe.start_history()
        from hybridmem.harness import workload
        from hybridmem.models.loader import load_config

        from hybridmem.families.defaults import as_job

        # the job the parent sent, as JSON: the precision / attention the model implies where
        # the spec leaves them unset, decided once here for the model, the batch and the step
        spec = as_job(TrainingSpec.from_dict(request["spec"]))
        if ranked:  # the process group (NCCL's buffers) is part of what the job pays for
            distributed.init(device, spec)
        probe.phase_start(phase, iteration)
        # a multi-rank spec is wrapped per its strategy; `workload` is the single-GPU job
        multi = spec.parallel.strategy != "none" or spec.parallel.model_parallel
        build = distributed.prepare if multi else workload.prepare
        job = build(spec, load_config(spec.model), device)
        phases.append({"phase": phase, "iteration": iteration, **probe.phase_end(phase, iteration)})
        result["params_total"] = sum(distributed.global_numel(p) for p in job.model.parameters())
        result["params_trainable"] = sum(distributed.global_numel(p) for p in job.params)
        times = []
        for iteration in range(request["iterations"]):
            start = time.perf_counter()
            for phase in _iteration(job, spec, device, probe, iteration, phases):
                pass  # each phase entered is where an OOM is reported
            times.append(time.perf_counter() - start)
        if ranked:
            distributed.barrier()
        result.update(outcome="ok", iteration_seconds=times, **_state_bytes(job, device))
        used = probe.device_usage()  # context = process usage - allocator segments, same instant
        result["context_bytes"] = used - probe.reserved_now() if used is not None else None
    except torch.OutOfMemoryError as err:
        result.update(outcome="oom", error=_first_line(err), oom_phase=phase,
                      oom_iteration=iteration)
    except Exception as err:  # any other failure is an `error` row with its message
        oom = any(m in str(err) for m in OOM_MARKERS)
        result.update(outcome="oom" if oom else "error", error=_first_line(err),
                      traceback=traceback.format_exc()[-4000:],
                      **({"oom_phase": phase, "oom_iteration": iteration} if oom else {}))
    return _finish(result, phases, probe, history)


def _iteration(job, spec, device, probe, iteration: int, phases: list[dict]):
    """One optimizer step: grad_accum micro-steps of forward + backward (one phase entry
    each), then the step (clipping included), torch.cuda.empty_cache() where the loop calls
    it; yields each phase as it starts, so that the caller knows where an OOM struck."""
    from hybridmem import objectives
    from hybridmem.harness import workload
    from hybridmem.job.spec import empty_cache_at

    where = empty_cache_at(spec, iteration)
    steps = ("forward", "backward") * spec.grad_accum + ("optimizer",)
    generates = objectives.of(spec).GENERATES  # GRPO's generation phase
    for phase in (("generation",) if generates else ()) + steps:
        yield phase
        probe.phase_start(phase, iteration)
        if phase == "generation":  # GRPO's completions, before the first forward
            workload.generation(job, spec)
        elif phase == "forward":
            loss = workload.forward(job, spec, device)
            if where == "after_forward":  # Trainer.training_step, before backward
                workload.empty_cache(device)
        elif phase == "backward":
            workload.backward(job, loss, spec)
            del loss
        else:
            workload.optimizer_step(
                job, spec, empty_cache_device=device if where == "after_step" else None)
            workload.end_step(job)
        phases.append({"phase": phase, "iteration": iteration,
                       **probe.phase_end(phase, iteration)})


def _finish(result: dict, phases: list[dict], probe, history: str | None) -> dict:
    """The row's counters, phases, peaks and history, whatever the outcome."""
    try:
        result.update(probe.counters())
    except Exception:  # CUDA never came up: no counters
        pass
    result["phases"] = phases
    result["device_source"] = probe.device_source
    polled = probe.polled_peak()
    if result["outcome"] == "ok":
        result.update(summarize(phases))
        if polled and (result["peak_device_bytes"] or 0) < polled:
            result["peak_device_bytes"] = polled
    if history:
        try:
            probe.dump_history(history)
        except Exception as err:
            result["history_error"] = _first_line(err)
    probe.close()
    result["ended_at"] = time.time()  # which rank failed first (`hybridmem.harness.ranks`)
    return result


def environment(probe) -> dict:
    probe.baseline()
    probe.init()
    env = probe.environment()
    probe.close()
    return env


def main(argv: list[str]) -> int:
    from hybridmem.harness.probe import load_probe

    if argv[:1] == ["--env"]:
        _write(argv[1], environment(load_probe()))
        return 0
    from hybridmem.harness import distributed
    from hybridmem.harness.ranks import rank_path

    request_path, result_path = argv
    with open(request_path) as fh:
        request = json.load(fh)
    if distributed.launched():
        with open(distributed.pid_path(result_path), "w") as fh:
            fh.write(str(os.getpid()))
    probe = load_probe()
    result = measure(request, probe)
    _write(str(rank_path(result_path)), result)
    if distributed.launched():
        return distributed.finish(result["outcome"] == "ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
