"""Parameter tensors of a spec's model, flattened to what the sharding formulas need.

Every data-parallel scheme prices the same tensors differently (replicate, shard flat, shard
dim 0, keep small ones whole), so the formulas take this one list, built once from
`hybridmem.models.build_graph`, rather than the graph itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridmem.models import build_graph
from hybridmem.job.spec import TrainingSpec

# Layers that FSDP2 users wrap with `fully_shard` one by one (torchtitan `apply_fsdp`, HF
# accelerate `transformer_layer_cls_to_wrap`), and that ZeRO-3 gathers as a unit; everything
# else belongs to the root unit.
UNIT_KINDS: frozenset[str] = frozenset({"decoder_layer", "encoder_layer"})


@dataclass(frozen=True, slots=True)
class Tensor:
    """One parameter tensor as the sharding formulas see it."""

    numel: int
    dim0: int
    """Size of dim 0 (FSDP2 shards along it, padding to a multiple of the world size)."""
    itemsize: int | None
    """Fixed bytes per element (LoRA adapters); None = the precision policy's param dtype."""
    trainable: bool
    """Gets a .grad and optimizer state."""
    unit: str
    """FSDP unit / ZeRO-3 fetch unit: the layer's name for repeated layers, else 'root'."""
    shape: tuple[int, ...] = ()
    """Full shape (the optimizer rules' layouts depend on it, e.g. Adafactor's factoring);
    () = 1-D of `numel`."""


@dataclass(frozen=True, slots=True)
class ModelTensors:
    tensors: tuple[Tensor, ...]
    buffer_bytes: int
    """Registered buffers (rotary tables): replicated by every scheme."""

    @property
    def params(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def trainable(self) -> int:
        return sum(t.numel for t in self.tensors if t.trainable)

    def units(self) -> dict[str, tuple[int, int]]:
        """unit -> (elements, trainable elements)."""
        out: dict[str, tuple[int, int]] = {}
        for t in self.tensors:
            n, tr = out.get(t.unit, (0, 0))
            out[t.unit] = (n + t.numel, tr + (t.numel if t.trainable else 0))
        return out


def model_tensors(spec: TrainingSpec) -> ModelTensors:
    """All parameter tensors of `spec`'s model (LoRA adapters included), with trainability."""
    return layer_tensors(build_graph(spec).layers())


def layer_tensors(layers) -> ModelTensors:
    """The parameter tensors of some `(module, layer)` pairs of a graph (a pipeline stage's)."""
    tensors: list[Tensor] = []
    buffers = 0
    for module, layer in layers:
        unit = f"{module}.{layer.name}" if layer.kind in UNIT_KINDS else "root"
        base_trains = layer.gets_grads
        for p in layer.params:
            tensors.append(Tensor(p.numel, p.shape[0], p.itemsize, base_trains, unit,
                                  tuple(p.shape)))
        for p in layer.lora:
            # PEFT adapters train whenever their layer is on the gradient path (LoRA-FA's
            # frozen lora_A never)
            tensors.append(Tensor(p.numel, p.shape[0], p.itemsize,
                                  layer.on_grad_path and layer.runs and not p.frozen, unit,
                                  tuple(p.shape)))
        buffers += sum(b.numel * (b.itemsize or 4) for b in layer.buffers)
    return ModelTensors(tuple(tensors), buffers)
