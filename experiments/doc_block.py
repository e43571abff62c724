"""Replace the generated block between two HTML-comment markers of a doc (README.md, docs/)."""

from __future__ import annotations

import re
from pathlib import Path


def replace_block(path: Path, block: str, start: str, end: str) -> None:
    """Write `block` between `start` and `end` in `path`; both markers must already be there."""
    text = path.read_text()
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path}: no {start} ... {end} markers")
    path.write_text(pattern.sub(lambda _: f"{start}\n{block}\n{end}", text))
