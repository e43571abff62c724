"""One `POST /v1/predict` answer: `hybridmem predict --json`'s object (`hybridmem.answer`), plus
what only the page asks for: the trace tier's memory timeline and a verdict for every GPU in
the catalogue.

Why its own module: the answer is computed in the server's threads (analytic, hybrid) or in a
trace worker process (`hybridmem.serve.pool`), and both must add the same things the same way.
Both additions are opt-in (`timeline`, `every_gpu` in the body), so a request without them is
answered exactly as the CLI answers.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

TIMELINE_POINTS = 400
"""Most points of a timeline in an answer: a few hundred draw the curve on a page of ~600 px
(the CLI's `--timeline FILE.json` keeps up to `trace.result.TIMELINE_POINTS`)."""

REPLAYED_TIERS: frozenset[str] = frozenset({"analytic"})
"""Tiers whose answer is priced again for each catalogue GPU (its allocator replay within that
GPU's capacity decides "after-retry"): the closed form costs milliseconds per GPU. A trace
costs seconds to minutes, and the hybrid tier may fall back to one, so for them the GPUs other
than the one asked for get yes/no from the answer's device peak against their memory."""


def respond(resolved, warnings: list[str], gpu, method: str | None, find_max_batch: bool,
            timeline: bool = False, every_gpu: bool = False) -> dict:
    """The answer's dict; `timeline`: add the trace tier's timeline (`timeline_of`; other tiers
    draw none, so it is left out there); `every_gpu`: add `every_gpu` (`verdicts`)."""
    from hybridmem.answer import answer
    from hybridmem.intake.resolve import ResolvedJob, resolve_once

    job = resolved if isinstance(resolved, ResolvedJob) else resolve_once(resolved, method)
    chosen = job.method
    with tempfile.TemporaryDirectory(prefix="hybridmem-timeline-") as folder:
        path = Path(folder) / "timeline.json" if timeline and chosen == "trace" else None
        result = answer(job, warnings, gpu, method=method, find_max_batch=find_max_batch,
                        timeline=None if path is None else str(path))
        out = result.to_dict()
        if path is not None:
            out["timeline"] = timeline_of(path)
    if every_gpu:
        out["every_gpu"] = verdicts(result.result, job, chosen)
    return out


def timeline_of(path: Path) -> dict:
    """The JSON the CLI's `--timeline FILE.json` writes (`trace.timeline.save_timeline`), with
    at most `TIMELINE_POINTS` points (`trace.timeline.thinned`)."""
    from hybridmem.trace.timeline import thinned

    return thinned(json.loads(path.read_text()), TIMELINE_POINTS)


def verdicts(result, spec, method: str) -> list[dict]:
    """One row per catalogue GPU: its name, memory, `fit` (`prediction.FIT_OUTCOMES`),
    headroom, and `by`: "replay" (the tier's answer for that GPU, whose allocator replay within
    the GPU's capacity tells "after-retry" from "yes"; the GPU asked for is the answer itself)
    or "peak" (yes/no from the answer's device peak against the GPU's memory, no replay:
    `REPLAYED_TIERS`)."""
    from hybridmem.gpus import GPUS
    from hybridmem.predict import predict

    rows = []
    for name, gpu in GPUS.items():
        if name == result.gpu_name:
            fit, headroom, by = result.fit, result.headroom_bytes, "replay"
        elif method in REPLAYED_TIERS:
            other = predict(spec, method=method, gpu=gpu)  # `spec`: a ResolvedJob, or a spec
            fit, headroom, by = other.fit, other.headroom_bytes, "replay"
        else:
            fit = "yes" if result.fits_within(gpu.memory_bytes) else "no"
            headroom, by = gpu.memory_bytes - result.verdict_bytes, "peak"
        rows.append({"gpu": name, "memory_bytes": gpu.memory_bytes, "fit": fit,
                     "headroom_bytes": headroom, "by": by})
    return rows
