"""The trace tier's bounded pool: a few worker processes and a short queue.

Why: a trace builds the model on fake tensors and can take minutes (a 70B model); run in the
server's own threads it would hold the threads that answer analytic jobs and health checks.
Here at most `workers` traces run at once and `queue` more wait; one more is refused at once
(429, the client retries later) rather than queued without bound.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context


class Busy(Exception):
    """Every worker is busy and the queue is full (HTTP 429)."""


class Unavailable(Exception):
    """The pool takes no work: no workers configured, or it broke or shut down (HTTP 503)."""


def _answer(*args) -> tuple[str, object]:
    """A worker's job: ("ok", the answer's dict: `respond(*args)`) or ("error", a SpecError's
    arguments): a SpecError does not survive pickling with its fields, so they come back to
    rebuild it."""
    from hybridmem.errors import SpecError
    from hybridmem.serve.respond import respond

    try:
        return "ok", respond(*args)
    except SpecError as err:
        value = err.value if isinstance(err.value, (str, int, float, bool, type(None))) \
            else repr(err.value)
        return "error", (err.field, value, err.choices, err.reason)


class TracePool:
    """`submit` runs `job` (the answer, by default) in the pool, or raises Busy / Unavailable
    at once; `executor` replaces the worker processes (tests)."""

    def __init__(self, workers: int, queue: int, executor: Executor | None = None,
                 job: Callable = _answer):
        self.workers = workers
        self.job = job
        self.capacity = workers + queue
        self._slots = threading.BoundedSemaphore(max(self.capacity, 1))
        self._executor = executor
        self._lock = threading.Lock()

    def _pool(self) -> Executor:
        with self._lock:
            if self._executor is None:
                # spawn, not fork: the server has threads, and a forked copy of them can hang
                self._executor = ProcessPoolExecutor(self.workers, mp_context=get_context("spawn"))
            return self._executor

    def submit(self, *args) -> Future:
        if self.workers <= 0:
            raise Unavailable("the trace tier is off on this server (--trace-workers 0)")
        if not self._slots.acquire(blocking=False):
            raise Busy(f"{self.capacity} trace jobs running or queued; retry later")
        try:
            future = self._pool().submit(self.job, *args)
        except (BrokenProcessPool, RuntimeError) as err:
            self._slots.release()
            raise Unavailable(f"the trace pool is down ({err})") from None
        future.add_done_callback(lambda _: self._slots.release())
        return future

    def shutdown(self) -> None:
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None
