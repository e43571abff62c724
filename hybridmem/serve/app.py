"""The FastAPI app of `hybridmem serve`: the API, its limits, and the page at `/`.

`POST /v1/predict` answers what `hybridmem predict --json` answers (`hybridmem.answer`) for a
job given as JSON (`hybridmem.serve.request`); `GET /v1/schema` describes the job fields for
the page's form; `/v1/models`, `/v1/gpus` and `/healthz` list what a client needs. Limits that
make it safe to leave running: a body size cap (413), a time limit per request (504), the
trace tier in a bounded process pool (429 when full, 503 when off), an LRU cache of answers
keyed on the resolved job, no path from a request, CORS only for origins given.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
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
from hybridmem.serve.pool import Busy, TracePool, Unavailable
from hybridmem.serve.request import REQUEST_FIELDS, Job, parse_body
from hybridmem.serve.respond import respond
from hybridmem.serve.schema import request_schema, schema_view

INLINE = "config.json (inline)"
"""How an answer names a model sent as a config.json object (not the server's own path)."""


@dataclass
class Settings:
    """What `hybridmem serve`'s options set."""

    trace_workers: int = 1
    """Worker processes for trace-tier jobs (0: the trace tier is refused with 503)."""
    trace_queue: int = 4
    """Trace jobs that may wait for a worker; one more is refused with 429."""
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
    pool: TracePool | None = field(default=None, repr=False)
    """A pool to use instead of building one (tests)."""


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


class Service:
    """The work behind `POST /v1/predict`, run in a thread of the server's pool."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.workdir = settings.workdir or Path(tempfile.mkdtemp(prefix="hybridmem-serve-"))
        self.cache = Cache(settings.cache_size)
        self.pool = settings.pool or TracePool(settings.trace_workers, settings.trace_queue)

    def predict(self, body: object, deadline: float) -> tuple[dict, bool]:
        """(the answer, whether it came from the cache)."""
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
        hit = self.cache.get(key)
        if hit is not None:
            return hit, True
        resolved = resolve_once(resolved, job.method)  # the defaults and the tier, once
        if resolved.method == "trace":
            future = self.pool.submit(resolved, warnings, gpu, job.method, job.find_max_batch,
                                      job.timeline, job.every_gpu)
            try:
                status, out = future.result(timeout=max(deadline - time.monotonic(), 0.0))
            except BrokenProcessPool:  # a worker died (out of memory, killed): a fresh pool
                self.pool.shutdown()
                raise Unavailable("a trace worker died; retry (a fresh pool starts)") from None
            if status == "error":
                raise SpecError(*out)
        else:
            out = respond(resolved, warnings, gpu, job.method, job.find_max_batch,
                          job.timeline, job.every_gpu)
        out = _hide(out, str(self.workdir))
        self.cache.put(key, out)
        return out, False


def _hide(value: object, folder: str) -> object:
    """`value` with the server's own paths (an inline config.json's) named `INLINE`."""
    if isinstance(value, str) and folder in value:
        head, _, tail = value.partition(folder)
        return head + INLINE + tail.split("config.json", 1)[-1]
    if isinstance(value, dict):
        return {k: _hide(v, folder) for k, v in value.items()}
    if isinstance(value, list):
        return [_hide(v, folder) for v in value]
    return value


def _error(status: int, message: str, err: SpecError | None = None) -> JSONResponse:
    body: dict = {"detail": message}
    if err is not None:
        body.update(field=err.field, value=_jsonable(err.value), choices=err.choices)
    return JSONResponse(body, status_code=status)


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


def create_app(settings: Settings | None = None) -> FastAPI:
    """The app; `settings` default to `hybridmem serve`'s defaults."""
    settings = settings or Settings()
    service = Service(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        service.pool.shutdown()

    app = FastAPI(title="hybridmem", version="1", lifespan=lifespan,
                  description="Predict the peak GPU memory of a training job before it runs. "
                  "`POST /v1/predict` answers what `hybridmem predict --json` answers.")
    app.state.service = service
    if settings.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                           allow_methods=["GET", "POST"], allow_headers=["content-type"])

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

    @app.post("/v1/predict", openapi_extra={"requestBody": {
        "required": True, "content": {"application/json": {"schema": request_schema()}}}})
    async def predict(request: Request) -> JSONResponse:
        """The job as JSON (the `job` object's names, plus gpu, method, find_max_batch and
        inline config files) -> the `hybridmem predict --json` object; `X-Cache: hit` when it
        came from the cache."""
        raw = await _body(request, settings.max_body_bytes)
        if raw is None:
            return _error(413, f"body: larger than {settings.max_body_bytes} bytes")
        try:  # not UTF-8, malformed or nested past jsonfile.MAX_DEPTH: one 422 line
            body = parse_json(raw or b"null", "body", "request")
        except SpecError as err:
            return _error(422, f"body: {err.reason}")
        deadline = time.monotonic() + settings.timeout_s
        try:
            with anyio.fail_after(settings.timeout_s):
                out, hit = await anyio.to_thread.run_sync(service.predict, body, deadline,
                                                          abandon_on_cancel=True)
        except (TimeoutError, FutureTimeout):
            return _error(504, f"time limit: no answer within {settings.timeout_s:g} s")
        except Busy as err:
            return _error(429, str(err))
        except Unavailable as err:
            return _error(503, str(err))
        return JSONResponse(out, headers={"X-Cache": "hit" if hit else "miss"})

    mount_page(app)  # POST /v1/config (the page's "fill the form") and /docs offline
    return app


__all__ = ["REQUEST_FIELDS", "Settings", "create_app"]
