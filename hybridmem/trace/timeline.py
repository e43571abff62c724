"""Save a trace's timeline: JSON (data) or PNG (a plot), by the file's suffix."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hybridmem.errors import SpecError

GiB = 1024**3


def save_timeline(result, path: str | os.PathLike) -> Path:
    """Write `result.timeline()` to `path` (.json, or .png via matplotlib); returns the path."""
    path = Path(path)
    data = result.timeline()
    if path.suffix.lower() == ".json":
        path.write_text(json.dumps(data))
    elif path.suffix.lower() == ".png":
        _plot(data, path)
    else:
        raise SpecError("timeline", str(path), (".json", ".png"), reason="unknown file type")
    return path


def _plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(data["event"], [b / GiB for b in data["allocated"]], label="allocated", lw=1)
    if "reserved" in data:
        ax.plot(data["event"], [b / GiB for b in data["reserved"]], label="reserved (simulated)",
                lw=1)
    for mark in data["phases"]:
        ax.axvline(mark["event"], color="grey", lw=0.5, alpha=0.5)
        ax.text(mark["event"], 0, f" {mark['phase'][0]}{mark['iteration']}", fontsize=7,
                va="bottom", color="grey")
    ax.set_xlabel("allocator event")
    ax.set_ylabel("GiB")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
