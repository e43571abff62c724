"""Save a trace's timeline: JSON (data) or PNG (a plot), by the file's suffix."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hybridmem.errors import SpecError

GiB = 1024**3


PHASE_COLORS: dict[str, str] = {"forward": "tab:blue", "backward": "tab:orange",
                                 "optimizer": "tab:green"}
"""Shading of each phase's span of events (`TraceResult.marks`), named in the legend."""


def save_timeline(result, path: str | os.PathLike, title: str | None = None,
                  gpu=None) -> Path:
    """Write `result.timeline()` to `path` (.json, or .png via matplotlib); returns the path.
    The PNG is `figure(data, title, gpu)`."""
    path = Path(path)
    data = result.timeline()
    if path.suffix.lower() == ".json":
        path.write_text(json.dumps(data))
    elif path.suffix.lower() == ".png":
        import matplotlib.pyplot as plt

        fig = figure(data, title, gpu)
        fig.savefig(path, dpi=120)
        plt.close(fig)
    else:
        raise SpecError("timeline", str(path), (".json", ".png"), reason="unknown file type")
    return path


def title_of(spec) -> str:
    """The plot's title: the model and the job in a few words."""
    job = [f"train {spec.train}", f"micro-batch {spec.micro_batch} x {spec.seq_len} tokens"]
    if spec.precision is not None:  # None: the model's default, resolved by the tier
        job.append(spec.precision)
    if spec.grad_ckpt:
        job.append("grad-ckpt")
    if spec.quantize != "none":
        job.append(spec.quantize)
    if spec.parallel.world_size > 1:
        job.append(f"{spec.parallel.strategy} on {spec.parallel.world_size} GPUs (one rank)")
    return f"{spec.model}: " + ", ".join(job)


def figure(data: dict, title: str | None = None, gpu=None):
    """Allocated and simulated reserved GiB over the allocator's events, each phase's span
    shaded (the legend names them), and, when `gpu` is given, a dashed line at the allocator's
    capacity (the GPU's memory less the CUDA context, which the curves leave out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(data["event"], [b / GiB for b in data["allocated"]], label="allocated", lw=1)
    if "reserved" in data:
        ax.plot(data["event"], [b / GiB for b in data["reserved"]], label="reserved (simulated)",
                lw=1)
    marks = data["phases"]
    end = data["event"][-1] if data["event"] else 0
    named = set()
    for mark, after in zip(marks, [*marks[1:], None]):
        stop = after["event"] if after is not None else end
        phase = mark["phase"]
        ax.axvspan(mark["event"], stop, color=PHASE_COLORS.get(phase, "grey"), alpha=0.08, lw=0,
                   label=None if phase in named else phase)
        named.add(phase)
        ax.text(mark["event"], 0, f" {phase[0]}{mark['iteration']}", fontsize=7, va="bottom",
                color="grey")
    if gpu is not None:  # the curves leave out the CUDA context: draw what the allocator gets
        from hybridmem.allocator.overheads import allocator_capacity

        cap = allocator_capacity(gpu)
        ax.axhline(cap / GiB, color="red", linestyle="--", lw=1,
                   label=f"{gpu.name}: {cap / GiB:.1f} GiB for the allocator "
                   f"({gpu.memory_bytes / GiB:.1f} GiB less the CUDA context)")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("allocator event")
    ax.set_ylabel("GiB")
    if title:
        ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return fig


def thinned(data: dict, points: int) -> dict:
    """`data` (what `save_timeline` writes as JSON) with at most `points` points: the max of
    each bucket of consecutive points, as `TraceResult.timeline` down-samples the curve, so the
    peak survives; the phase marks and the peak are kept as they are."""
    n = len(data["event"])
    step = max(1, -(-n // points))
    out = dict(data)
    out["event"] = data["event"][::step]
    for key in ("allocated", "reserved"):
        if key in data:
            out[key] = [max(data[key][i:i + step]) for i in range(0, n, step)]
    return out
