"""`hybridmem collect`: run a sweep on the GPU (or through a tier) and grow the dataset.

The command itself is `hybridmem.harness.command.collect_command` (also runnable alone as
`python -m hybridmem.harness`); this module only registers it.
"""

from __future__ import annotations

import typer

from hybridmem.harness.command import collect_command


def register(app: typer.Typer) -> None:
    app.command("collect")(collect_command)
