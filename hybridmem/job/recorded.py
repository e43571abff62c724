"""The job's loop and technique fields that every measured row records and a sweep can vary.

One table instead of a copy in the dataset schema, the row writer and the sweep's axes (each
technique used to add itself to all three): a field added here is a dataset column (with the
default older parts read back with), a `hybridmem collect` sweep axis of the same name, and a
`TrainingSpec` field passed through unchanged. `datasets/README.md` documents each column.
"""

from __future__ import annotations

RECORDED: dict[str, tuple[str, object]] = {
    # field: (pandas dtype of its column, default = the spec's default)
    "loop": ("string", "trainer"),  # what outlives the forward (spec.LOOPS)
    "max_grad_norm": ("float64", 0.0),  # clip_grad_norm_ before the step; 0 = off
    "grad_accum": ("int64", 1),  # micro-steps per optimizer step
    "empty_cache_steps": ("int64", 0),  # torch.cuda.empty_cache() cadence (spec.empty_cache_at)
    "grad_ckpt_policy": ("string", "full"),  # which layers --grad-ckpt checkpoints
    "optimizer_in_backward": ("bool", False),  # docs/savers.md
    "quantize": ("string", "none"),  # bitsandbytes base weights (docs/quantize.md)
    "liger": ("bool", False),  # Liger kernels (docs/loss.md)
    "chunked_ce": ("int64", 0),  # torchtune chunked cross-entropy chunks; 0 = off
    "offload_activations": ("string", "none"),  # saved activations on the host (docs/savers.md)
    "packing": ("bool", False),  # padding-free packed batches (docs/savers.md)
}

_CAST = {"string": str, "float64": float, "int64": int, "bool": bool}


def recorded_values(spec) -> dict[str, object]:
    """The spec's value of every recorded field, as its column's type."""
    return {name: _CAST[dtype](getattr(spec, name)) for name, (dtype, _) in RECORDED.items()}


def recorded_fields(values: dict) -> dict[str, object]:
    """Spec keyword arguments from a sweep combination: whole numbers given to a float field
    become floats (a TOML `1` and `1.0` are one config, one `spec_hash`); nothing else is cast,
    so the spec's own checks still see what the file wrote."""
    out = {}
    for name, (dtype, _) in RECORDED.items():
        v = values[name]
        is_int = isinstance(v, int) and not isinstance(v, bool)
        out[name] = float(v) if dtype == "float64" and is_int else v
    return out
