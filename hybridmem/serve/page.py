"""What the page needs beyond the API: `POST /v1/config` (a pasted launcher config -> the form's
values) and `/docs` served with no network (Swagger UI's files from a package on disk).

`POST /v1/config` takes the `config` text (and `config_format`, and a `model` when the config
names none) as `POST /v1/predict` does, reads it with the same readers (`serve.request`, then
the options -> the job as `hybridmem predict --config` builds it) and answers the job fields the
config set (`values`: flat schema key -> value), where each came from, and the readers'
warnings. The page fills its form with `values`, so what it then predicts is the form.

`/docs`: FastAPI's default page loads Swagger UI from a CDN, which a machine without internet
(a cluster's login node) cannot reach. The `fastapi-offline` package ships Swagger UI's bundle
(swagger-ui 5.x, which renders FastAPI's OpenAPI 3.1); its static folder is mounted and
`/docs` points at it (fastapi.openapi.docs.get_swagger_ui_html). Without the package, FastAPI's
CDN page stays.
"""

from __future__ import annotations

import json
from pathlib import Path

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse

from hybridmem.errors import SpecError

DOCS_ASSETS = "/static-docs"
"""Where Swagger UI's files are served."""
CONFIG_KEYS = ("config", "config_format", "model")
"""The body keys `POST /v1/config` takes."""

router = APIRouter()


def read_config(body: object, workdir: Path) -> dict:
    """The job fields a pasted config sets (`values`), their `sources` and the `warnings`."""
    from hybridmem.answer import resolve_job
    from hybridmem.job import schema
    from hybridmem.intake.config_keys import collect_warnings
    from hybridmem.serve.request import parse_body

    if not isinstance(body, dict) or not isinstance(body.get("config"), str):
        raise SpecError("config", None if not isinstance(body, dict) else body.get("config"),
                        reason="send the config's text as `config`")
    extra = sorted(set(body) - set(CONFIG_KEYS))
    if extra:
        raise SpecError("body", extra[0], list(CONFIG_KEYS), reason="unknown field")
    with collect_warnings() as read:
        job = parse_body(body, workdir)
    resolved, warnings = resolve_job(job.values)
    flat = schema.job_dict(resolved.spec)
    values = {}
    for key, source in resolved.sources.items():
        if source.startswith("flag ") or key not in schema.BY_KEY:
            continue  # the model the form sent
        meta = schema.BY_KEY[key]
        value = (flat["lora"] or {}).get(meta.name) if meta.owner == "lora" else flat[meta.name]
        if value is not None:
            values[key] = value
    return {"values": values, "sources": {k: resolved.sources[k] for k in values},
            "warnings": [*read, *(w for w in warnings if w not in read)]}


@router.post("/v1/config")
async def config(request: Request) -> JSONResponse:
    """A pasted launcher config (`config`: its text; `config_format`; `model` when it names
    none) -> the job fields it sets, to fill the page's form."""
    service = request.app.state.service
    raw = await request.body()
    if len(raw) > service.settings.max_body_bytes:
        return JSONResponse({"detail": f"body: larger than {service.settings.max_body_bytes} "
                             "bytes"}, status_code=413)
    try:
        body = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return JSONResponse({"detail": f"body: malformed JSON ({err})"}, status_code=422)
    out = await anyio.to_thread.run_sync(read_config, body, service.workdir)
    return JSONResponse(out)


def swagger_assets() -> Path | None:
    """fastapi-offline's folder of Swagger UI files, or None when it is not installed."""
    try:
        import fastapi_offline
    except ModuleNotFoundError:
        return None
    folder = Path(fastapi_offline.__file__).parent / "static"
    return folder if (folder / "swagger-ui-bundle.js").is_file() else None


def offline_docs(app: FastAPI) -> bool:
    """`/docs` from Swagger UI's files on disk instead of a CDN; False when they are missing."""
    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.staticfiles import StaticFiles

    folder = swagger_assets()
    if folder is None or app.docs_url is None:
        return False
    docs = app.docs_url
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != docs]
    app.mount(DOCS_ASSETS, StaticFiles(directory=str(folder)), name="static-docs")

    @app.get(docs, include_in_schema=False)
    async def swagger(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(openapi_url=f"{root}{app.openapi_url}",
                                   title=f"{app.title} - API",
                                   swagger_js_url=f"{root}{DOCS_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{root}{DOCS_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{root}{DOCS_ASSETS}/favicon.png")

    return True


def mount(app: FastAPI) -> None:
    """The page's routes on `app` (`create_app` calls this once)."""
    app.include_router(router)
    offline_docs(app)
