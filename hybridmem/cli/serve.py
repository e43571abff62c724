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
    workers: int = typer.Option(2, "--workers", help="Worker processes for analytic jobs "
                                "(a job past --timeout is stopped by killing its worker)."),
    queue: int = typer.Option(64, "--queue", help="Analytic jobs that may wait for a worker "
                              "(then 429)."),
    trace_workers: int = typer.Option(1, "--trace-workers",
                                      help="Worker processes for trace-tier jobs (0: refuse them)."),
    trace_queue: int = typer.Option(4, "--trace-queue",
                                    help="Trace jobs that may wait for a worker (then 429)."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds a request may take (504)."),
    max_body: int = typer.Option(256 * 1024, "--max-body", help="Largest request body, bytes."),
    max_batch_jobs: int = typer.Option(1000, "--max-batch-jobs",
                                       help="Most jobs in one POST /v1/predict/batch."),
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
    for name, value in (("--workers", workers), ("--queue", queue),
                        ("--trace-workers", trace_workers), ("--trace-queue", trace_queue),
                        ("--max-batch-jobs", max_batch_jobs)):
        if value < 0:
            raise SpecError(name, value, reason="must be 0 or more")
    if workers < 1:  # the server's threads cannot stop a job past --timeout
        raise SpecError("--workers", workers, reason="must be 1 or more")
    settings = Settings(workers=workers, queue=queue, trace_workers=trace_workers,
                        trace_queue=trace_queue, timeout_s=timeout, max_body_bytes=max_body,
                        max_batch_jobs=max_batch_jobs, cors_origins=tuple(cors_origin or ()))
    # a request still running at SIGTERM / SIGINT waits this long, then the pools are stopped
    uvicorn.run(create_app(settings), host=host, port=port, log_level="info",
                timeout_graceful_shutdown=5)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve_command)
