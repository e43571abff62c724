"""The server's two bounded pools of answer workers: analytic (and hybrid) jobs, trace jobs.

Why processes for both: a job past the time limit must stop, not just lose its client (a
micro-batch of 10**20 used to keep a core busy for minutes after its 504), and only a process
can be stopped from outside; `hybridmem.workers.Workers` kills the job's worker at the
deadline. Why two pools: a trace builds the model on fake tensors and takes seconds to
minutes (its worker imports torch and transformers, ~400 MB), an analytic answer takes
milliseconds to seconds; apart, a queue of traces never holds up an analytic answer or a
health check. Each pool runs at most `workers` jobs and queues `queue` more; one more is
refused at once (429) rather than queued without bound.
"""

from __future__ import annotations

from collections.abc import Callable

from hybridmem import workers as pools

Busy, Unavailable = pools.Busy, pools.Unavailable


class Failed(Exception):
    """The answer raised something other than a SpecError (a bug): its one line (HTTP 500,
    without the traceback the worker kept)."""


def answer_job(*args) -> dict:
    """A worker's job: the answer's dict (`respond(*args)`)."""
    from hybridmem.serve.respond import respond

    return respond(*args)


def warm_analytic() -> None:
    """What a new analytic worker imports before its first job (seconds otherwise spent in it)."""
    import hybridmem.analytic.estimate  # noqa: F401
    import hybridmem.serve.respond  # noqa: F401


class AnswerPool:
    """`run(args, deadline)` answers `job(*args)` in a worker of this pool, or raises Busy /
    Unavailable / TimeoutError / the job's SpecError. `kind` names the pool in its errors
    ("trace": `--trace-workers`, "analytic": `--workers`); `in_thread` runs jobs in threads
    (tests); `job` replaces the answer (tests)."""

    def __init__(self, workers: int, queue: int, kind: str = "trace", *,
                 in_thread: bool = False, job: Callable = answer_job,
                 warm: Callable | None = None):
        self.kind, self.job = kind, job
        self.workers = pools.Workers(workers, queue, in_thread=in_thread, warm=warm)
        self.option = "--trace-workers" if kind == "trace" else "--workers"

    @property
    def capacity(self) -> int:
        return self.workers.capacity

    def run(self, args: tuple, deadline: float, wait: bool = False) -> dict:
        try:
            return self.workers.run(self.job, *args, deadline=deadline, wait=wait)
        except pools.Busy:
            raise Busy(f"{self.capacity} {self.kind} jobs running or queued; retry later") \
                from None
        except pools.Unavailable:
            if self.workers.size <= 0:
                raise Unavailable(f"the {self.kind} tier is off on this server "
                                  f"({self.option} 0)") from None
            raise Unavailable(f"the {self.kind} pool is shut down") from None
        except pools.WorkerDied:  # out of memory, killed: the next job gets a fresh worker
            raise Unavailable(f"{self.kind}: a worker died; retry (a fresh one starts)") from None
        except pools.JobFailed as err:
            raise Failed(f"the {self.kind} answer failed: {err}") from None

    def start(self) -> None:
        self.workers.start()

    def shutdown(self) -> None:
        self.workers.shutdown()

    def pids(self) -> list[int]:
        return self.workers.pids()
