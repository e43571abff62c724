"""A bounded pool of worker processes whose jobs can be stopped: `Workers`.

Why not `concurrent.futures.ProcessPoolExecutor`: it cannot stop one job. A future past its
time limit frees the caller, not the core (a micro-batch of 10**20 kept one busy for minutes),
and its workers share one call queue whose pipe each child holds both ends of, so a worker
whose parent dies waits on it forever. Here each worker is a spawned process with a pipe of
its own: a job runs in one worker, a job past its deadline has its worker killed (SIGKILL,
the core is free at once; a fresh worker is spawned when next needed), a worker exits when
its parent dies (end of file on its pipe, or a new parent pid), and `shutdown` stops every
worker and multiprocessing's resource tracker, so no process outlives its owner.

Bounds: at most `size` jobs run at once and `queue` more wait; `run(..., wait=False)` refuses
one more at once (`Busy`: HTTP 429), `wait=True` waits for a slot within the deadline (a batch
of jobs, the CLI's many jobs). `in_thread=True` runs jobs in threads of this process instead
(tests, where a spawned interpreter would import the package again for nothing checked); a
job is then not stopped at its deadline, only abandoned.

Used by `hybridmem serve` (`hybridmem.serve.pool`: the analytic and the trace pools, and
`POST /v1/predict/batch`); imports nothing of the package but `hybridmem.errors`, so any
front door can use it.
"""

from __future__ import annotations

import os
import queue as queues
import signal
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing import get_context
from multiprocessing.connection import Connection

from hybridmem.errors import SpecError

POLL_S = 1.0
"""How often an idle worker checks that its parent is alive (a second: the longest an orphan
lives when the parent is killed with SIGKILL)."""
STOP_S = 2.0
"""How long `shutdown` waits for a worker to exit by itself before killing it."""


_OPEN: set = set()
"""Pools not shut down: the last one to shut down stops the resource tracker."""
_OPEN_LOCK = threading.Lock()


class Busy(Exception):
    """Every worker is busy and the queue is full."""


class Unavailable(Exception):
    """The pool takes no work: no workers, or it was shut down."""


class WorkerDied(Exception):
    """The worker running the job died (killed, out of memory); the pool spawns another."""


class JobFailed(Exception):
    """The job raised something other than a SpecError: its type and message, one line."""


def _serve(conn: Connection, parent: int, warm: Callable | None) -> None:
    """A worker's loop: receive (function, args), send ("ok", result) / ("spec", a SpecError's
    fields: it does not survive pickling with them) / ("error", one line); leave when the
    parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops us
    if warm is not None:
        warm()
    while True:
        try:
            if not conn.poll(POLL_S):
                if os.getppid() != parent:
                    return
                continue
            fn, args = conn.recv()
        except (EOFError, OSError):  # the parent closed the pipe or died
            return
        try:
            out: tuple = ("ok", fn(*args))
        except SpecError as err:
            value = err.value if isinstance(err.value, (str, int, float, bool, type(None))) \
                else repr(err.value)
            out = ("spec", (err.field, value, err.choices, err.reason))
        except Exception as err:  # noqa: BLE001 - any failure goes back as one line
            text = str(err).splitlines()[0][:200] if str(err) else ""
            out = ("error", f"{type(err).__name__}: {text}")
        try:
            conn.send(out)
        except (OSError, ValueError):  # the parent is gone
            return
        except Exception as err:  # noqa: BLE001 - a result pickle refuses
            conn.send(("error", f"the result cannot be sent back ({type(err).__name__})"))


class _Worker:
    """One spawned process and its end of the pipe."""

    def __init__(self, warm: Callable | None):
        ctx = get_context("spawn")  # not fork: the owner has threads, a forked copy can hang
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, os.getpid(), warm), daemon=True)
        self.process.start()
        child.close()  # only the child holds its end: the parent's death is its end of file

    def call(self, fn: Callable, args: tuple, timeout: float | None) -> object:
        try:
            self.conn.send((fn, args))
            ready = self.conn.poll(timeout)
            if ready:
                kind, value = self.conn.recv()
        except (EOFError, OSError):  # OSError: not TimeoutError, which is raised below
            raise WorkerDied("a worker died (killed or out of memory)") from None
        if not ready:
            raise TimeoutError
        if kind == "spec":
            raise SpecError(*value)
        if kind == "error":
            raise JobFailed(value)
        return value

    def stop(self) -> None:
        """Kill the process (its job is abandoned, or it died) and close its pipe."""
        self.conn.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.process.close()


class Workers:
    """`size` worker processes (spawned when first needed) and `queue` waiting jobs; `warm`:
    a function each new worker runs first (importing what its jobs need)."""

    def __init__(self, size: int, queue: int = 0, *, in_thread: bool = False,
                 warm: Callable | None = None):
        self.size, self.queue, self.in_thread, self.warm = size, queue, in_thread, warm
        self.capacity = size + queue
        self._slots = threading.BoundedSemaphore(max(self.capacity, 1))
        self._idle: queues.SimpleQueue[_Worker] = queues.SimpleQueue()
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = ThreadPoolExecutor(max(size, 1), thread_name_prefix="worker") \
            if in_thread else None
        with _OPEN_LOCK:
            _OPEN.add(self)

    def run(self, fn: Callable, *args, deadline: float | None = None, wait: bool = False):
        """`fn(*args)` in a worker, by `deadline` (time.monotonic()): its result, or the
        SpecError it raised; TimeoutError past the deadline (the worker killed); Busy when
        full and not `wait`; Unavailable with no workers; WorkerDied; JobFailed."""
        if self.size <= 0 or self._closed:
            raise Unavailable("no workers" if self.size <= 0 else "shut down")
        if wait:
            if not self._slots.acquire(timeout=_left(deadline)):
                raise TimeoutError
        elif not self._slots.acquire(blocking=False):
            raise Busy(f"{self.capacity} jobs running or queued")
        try:
            if self._threads is not None:
                try:
                    return self._threads.submit(fn, *args).result(_left(deadline))
                except FutureTimeout:
                    raise TimeoutError from None
            return self._in_worker(fn, args, deadline)
        finally:
            self._slots.release()

    def map(self, fn: Callable, items: Iterable[tuple], timeout: float | None = None
            ) -> list[tuple[bool, object]]:
        """`fn(*item)` for each item, `size` at a time, in order: (True, result) or (False,
        the exception); `timeout`: seconds each job may run from when it starts (TimeoutError
        past it, its worker killed)."""
        items = list(items)

        def one(args: tuple) -> tuple[bool, object]:
            deadline = None if timeout is None else time.monotonic() + timeout
            try:
                return True, self.run(fn, *args, deadline=deadline, wait=True)
            except Exception as err:  # noqa: BLE001 - each job's error is its own row
                return False, err

        with ThreadPoolExecutor(max(min(self.size, len(items)), 1)) as threads:
            return list(threads.map(one, items))

    def _in_worker(self, fn: Callable, args: tuple, deadline: float | None) -> object:
        worker = self._take(deadline)
        try:
            out = worker.call(fn, args, _left(deadline))
        except (TimeoutError, WorkerDied):
            self._drop(worker)  # killed now: the core is free before the caller hears
            self._replace()
            raise
        except BaseException:
            self._give(worker)
            raise
        self._give(worker)
        return out

    def _take(self, deadline: float | None) -> _Worker:
        """An idle worker, a new one while fewer than `size` are alive, else the next freed."""
        try:
            return self._idle.get_nowait()
        except queues.Empty:
            pass
        with self._lock:
            if len(self._all) < self.size:
                worker = _Worker(self.warm)
                self._all.add(worker)
                return worker
        try:
            return self._idle.get(timeout=_left(deadline))
        except queues.Empty:
            raise TimeoutError from None

    def _give(self, worker: _Worker) -> None:
        if self._closed:
            self._drop(worker)
        else:
            self._idle.put(worker)

    def _drop(self, worker: _Worker) -> None:
        with self._lock:
            self._all.discard(worker)
        worker.stop()

    def _replace(self) -> None:
        """A new idle worker for one killed, started now (it imports while nothing waits)."""
        with self._lock:
            if self._closed or len(self._all) >= self.size:
                return
            worker = _Worker(self.warm)
            self._all.add(worker)
        self._idle.put(worker)

    def start(self) -> None:
        """Spawn every worker now (the first jobs then find them warm)."""
        with self._lock:
            while not self.in_thread and not self._closed and len(self._all) < self.size:
                worker = _Worker(self.warm)
                self._all.add(worker)
                self._idle.put(worker)

    def pids(self) -> list[int]:
        """The worker processes alive now."""
        with self._lock:
            return [w.process.pid for w in self._all]

    def shutdown(self) -> None:
        """Stop every worker (idle ones exit on their closed pipe, busy ones are killed) and,
        with the last open pool, multiprocessing's resource tracker (which spawning started);
        later `run`s are Unavailable."""
        self._closed = True
        with self._lock:
            workers, self._all = list(self._all), set()
        for worker in workers:
            worker.conn.close()
        deadline = time.monotonic() + STOP_S
        for worker in workers:
            worker.process.join(_left(deadline))
            if worker.process.is_alive():
                worker.process.kill()
            worker.process.join()
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
        with _OPEN_LOCK:
            _OPEN.discard(self)
            last = not _OPEN
        if last:  # no other pool's worker holds the tracker's pipe: it exits at once
            stop_resource_tracker()


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


def stop_resource_tracker() -> None:
    """Stop the resource tracker multiprocessing started for spawned children (it would exit
    once every process holding its pipe had, but a stopped owner should leave nothing)."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    if getattr(tracker, "_pid", None) is not None:
        try:
            tracker._stop()
        except (OSError, ChildProcessError, AttributeError):
            pass
