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


def main_for(table, path: Path, start: str, end: str, argv: list[str] | None = None) -> int:
    """The command line of a doc-block script: print `table()` and write it between the
    markers of `path` unless `--no-write`."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    block = table()
    print(block)
    if not args.no_write:
        replace_block(path, block, start, end)
    return 0


def write_results(out: Path, meta: dict, caption: str, header: str, rows: list[str]) -> str:
    """`out`.json (the numbers: `meta`) and `out`.md (caption, then the markdown table whose
    header line is `header` with right-aligned columns after the first and `rows` below);
    returns the markdown. The benchmarks' one results writer (experiments/results/)."""
    import json

    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1))
    columns = header.count("|") - 1
    rule = "|---|" + "---:|" * (columns - 1)
    text = "\n".join([caption, "", header, rule, *rows]) + "\n"
    out.with_suffix(".md").write_text(text)
    return text
