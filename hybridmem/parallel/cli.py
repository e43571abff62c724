"""The `--gpu` fit advice as console lines: `fit_lines` turns `smallest_fitting_setup`'s answer
into what `hybridmem predict` prints (the options -> the job is `hybridmem.intake.resolve`)."""

from __future__ import annotations

GiB = 2**30


def _describe(option: dict) -> str:
    parts = [f"{option['world_size']} GPU(s)", option["strategy"]]
    if "micro_batch" in option:
        parts.append(f"micro-batch {option['micro_batch']}")
    parts.append(f"checkpointing {'on' if option['grad_ckpt'] else 'off'}")
    return (", ".join(parts) + f": {option['peak_bytes'] / GiB:.1f} GiB per GPU "
            f"({option['headroom_bytes'] / GiB:+.1f} GiB headroom)")


def fit_lines(advice: dict) -> list[str]:
    """Console lines for `smallest_fitting_setup`'s answer."""
    gpu = f"{advice['gpu']} ({advice['gpu_memory_bytes'] / GiB:.1f} GiB)"
    if advice["fits_as_is"]:
        return [f"fits {gpu} as configured: {_describe(advice['current'])}"]
    lines = [f"does not fit {gpu}: {_describe(advice['current'])}"]
    labels = {"world_size": "smallest world size", "zero_stage": "ZeRO stage at this size",
              "grad_ckpt": "gradient checkpointing", "micro_batch": "largest micro-batch"}
    for key, label in labels.items():
        if advice.get(key) is not None:
            lines.append(f"  {label}: {_describe(advice[key])}")
    for combined in advice.get("combined") or ():
        lines.append(f"  {combined['changes']}: {_describe(combined)}")
    if len(lines) == 1:
        lines.append("  no change searched fits (world size, ZeRO stage, micro-batch, and "
                     "checkpointing, Liger or Cut Cross-Entropy with a smaller micro-batch or "
                     "more GPUs)")
    return lines
