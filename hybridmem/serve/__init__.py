"""`hybridmem serve`: the prediction over HTTP for schedulers and a calculator page for people.

A FastAPI app (`hybridmem.serve.app.create_app`) run by uvicorn; it needs the `serve` extra
(`pip install 'hybridmem[serve]'`). Nothing below `hybridmem.cli` imports this package, so
`hybridmem predict` works without FastAPI. The answer is `hybridmem predict --json`'s, built by
the same functions (`hybridmem.answer`).
"""
