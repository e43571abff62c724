"""README's options table is the one the job schema generates (experiments/options_table.py),
and it documents every option `hybridmem predict` has."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
import options_table  # noqa: E402


def test_readme_block_is_the_generated_table():
    text = (ROOT / "README.md").read_text()
    block = re.search(re.escape(options_table.START) + r"\n(.*?)\n" + re.escape(options_table.END),
                      text, re.S)
    assert block, "README.md has no options markers"
    assert block.group(1) == options_table.table(), \
        "README options table is stale: run python experiments/options_table.py"


def test_every_option_has_a_row():
    import typer.main

    from hybridmem.cli import app

    cmd = typer.main.get_command(app).commands["predict"]
    table = options_table.table()
    for param in cmd.params:
        if param.name != "help":
            assert f"`{param.opts[0]}" in table, param.opts[0]
