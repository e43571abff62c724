"""`hybridmem serve`: the HTTP API and the page (`hybridmem.serve`), under uvicorn.

FastAPI and uvicorn come with the `serve` extra; without them the command fails in one line
naming it, and every other command works as before.
"""

from __future__ import annotations

from typing import Optional

import typer

from hybridmem.errors import SpecError

EXTRA_HINT = "pip install 'hybridmem[serve]'"


def serve_command(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (0.0.0.0: every "
                             "interface; the default answers this machine only)."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    trace_workers: int = typer.Option(1, "--trace-workers",
                                      help="Worker processes for trace-tier jobs (0: refuse them)."),
    trace_queue: int = typer.Option(4, "--trace-queue",
                                    help="Trace jobs that may wait for a worker (then 429)."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds a request may take (504)."),
    max_body: int = typer.Option(256 * 1024, "--max-body", help="Largest request body, bytes."),
    cors_origin: Optional[list[str]] = typer.Option(
        None, "--cors-origin", help="Allow browser pages of this origin to call the API "
        "(repeat for more; default: CORS off)."),
) -> None:
    """Serve the prediction over HTTP (POST /v1/predict) and the calculator page at /."""
    try:
        import uvicorn

        from hybridmem.serve.app import Settings, create_app
    except ModuleNotFoundError as err:  # one line, exit 2 (hybridmem.console.run_app)
        raise SpecError("serve", err.name, reason=f"not installed; hybridmem serve needs the "
                        f"serve extra: {EXTRA_HINT}") from None
    settings = Settings(trace_workers=trace_workers, trace_queue=trace_queue, timeout_s=timeout,
                        max_body_bytes=max_body, cors_origins=tuple(cors_origin or ()))
    uvicorn.run(create_app(settings), host=host, port=port, log_level="info")


def register(app: typer.Typer) -> None:
    app.command("serve")(serve_command)
