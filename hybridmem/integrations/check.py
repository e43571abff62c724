"""What every integration does around a live run: price the job before the first step, say it,
stop a run that will not fit, then measure the real run once and compare.

Cost inside training: pricing runs once, before the first step (on rank 0; the analytic tier
answers in well under a second). During steps the only work is a forward pre-hook that reads
the input's shape (`LengthRecorder`: tensor metadata, no device sync) and, once after N steps,
reading the allocator's counters (`torch.cuda.max_memory_*` read host-side statistics, no
sync) and NVML; the dataset row is written by a background thread, so no step waits on disk.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from hybridmem.errors import SpecError

log = logging.getLogger("hybridmem")


def visible_log() -> logging.Logger:
    """The "hybridmem" logger, printing INFO to stderr unless the user configured it (the
    lines are what a user adds the callback for; an application's own logging setup wins)."""
    if not log.handlers and log.level == logging.NOTSET:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log
GiB = 2**30


class NoFit(RuntimeError):
    """Raised before the first step by `fail_if_no_fit=True`: the job does not fit; the message
    is the verdict and the advice (`hybridmem.parallel.fit`)."""


def local_gpu():
    """The GPU this process trains on (catalogue entry by device name, else its total
    memory), or None without CUDA."""
    import torch

    from hybridmem.gpus import DEVICE_NAMES, GPUS, custom_gpu

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    key = DEVICE_NAMES.get(props.name.strip())
    return GPUS[key] if key else custom_gpu(props.total_memory / GiB)


def target_gpu(gpu: str | None, gpu_mem: float | None):
    """The GPU the verdict is against: the one named, else the one this process runs on."""
    from hybridmem.answer import resolve_gpu

    return resolve_gpu(gpu, gpu_mem) if gpu is not None or gpu_mem is not None else local_gpu()


def summary_lines(found) -> list[str]:
    """The resolved job (the console's echo) and the verdict with its advice."""
    from hybridmem.job.schema import echo_lines
    from hybridmem.parallel.cli import fit_lines
    from hybridmem.report import gib, verdict

    result = found.result
    lines = [f"hybridmem: {line}" for line in echo_lines(result.job)]
    lines.append(f"hybridmem: predicted peak {gib(result.peak.device_bytes)} GiB device, "
                 f"{gib(result.peak.reserved_bytes)} GiB reserved ({result.method})")
    lines.append(f"hybridmem: {verdict(result)}")
    if found.advice is not None:
        lines += [f"hybridmem: {line}" for line in fit_lines(found.advice)]
    return lines


@dataclass
class LengthRecorder:
    """The shapes of the batches the model saw: a forward pre-hook that reads `input_ids`
    (or `inputs_embeds`) metadata."""

    shapes: list[tuple[int, int]] = field(default_factory=list)
    limit: int = 10_000
    """Shapes kept (a long run's first ones are enough to know its lengths)."""
    _handle: object = None

    def attach(self, model) -> None:
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _hook(self, module, args, kwargs):
        if len(self.shapes) >= self.limit:
            return None
        x = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if x is None and args:
            x = args[0]
        shape = getattr(x, "shape", None)
        if shape is not None and len(shape) >= 2:
            self.shapes.append((int(shape[0]), int(shape[1])))
        return None

    def summary(self) -> dict:
        if not self.shapes:
            return {"batches": 0}
        seqs = [s for _, s in self.shapes]
        return {"batches": len(self.shapes), "max_micro_batch": max(b for b, _ in self.shapes),
                "max_seq_len": max(seqs), "mean_seq_len": sum(seqs) / len(seqs)}


def measure_cuda() -> dict:
    """The allocator's peaks since the process started (or the last reset) and this process's
    device memory by NVML (nvidia-ml-py, optional: None without it)."""
    import torch

    from hybridmem.harness.probe import CudaProbe

    stats = torch.cuda.memory_stats()
    probe = CudaProbe()
    device = probe.device_usage()
    return {"peak_allocated_bytes": int(torch.cuda.max_memory_allocated()),
            "peak_reserved_bytes": int(torch.cuda.max_memory_reserved()),
            "peak_device_bytes": device, "device_source": probe.device_source,
            "num_alloc_retries": stats.get("num_alloc_retries", 0),
            "num_ooms": stats.get("num_ooms", 0)}


def environment() -> dict:
    """The row's environment columns, as `hybridmem collect` records them."""
    from hybridmem.harness.collection import software_environment
    from hybridmem.harness.probe import CudaProbe

    return {**software_environment(), **CudaProbe().environment()}


def compare_lines(predicted, measured: dict, lengths: dict) -> list[str]:
    """Predicted against measured, one line each, with the lengths the data really had."""
    from hybridmem.report import gib

    peak = predicted.peak
    lines = [f"hybridmem: measured after the first steps: allocated {gib(measured['peak_allocated_bytes'])}"
             f" GiB (predicted {gib(peak.allocated_bytes)}), reserved "
             f"{gib(measured['peak_reserved_bytes'])} GiB (predicted {gib(peak.reserved_bytes)})"
             + ("" if measured.get("peak_device_bytes") is None else
                f", device {gib(measured['peak_device_bytes'])} GiB (predicted "
                f"{gib(peak.device_bytes)}, NVML)")]
    if lengths.get("batches"):
        lines.append(f"hybridmem: the data: {lengths['batches']} batches, longest "
                     f"{lengths['max_seq_len']} tokens (mean {lengths['mean_seq_len']:.0f}); "
                     f"priced at seq_len {predicted.job['seq_len']}")
    return lines


@dataclass
class RunCheck:
    """One run's check: the job priced at the start, the measurement after `measure_after`
    steps, the optional row (`dataset`: a folder; None writes nothing)."""

    gpu: str | None = None
    gpu_mem: float | None = None
    method: str | None = None
    fail_if_no_fit: bool = False
    measure_after: int = 3
    dataset: str | None = None
    found: object = None
    resolved: object = None
    lengths: LengthRecorder = field(default_factory=LengthRecorder)
    measured: dict | None = None
    started: float | None = None
    _writer: threading.Thread | None = None

    def begin(self, inputs, say=log.info) -> None:
        """Price the job of `inputs` (`live.LiveInputs`), say it; raise `NoFit` with the advice
        when asked to and it does not fit."""
        from hybridmem.answer import answer
        from hybridmem.integrations.live import resolve_live

        self.resolved, warnings = resolve_live(inputs)
        for warning in warnings:
            say(f"hybridmem: warning: {warning}")
        self.found = answer(self.resolved, warnings, target_gpu(self.gpu, self.gpu_mem),
                            method=self.method)
        for line in summary_lines(self.found):
            say(line)
        if self.fail_if_no_fit and self.found.result.fit == "no":
            raise NoFit("\n".join(summary_lines(self.found)))
        self.started = time.monotonic()

    def step(self, step: int, say=log.info) -> None:
        """After step `step`: on CUDA, the measurement once `measure_after` steps are done."""
        if self.measured is not None or step < self.measure_after or self.found is None:
            return
        import torch

        if not torch.cuda.is_available():
            return
        self.measured = measure_cuda()
        for line in compare_lines(self.found.result, self.measured, self.lengths.summary()):
            say(line)
        if self.dataset is not None:
            seconds = (time.monotonic() - self.started) / step if self.started else None
            self._writer = threading.Thread(target=self._write, args=(step, seconds),
                                            daemon=True)
            self._writer.start()

    def _write(self, steps: int, seconds: float | None) -> None:
        try:
            path = self.write_row(self.measured, environment(), steps, seconds)
            log.info(f"hybridmem: wrote this run's row to {path}")
        except Exception as err:  # noqa: BLE001 - a row that cannot be written never stops training
            log.warning(f"hybridmem: this run's row was not written: {err}")

    def write_row(self, measured: dict, env: dict, steps: int, seconds: float | None = None):
        """The run's row (`hybridmem.harness.user_run`) appended to `dataset`: the job as it
        ran, `seq_len` the longest sequence the data had."""
        from hybridmem.harness import store
        from hybridmem.harness.user_run import user_row
        from hybridmem.models.loader import load_config_dict

        spec = self.resolved.spec
        lengths = self.lengths.summary()
        if lengths.get("batches"):
            spec = spec.with_(seq_len=lengths["max_seq_len"])
        _, config = load_config_dict(spec.model)
        row = user_row(spec, config, measured, env, steps=steps, step_seconds=seconds,
                       label=config.get("_name_or_path") or "")
        if self.dataset is None:
            raise SpecError("dataset", None, reason="give a folder to write the row to")
        return store.append_rows(self.dataset, [row])

    def end(self) -> None:
        """Wait for the row to be written (training is over) and remove the hook."""
        if self._writer is not None:
            self._writer.join()
        self.lengths.detach()
