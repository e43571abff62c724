"""Device probes: every CUDA and NVML call of a measurement goes through one object.

`CudaProbe` is the real thing (docs/design.md, "Harness and importer"). Tests and CPU dry runs swap it via
the environment variable `HYBRIDMEM_PROBE=module:Class`, so the whole subprocess path (build,
train, OOM, crash) runs without a GPU. A probe is created in the child before CUDA is touched:
`baseline()` must be read before `init()`.
"""

from __future__ import annotations

import os
import threading
from importlib import import_module

PROBE_ENV = "HYBRIDMEM_PROBE"
DEFAULT_PROBE = "hybridmem.harness.probe:CudaProbe"
POLL_S = 0.005  # NVML sampling period between phase boundaries (catches short spikes)


def _local_rank() -> int:
    """This process's rank on the machine (torchrun's LOCAL_RANK; 0 for a single process)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def load_probe():
    """An instance of the probe named by `HYBRIDMEM_PROBE` (default: the CUDA probe)."""
    module, _, name = (os.environ.get(PROBE_ENV) or DEFAULT_PROBE).partition(":")
    return getattr(import_module(module), name)()


class CudaProbe:
    """torch.cuda allocator statistics plus NVML per-process device usage."""

    source = "cuda"

    def __init__(self) -> None:
        self.device = None
        self._nvml = None
        self._handle = None
        self._baseline_used = None
        self.device_source = "none"
        self._poll_peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def available() -> tuple[bool, str]:
        import torch

        if not torch.cuda.is_available():
            return False, f"no CUDA device is available (torch {torch.__version__})"
        return True, ""

    # -- NVML, usable before CUDA is initialised ------------------------------------------
    def _nvml_handle(self):
        if self._nvml is None:
            try:
                import pynvml  # from the nvidia-ml-py package

                pynvml.nvmlInit()
                # this rank's GPU: the LOCAL_RANK-th visible one (torchrun), else the first
                visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
                index = _local_rank()
                visible = (visible.split(",")[index].strip() if visible.strip()
                           else str(index))
                self._handle = (pynvml.nvmlDeviceGetHandleByIndex(int(visible)) if visible.isdigit()
                                else pynvml.nvmlDeviceGetHandleByUUID(visible))
                self._nvml = pynvml
            except Exception:  # no NVML library, or no permission: device usage stays unknown
                self._nvml = False
        return self._handle if self._nvml else None

    def baseline(self) -> int | None:
        """Device-wide used bytes before this process initialises CUDA."""
        handle = self._nvml_handle()
        if handle is None:
            return None
        self._baseline_used = int(self._nvml.nvmlDeviceGetMemoryInfo(handle).used)
        return self._baseline_used

    def device_usage(self) -> int | None:
        """This process's device memory: NVML per-process, else device-wide used - baseline."""
        handle = self._nvml_handle()
        if handle is None:
            return None
        pid = os.getpid()
        try:
            for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid == pid and p.usedGpuMemory is not None:
                    self.device_source = "nvml-process"
                    return int(p.usedGpuMemory)
        except Exception:
            pass
        if self._baseline_used is None:
            return None
        # containers see host pids in NVML; then only the device-wide delta is left
        self.device_source = "nvml-device-delta"
        return int(self._nvml.nvmlDeviceGetMemoryInfo(handle).used) - self._baseline_used

    # -- CUDA ---------------------------------------------------------------------------------
    def init(self):
        import torch

        if "LOCAL_RANK" in os.environ:  # one GPU per rank (torchrun), before anything touches one
            torch.cuda.set_device(_local_rank())
        torch.cuda.init()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._start_poll()
        return self.device

    def _start_poll(self) -> None:
        def poll() -> None:
            while not self._stop.wait(POLL_S):
                used = self.device_usage()
                if used is not None and used > self._poll_peak:
                    self._poll_peak = used

        if self._nvml_handle() is not None:
            self._thread = threading.Thread(target=poll, daemon=True)
            self._thread.start()

    def polled_peak(self) -> int | None:
        return self._poll_peak or None

    def phase_start(self, phase: str, iteration: int) -> None:
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def phase_end(self, phase: str, iteration: int) -> dict:
        """Peaks since `phase_start`, and this process's device usage now."""
        import torch

        torch.cuda.synchronize()
        s = torch.cuda.memory_stats()
        return {"allocated": s.get("allocated_bytes.all.peak", 0),
                "reserved": s.get("reserved_bytes.all.peak", 0),
                "active": s.get("active_bytes.all.peak", 0),
                "inactive_split": s.get("inactive_split_bytes.all.peak", 0),
                "device": self.device_usage()}

    def reserved_now(self) -> int:
        import torch

        return torch.cuda.memory_reserved()

    def counters(self) -> dict:
        import torch

        s = torch.cuda.memory_stats()
        return {"num_alloc_retries": s.get("num_alloc_retries", 0), "num_ooms": s.get("num_ooms", 0)}

    def start_history(self) -> None:
        import torch

        # python frames only: enough to attribute blocks, far smaller than C++ stacks.
        # max_entries bounds a ring buffer that keeps the newest alloc/free events (torch's
        # default is unbounded); 2M is a chosen cap on the snapshot's size, not a measured need
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")

    def dump_history(self, path: str) -> None:
        import torch

        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)

    def close(self) -> None:
        self._stop.set()

    def environment(self) -> dict:
        """GPU name and total memory, driver and CUDA versions (initialises CUDA)."""
        import torch

        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        driver = ""
        if self._nvml_handle() is not None:
            driver = self._nvml.nvmlSystemGetDriverVersion()
            driver = driver.decode() if isinstance(driver, bytes) else str(driver)
        return {"gpu_name": props.name, "gpu_memory_bytes": int(props.total_memory),
                "driver_version": driver, "cuda_version": torch.version.cuda or "",
                "device_count": torch.cuda.device_count()}


class CpuProbe:
    """Dry run on the CPU: the real build/train path, no memory numbers (all zero).

    Rows it yields have `source="dryrun"` so they can never pass for measurements.
    """

    source = "dryrun"
    device_source = "none"

    @staticmethod
    def available() -> tuple[bool, str]:
        return True, ""

    def baseline(self) -> int | None:
        return 0

    def device_usage(self) -> int | None:
        return 0

    def init(self):
        import torch

        return torch.device("cpu")

    def polled_peak(self) -> int | None:
        return None

    def phase_start(self, phase: str, iteration: int) -> None:
        pass

    def phase_end(self, phase: str, iteration: int) -> dict:
        return {"allocated": 0, "reserved": 0, "active": 0, "inactive_split": 0, "device": 0}

    def reserved_now(self) -> int:
        return 0

    def counters(self) -> dict:
        return {"num_alloc_retries": 0, "num_ooms": 0}

    def start_history(self) -> None:
        pass

    def dump_history(self, path: str) -> None:
        import pickle

        with open(path, "wb") as fh:
            pickle.dump({"segments": [], "device_traces": []}, fh)

    def close(self) -> None:
        pass

    def environment(self) -> dict:
        # device_count None: ranks are CPU processes, any world size runs (slowly)
        return {"gpu_name": "cpu-dryrun", "gpu_memory_bytes": 0,
                "driver_version": "", "cuda_version": "", "device_count": None}
