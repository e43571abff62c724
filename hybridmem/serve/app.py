"""The FastAPI app of `hybridmem serve`: the API, its limits, and the page at `/`.

`POST /v1/predict` answers what `hybridmem predict --json` answers (`hybridmem.answer`) for a
job given as JSON (`hybridmem.serve.request`), `POST /v1/predict/batch` a list of them in order;
`GET /v1/schema` describes the job fields for the page's form; `/v1/models`, `/v1/gpus` and
`/healthz` list what a client needs. Limits that make it safe to leave running: a body size cap
(413), the job schema's bound on every number (422), a time limit per request (504) that stops
the work (the job's worker process is killed), analytic and trace jobs in two bounded pools of
worker processes (`hybridmem.serve.pool`; 429 when full, 503 when off), an LRU cache of
answers keyed on the resolved job, no path from a request, CORS only for origins given; on
shutdown no worker outlives the server.
"""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse

from hybridmem.errors import SpecError
from hybridmem.jsonfile import parse_json
from hybridmem.serve.page import mount as mount_page
from hybridmem.serve.pool import AnswerPool, Busy, Failed, Unavailable, warm_analytic
from hybridmem.serve.request import REQUEST_FIELDS, Job, parse_body
from hybridmem.serve.schema import request_schema, schema_view

INLINE = {"config.json": "config.json (inline)", ".txt": "lengths (inline)"}
"""How an answer names what the server wrote to its own folder from a request (a config.json
object, inline lengths), by the file's ending: never by the server's own path."""
GRACE_S = 2.0
"""The request's clock runs this much past the job's deadline before it answers 504 itself:
the worker is killed at the deadline, and the 504 follows that, not the other way round."""


@dataclass
class Settings:
    """What `hybridmem serve`'s options set."""

    workers: int = 2
    """Worker processes for analytic and hybrid jobs (0: in the server's threads, where a
    job past the time limit cannot be stopped: for tests and embedding only)."""
    queue: int = 64
    """Analytic jobs that may wait for a worker; one more is refused with 429."""
    trace_workers: int = 1
    """Worker processes for trace-tier jobs (0: the trace tier is refused with 503)."""
    trace_queue: int = 4
    """Trace jobs that may wait for a worker; one more is refused with 429."""
    max_batch_jobs: int = 1000
    """Most jobs in one `POST /v1/predict/batch` (each is also held to the body cap)."""
    timeout_s: float = 600.0
    """Longest a request may take (504 after it); a trace of a 70B model takes minutes."""
    max_body_bytes: int = 256 * 1024
    """Largest request body (413): a config.json or a launcher YAML is a few KiB."""
    cache_size: int = 256
    """Answers kept, least recently used dropped first."""
    cors_origins: tuple[str, ...] = ()
    """Origins allowed to call the API from a browser page of theirs (none: CORS off)."""
    workdir: Path | None = None
    """The server's own folder (inline config.json objects); a temporary one by default."""
    pool: AnswerPool | None = field(default=None, repr=False)
    """A trace pool to use instead of building one (tests)."""
    analytic_pool: AnswerPool | None = field(default=None, repr=False)
    """An analytic pool to use instead of building one (tests)."""


class Cache:
    """A thread-safe LRU of answers keyed on the canonical JSON of the resolved job."""

    def __init__(self, size: int):
        self.size = size
        self._items: OrderedDict[str, dict] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> dict | None:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
            return None

    def put(self, key: str, value: dict) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)


@dataclass
class Prepared:
    """A parsed, resolved request: what to price and the cache key of its answer."""

    args: tuple
    key: str
    trace: bool


class Service:
    """The work behind `POST /v1/predict`: the request parsed and resolved in a thread of the
    server, the answer priced in a worker of the analytic or the trace pool."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.workdir = settings.workdir or Path(tempfile.mkdtemp(prefix="hybridmem-serve-"))
        self.cache = Cache(settings.cache_size)
        self.pool = settings.pool or AnswerPool(settings.trace_workers, settings.trace_queue)
        self.analytic = settings.analytic_pool or AnswerPool(
            max(settings.workers, 1), settings.queue, "analytic",
            in_thread=settings.workers <= 0, warm=warm_analytic)

    def prepare(self, body: object) -> Prepared:
        """The request -> the answer's arguments and cache key (a SpecError when bad)."""
        from hybridmem.answer import resolve_gpu, resolve_job
        from hybridmem.job.schema import job_dict
        from hybridmem.intake.resolve import resolve_once

        from hybridmem.intake.config_keys import collect_warnings

        with collect_warnings() as read:  # a pasted launcher config is read here
            job: Job = parse_body(body, self.workdir)
        resolved, warnings = resolve_job(job.values)
        warnings = [*read, *(w for w in warnings if w not in read)]
        gpu = resolve_gpu(job.gpu, job.gpu_mem)
        key = json.dumps([job_dict(resolved.spec), resolved.sources, warnings,
                          None if gpu is None else asdict(gpu), job.method, job.find_max_batch,
                          job.timeline, job.every_gpu], sort_keys=True, default=str)
        priced = resolve_once(resolved, job.method)  # the defaults and the tier, once
        return Prepared((priced, warnings, gpu, job.method, job.find_max_batch, job.timeline,
                         job.every_gpu), key, priced.method == "trace")

    def predict(self, body: object, deadline: float, wait: bool = False) -> tuple[dict, bool]:
        """(the answer, whether it came from the cache); `wait`: wait for a worker within the
        deadline rather than refusing when the pool is full (a batch's jobs)."""
        job = self.prepare(body)
        hit = self.cache.get(job.key)
        if hit is not None:
            return hit, True
        pool = self.pool if job.trace else self.analytic
        out = _hide(pool.run(job.args, deadline, wait), str(self.workdir))
        self.cache.put(job.key, out)
        return out, False

    def batch(self, bodies: list) -> list[dict]:
        """Each job's row, in order: {"status": 200, "answer": ...} or {"status": code,
        "detail": the one line, ...}; priced `workers` at a time in the pools' processes,
        each job held to the time limit from when it starts."""
        def one(body: object) -> dict:
            try:
                deadline = time.monotonic() + self.settings.timeout_s
                out, hit = self.predict(body, deadline, wait=True)
                return {"status": 200, "cache": "hit" if hit else "miss", "answer": out}
            except REFUSALS as err:
                status, fields = refusal(err, self.settings.timeout_s)
                return {"status": status, **fields}

        threads = max(self.settings.workers, 1) + max(self.settings.trace_workers, 0)
        with ThreadPoolExecutor(min(threads, max(len(bodies), 1))) as pool:
            return list(pool.map(one, bodies))

    def shutdown(self) -> None:
        """Stop both pools' workers (and with them multiprocessing's resource tracker)."""
        self.analytic.shutdown()
        self.pool.shutdown()


def _hide(value: object, folder: str) -> object:
    """`value` with the server's own paths (what it wrote from a request) named by `INLINE`."""
    if isinstance(value, str) and folder in value:
        pattern = re.escape(folder) + r"""[^\s'":]*"""
        return re.sub(pattern, lambda m: next((name for end, name in INLINE.items()
                                               if m.group().endswith(end)), "(inline)"), value)
    if isinstance(value, dict):
        return {k: _hide(v, folder) for k, v in value.items()}
    if isinstance(value, list):
        return [_hide(v, folder) for v in value]
    return value


REFUSALS = (SpecError, TimeoutError, FutureTimeout, Busy, Unavailable, Failed)
"""What pricing a request may raise that is answered, not a bug."""


def refusal(err: Exception, timeout_s: float) -> tuple[int, dict]:
    """The HTTP status and body of one of `REFUSALS`: 422 bad input (the one line, its field,
    value and choices), 504 past the time limit, 429 pool full, 503 pool off or a worker
    died, 500 the answer failed (its one line)."""
    if isinstance(err, SpecError):
        return 422, _fields(str(err), err)
    if isinstance(err, (TimeoutError, FutureTimeout)):
        return 504, _fields(f"time limit: no answer within {timeout_s:g} s", None)
    return {Busy: 429, Unavailable: 503}.get(type(err), 500), _fields(str(err), None)


def _fields(message: str, err: SpecError | None) -> dict:
    body: dict = {"detail": message}
    if err is not None:
        body.update(field=err.field, value=_jsonable(err.value), choices=err.choices)
    return body


def _error(status: int, message: str, err: SpecError | None = None) -> JSONResponse:
    return JSONResponse(_fields(message, err), status_code=status)


def _jsonable(value: object) -> object:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


async def _body(request: Request, limit: int) -> bytes | None:
    """The body, or None when it is larger than `limit` (checked as it arrives, so a client
    that sends no Content-Length cannot stream more)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


@lru_cache(maxsize=1)
def _models() -> list[dict]:
    from hybridmem.models.catalog import catalog

    return [r.as_dict() for r in catalog()]


def _page() -> str:
    return resources.files("hybridmem.serve").joinpath("static/index.html").read_text()


async def _json_body(request: Request, max_body_bytes: int) -> object:
    """The parsed body, or the 413 / 422 answer."""
    raw = await _body(request, max_body_bytes)
    if raw is None:
        return _error(413, f"body: larger than {max_body_bytes} bytes")
    try:  # not UTF-8, malformed or nested past jsonfile.MAX_DEPTH: one 422 line
        return parse_json(raw or b"null", "body", "request")
    except SpecError as err:
        return _error(422, f"body: {err.reason}")


def _info_routes(app: FastAPI) -> None:
    """The page, the health check and the read-only catalogues."""

    @app.exception_handler(SpecError)
    async def _spec_error(_request: Request, err: SpecError) -> JSONResponse:
        return _error(422, str(err), err)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(_page())

    @app.get("/healthz")
    async def healthz() -> dict:
        """Answers at once, whatever the trace pool is doing."""
        return {"status": "ok"}

    @app.get("/v1/schema")
    async def job_schema() -> dict:
        """The job fields (names, help, choices, defaults, groups) and the other body keys."""
        return schema_view()

    @app.get("/v1/gpus")
    async def gpus() -> list[dict]:
        """The GPU catalogue (`hybridmem gpus --json`)."""
        from hybridmem.cli.gpus import rows

        return rows()

    @app.get("/v1/models")
    def models() -> list[dict]:
        """The shipped presets (`hybridmem models --json`)."""
        return _models()


def _predict_routes(app: FastAPI, service: Service, settings: Settings) -> None:
    """`POST /v1/predict` and `/v1/predict/batch`: the job bodies, each priced by `service`."""

    @app.post("/v1/predict", openapi_extra={"requestBody": {
        "required": True, "content": {"application/json": {"schema": request_schema()}}}})
    async def predict(request: Request) -> JSONResponse:
        """The job as JSON (the `job` object's names, plus gpu, method, find_max_batch and
        inline config files) -> the `hybridmem predict --json` object; `X-Cache: hit` when it
        came from the cache."""
        body = await _json_body(request, settings.max_body_bytes)
        if isinstance(body, JSONResponse):
            return body
        deadline = time.monotonic() + settings.timeout_s
        try:
            with anyio.fail_after(settings.timeout_s + GRACE_S):
                out, hit = await anyio.to_thread.run_sync(service.predict, body, deadline,
                                                          abandon_on_cancel=True)
        except REFUSALS as err:
            status, fields = refusal(err, settings.timeout_s)
            return JSONResponse(fields, status_code=status)
        return JSONResponse(out, headers={"X-Cache": "hit" if hit else "miss"})

    jobs_schema = {"type": "array", "items": request_schema()}

    @app.post("/v1/predict/batch", openapi_extra={"requestBody": {
        "required": True, "content": {"application/json": {"schema": {"oneOf": [
            jobs_schema, {"type": "object", "properties": {"jobs": jobs_schema}}]}}}}})
    async def predict_batch(request: Request) -> JSONResponse:
        """[job, ...] or {"jobs": [job, ...]} (each a `POST /v1/predict` body) ->
        {"results": [row, ...]} in the same order: each row {"status": 200, "answer": ...} or
        {"status": 422 / 429 / 503 / 504, "detail": the one line}; at most --max-batch-jobs
        jobs, the whole body held to --max-body, every job to the time limit (from when a
        worker takes it)."""
        body = await _json_body(request, settings.max_body_bytes)
        if isinstance(body, JSONResponse):
            return body
        jobs = body.get("jobs") if isinstance(body, dict) and set(body) == {"jobs"} else body
        if not isinstance(jobs, list):
            return _error(422, "body: must be [job, ...] or {\"jobs\": [job, ...]}")
        if len(jobs) > settings.max_batch_jobs:
            return _error(422, f"jobs: {len(jobs)} jobs, more than {settings.max_batch_jobs} "
                          "(--max-batch-jobs)")
        # each job keeps its own time limit (`Service.batch`): no limit on the whole
        rows = await anyio.to_thread.run_sync(service.batch, jobs, abandon_on_cancel=True)
        return JSONResponse({"results": rows})


def create_app(settings: Settings | None = None) -> FastAPI:
    """The app; `settings` default to `hybridmem serve`'s defaults."""
    settings = settings or Settings()
    service = Service(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        # the analytic workers start with the server, so the first answers find them warm
        await anyio.to_thread.run_sync(service.analytic.start)
        try:
            yield
        finally:  # uvicorn's SIGTERM / SIGINT handling ends here: no worker outlives us
            service.shutdown()

    app = FastAPI(title="hybridmem", version="1", lifespan=lifespan,
                  description="Predict the peak GPU memory of a training job before it runs. "
                  "`POST /v1/predict` answers what `hybridmem predict --json` answers.")
    app.state.service = service
    if settings.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                           allow_methods=["GET", "POST"], allow_headers=["content-type"])

    _info_routes(app)
    _predict_routes(app, service, settings)
    mount_page(app)  # POST /v1/config (the page's "fill the form") and /docs offline
    return app


__all__ = ["REQUEST_FIELDS", "Settings", "create_app"]
