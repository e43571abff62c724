"""A small catalogue of GPUs and their memory, each with its source.

`memory_bytes` is the total that CUDA reports (`cudaMemGetInfo` total / `nvidia-smi` "Total"),
which is what an OOM is decided against; marketing "GB" differs from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridmem.errors import SpecError

GiB = 1024**3
MiB = 1024**2


@dataclass(frozen=True, slots=True, kw_only=True)
class GPU:
    name: str
    memory_bytes: int
    arch: str
    """Compute architecture, named after NVIDIA's family for `compute_capability`."""
    source: str
    compute_capability: tuple[int, int] | None = None
    """`torch.cuda.get_device_capability()` (major, minor): PyTorch picks the cuBLAS workspace
    size from it (`hybridmem.allocator.overheads.cublas_workspace`). None when unknown (a GPU
    given only by its memory). Values: NVIDIA's CUDA GPU compute-capability table
    (https://developer.nvidia.com/cuda-gpus; CUDA C++ Programming Guide, "Compute
    Capabilities")."""


# Compute capability -> NVIDIA architecture family (NVIDIA, https://developer.nvidia.com/cuda-gpus
# and the CUDA C++ Programming Guide's compute-capability table): each catalogued GPU's `arch`
# must be the family of its `compute_capability` (tests/test_gpus.py checks it).
ARCH_BY_CAPABILITY: dict[tuple[int, int], str] = {
    (7, 0): "volta", (7, 5): "turing", (8, 0): "ampere", (8, 6): "ampere", (8, 9): "ada",
    (9, 0): "hopper", (10, 0): "blackwell", (12, 0): "blackwell",
}


# Totals as `nvidia-smi --query-gpu=memory.total` prints them (MiB), from NVIDIA datasheets and
# nvidia-smi outputs quoted in the sources given.
GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU(name="a100-40gb", memory_bytes=40960 * MiB, compute_capability=(8, 0), arch="ampere",
        source="nvidia-smi on A100-SXM4-40GB: 40960MiB (NVIDIA A100 datasheet: 40 GB HBM2)"),
    GPU(name="a100-80gb", memory_bytes=81920 * MiB, compute_capability=(8, 0), arch="ampere",
        source="nvidia-smi on A100-SXM4-80GB: 81920MiB (NVIDIA A100 datasheet: 80 GB HBM2e)"),
    GPU(name="a100-80gb-pcie", memory_bytes=81920 * MiB, compute_capability=(8, 0), arch="ampere",
        source="nvidia-smi on NVIDIA A100 80GB PCIe: 81920MiB (NVIDIA A100 PCIe datasheet: 80 GB HBM2e)"),
    GPU(name="h100-80gb", memory_bytes=81559 * MiB, compute_capability=(9, 0), arch="hopper",
        source="nvidia-smi on H100 80GB HBM3: 81559MiB (NVIDIA H100 datasheet: 80 GB)"),
    GPU(name="h200", memory_bytes=143771 * MiB, compute_capability=(9, 0), arch="hopper",
        source="nvidia-smi on H200: 143771MiB (NVIDIA H200 datasheet: 141 GB HBM3e)"),
    GPU(name="l40s", memory_bytes=46068 * MiB, compute_capability=(8, 9), arch="ada",
        source="nvidia-smi on L40S: 46068MiB (NVIDIA L40S datasheet: 48 GB GDDR6)"),
    GPU(name="rtx-4090", memory_bytes=24564 * MiB, compute_capability=(8, 9), arch="ada",
        source="nvidia-smi on GeForce RTX 4090: 24564MiB (NVIDIA spec: 24 GB GDDR6X)"),
    GPU(name="rtx-4090-laptop", memory_bytes=16376 * MiB, compute_capability=(8, 9), arch="ada",
        source="nvidia-smi on NVIDIA GeForce RTX 4090 Laptop GPU: 16376MiB (NVIDIA spec: 16 GB GDDR6)"),
    GPU(name="rtx-3090", memory_bytes=24576 * MiB, compute_capability=(8, 6), arch="ampere",
        source="nvidia-smi on GeForce RTX 3090: 24576MiB (NVIDIA spec: 24 GB GDDR6X)"),
    GPU(name="a10g", memory_bytes=23028 * MiB, compute_capability=(8, 6), arch="ampere",
        source="nvidia-smi on A10G (AWS g5): 23028MiB (NVIDIA A10 datasheet: 24 GB)"),
    GPU(name="l4", memory_bytes=23034 * MiB, compute_capability=(8, 9), arch="ada",
        source="nvidia-smi on L4: 23034MiB (NVIDIA L4 datasheet: 24 GB)"),
    GPU(name="v100-32gb", memory_bytes=32768 * MiB, compute_capability=(7, 0), arch="volta",
        source="nvidia-smi on V100-SXM2-32GB: 32768MiB (NVIDIA V100 datasheet: 32 GB)"),
    GPU(name="t4", memory_bytes=15360 * MiB, compute_capability=(7, 5), arch="turing",
        source="nvidia-smi on Tesla T4: 15360MiB (NVIDIA T4 datasheet: 16 GB)"),
)}


# `torch.cuda.get_device_properties().name` (the dataset's `gpu_name`) -> catalogue entry, for
# rows measured elsewhere (published figures name the device, not our catalogue key).
DEVICE_NAMES: dict[str, str] = {
    "NVIDIA A100-SXM4-40GB": "a100-40gb",
    "NVIDIA A100-SXM4-80GB": "a100-80gb",
    "NVIDIA A100 80GB PCIe": "a100-80gb-pcie",
    "NVIDIA H100 80GB HBM3": "h100-80gb",
    "NVIDIA H200": "h200",
    "NVIDIA L40S": "l40s",
    "NVIDIA GeForce RTX 4090": "rtx-4090",
    "NVIDIA GeForce RTX 4090 Laptop GPU": "rtx-4090-laptop",
    "NVIDIA GeForce RTX 3090": "rtx-3090",
    "NVIDIA A10G": "a10g",
    "NVIDIA L4": "l4",
    "Tesla V100-SXM2-32GB": "v100-32gb",
    "Tesla T4": "t4",
}


def gpu_by_device_name(device_name: str) -> GPU:
    """Catalogue entry for a CUDA device name as torch reports it (e.g. "NVIDIA L40S")."""
    key = DEVICE_NAMES.get(device_name.strip())
    if key is None:
        raise SpecError("gpu_name", device_name, sorted(DEVICE_NAMES),
                        reason="not in the GPU catalogue (hybridmem/gpus.py)")
    return GPUS[key]


def gpu_by_name(name: str) -> GPU:
    """Catalogue lookup; case-insensitive, ignores spaces/underscores."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    if key not in GPUS:
        raise SpecError("gpu", name, sorted(GPUS))
    return GPUS[key]


MAX_GPU_GIB = 4096
"""Largest `--gpu-mem`: ~14x the largest GPU sold (B300, 288 GB); keeps the bytes finite."""


def custom_gpu(gib: float) -> GPU:
    """A GPU given only by its memory (`--gpu-mem GIB`); architecture unknown."""
    if not gib > 0:
        raise SpecError("gpu_mem", gib, reason="must be > 0 GiB")
    if not gib <= MAX_GPU_GIB:  # inf too (NaN is not > 0)
        raise SpecError("gpu_mem", gib, reason=f"above {MAX_GPU_GIB} GiB, more than a GPU has")
    return GPU(name=f"custom-{gib:g}gib", memory_bytes=int(gib * GiB), arch="unknown",
               source="given by the user")
