"""Price many jobs in worker processes: answers in the order given, each job's error in its row.

Why processes, not threads: pricing is pure Python (the analytic closed forms, the allocator
replay), so threads share one interpreter lock and one slow job (a large replay) delays the
rest; processes price in parallel and a crash (a worker killed for memory) loses only the
chunks that worker held. Why chunks: a job takes milliseconds once a process has its caches
warm (the model graph, the replayed envelopes), so sending jobs one by one would spend more on
pickling and queueing than on pricing; a chunk goes to one worker and keeps its caches hot.

`price_many(fn, items)` is the one engine: `hybridmem predict --jobs` and `hybridmem plan`
call it, and an HTTP batch endpoint can (`fn` must be a module-level function so that it
pickles; it takes one item and returns a JSON-ready dict).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from hybridmem.errors import SpecError

CHUNKS_PER_WORKER = 4
"""Chunks each worker gets (about): few enough that pickling stays small next to pricing,
enough that one slow chunk does not leave the other workers idle at the end."""


def one_line(err: BaseException) -> str:
    """An error as the one line the job's row carries: a SpecError's own line (field, value,
    choices), anything else with its type so a bug is told from bad input."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return text if isinstance(err, SpecError) else f"{type(err).__name__}: {text}"


def _guarded(fn: Callable[[object], dict], item: object) -> dict:
    try:
        return fn(item)
    except Exception as err:  # noqa: BLE001 - one job's failure is that job's row
        return {"error": one_line(err)}


def _chunk(fn: Callable[[object], dict], items: Sequence) -> list[dict]:
    return [_guarded(fn, item) for item in items]


def default_workers() -> int:
    """The CPUs this process may use (`os.sched_getaffinity` where the OS has it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def price_many(fn: Callable[[object], dict], items: Sequence, workers: int | None = None) -> list[dict]:
    """`fn(item)` for every item, in order; an item whose `fn` raised gets `{"error": line}`.
    `workers` processes (default: the CPUs available); 1 prices in this process (no pool to
    start, the baseline the parallel runs are measured against). A worker that dies takes
    its chunk with it: those items get an error row, the others are still answered."""
    items = list(items)
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise SpecError("workers", workers, reason="must be at least 1")
    workers = min(workers, max(1, len(items)))
    if workers == 1:
        return _chunk(fn, items)
    size = max(1, -(-len(items) // (workers * CHUNKS_PER_WORKER)))
    starts = range(0, len(items), size)
    out: list[dict] = []
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_chunk, fn, items[i:i + size]) for i in starts]
        for start, future in zip(starts, futures):
            try:
                out += future.result()
            except BrokenProcessPool as err:
                count = min(size, len(items) - start)
                out += [{"error": f"worker process died: {err}"}] * count
    return out
