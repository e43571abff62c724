"""The CUDA probe's NVML logic with a stand-in NVML module, and the peak summary of phases."""

from __future__ import annotations

import os
import sys
import types

import pytest

from hybridmem.harness.child import summarize
from hybridmem.harness.probe import CudaProbe

GiB = 1024**3


def _fake_nvml(used: list[int], procs: list[tuple[int, int | None]]) -> types.ModuleType:
    """NVML whose device-wide `used` bytes come from the list in order, with these processes."""
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetHandleByIndex = lambda i: f"gpu{i}"
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=used.pop(0))
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        types.SimpleNamespace(pid=pid, usedGpuMemory=mem) for pid, mem in procs]
    nvml.nvmlSystemGetDriverVersion = lambda: "580.159.04"
    return nvml


def test_per_process_usage_is_read_by_pid(monkeypatch):
    nvml = _fake_nvml([1 * GiB], [(os.getpid() + 1, 5 * GiB), (os.getpid(), 3 * GiB)])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    probe = CudaProbe()
    assert probe.baseline() == 1 * GiB
    assert probe.device_usage() == 3 * GiB  # this pid's entry, not the other process's
    assert probe.device_source == "nvml-process"


def test_without_our_pid_the_device_delta_is_used(monkeypatch):
    # inside a container NVML reports host pids: no entry matches os.getpid()
    nvml = _fake_nvml([1 * GiB, 4 * GiB], [(1, 9 * GiB)])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    probe = CudaProbe()
    probe.baseline()
    assert probe.device_usage() == 3 * GiB  # 4 GiB used now - 1 GiB before CUDA init
    assert probe.device_source == "nvml-device-delta"


def test_without_nvml_device_usage_is_unknown(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    probe = CudaProbe()
    assert probe.baseline() is None and probe.device_usage() is None


def _phase(phase, it, alloc, reserved, device):
    return {"phase": phase, "iteration": it, "allocated": alloc, "reserved": reserved,
            "active": alloc, "inactive_split": reserved - alloc, "device": device}


def test_summary_takes_maxima_over_phases_and_names_the_allocated_peak():
    phases = [_phase("setup", -1, 50, 60, 500),
              _phase("forward", 0, 80, 100, 540),
              _phase("optimizer", 0, 120, 130, 570),  # first step creates the optimizer state
              _phase("backward", 1, 110, 140, 580)]
    s = summarize(phases)
    assert (s["peak_allocated_bytes"], s["peak_phase"], s["peak_iteration"]) == (120, "optimizer", 0)
    assert s["peak_reserved_bytes"] == 140 and s["peak_device_bytes"] == 580
    assert s["peak_inactive_split_bytes"] == 30


@pytest.mark.parametrize("phases", [[], [_phase("setup", -1, 1, 1, 1)]])
def test_summary_of_a_run_without_training_phases_is_empty(phases):
    assert summarize(phases) == {}


class _Raising:
    """A CPU stand-in probe whose setup phase raises `exc` (in-process, no subprocess)."""

    def __init__(self, exc: BaseException) -> None:
        from hybridmem.harness.probe import CpuProbe

        probe = CpuProbe()
        probe.phase_start = lambda phase, it: (_ for _ in ()).throw(exc)
        self.probe = probe


@pytest.mark.parametrize("exc, outcome", [
    (__import__("torch").OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB"), "oom"),
    # allocations outside the caching allocator fail as plain RuntimeErrors
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), "oom"),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), "error"),
    (ValueError("bad shape"), "error"),
])
def test_failures_in_the_child_are_classified(exc, outcome):
    from hybridmem.harness.child import measure

    result = measure({"spec": {"model": "tiny-llava"}, "iterations": 3}, _Raising(exc).probe)
    assert result["outcome"] == outcome
    assert result["error"].startswith(type(exc).__name__)
    assert (result.get("oom_phase") == "setup") == (outcome == "oom")
