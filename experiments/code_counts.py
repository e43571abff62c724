"""The redesign's counts (issue #35, "Show"), reproducible from the source:

    python experiments/code_counts.py [--no-runtime]

- call sites resolving the model's defaults (`resolve_defaults`, and the converter `as_job`
  that resolves a plain spec at a tier's Python entry), by file, read with `ast`;
- `choose_method` / `resolve_defaults` calls per CLI call and per HTTP request, measured by
  `experiments/resolve_counts.py` (profiling every thread; skipped with --no-runtime);
- functions over 80 lines and files over 400 lines per package of `hybridmem/`;
- the `lint-imports` contracts (pyproject.toml), each with its kind.

Why a script: the closing note's numbers are re-run, not remembered.
"""

from __future__ import annotations

import argparse
import ast
import collections
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hybridmem"
RESOLVERS = frozenset({"resolve_defaults", "resolved", "as_job"})
"""The functions that fill the model's defaults into a spec (families/defaults.py)."""
HOME = PACKAGE / "families" / "defaults.py"
"""Where the rule lives: its own helpers calling each other are not call sites."""
LONG_FUNCTION, LONG_FILE = 80, 400


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "shipped_models" not in p.parts)


def _name(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def resolving_sites() -> list[str]:
    out = []
    for path in _modules():
        if path == HOME:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and _name(node) in RESOLVERS:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno} {_name(node)}")
    return out


def long_functions() -> list[str]:
    out = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > LONG_FUNCTION:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n})")
    return out


def long_files() -> dict[str, list[str]]:
    out: dict[str, list[str]] = collections.defaultdict(list)
    for path in _modules():
        n = len(path.read_text().splitlines())
        if n > LONG_FILE:
            rel = path.relative_to(PACKAGE)
            package = rel.parts[0] if len(rel.parts) > 1 else "(top level)"
            out[package].append(f"{rel} ({n})")
    return dict(sorted(out.items()))


def contracts() -> list[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        config = tomllib.load(f)["tool"]["importlinter"]
    return [f"{c['type']:12s} {c['name']}" for c in config["contracts"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-runtime", action="store_true",
                    help="skip the per-request chooser count (it runs the CLI and the service)")
    args = ap.parse_args(argv)
    sites = resolving_sites()
    print(f"call sites resolving defaults: {len(sites)}")
    for s in sites:
        print(f"  {s}")
    if not args.no_runtime:
        sys.path.insert(0, str(ROOT / "experiments"))
        import resolve_counts

        print("calls per request (experiments/resolve_counts.py):")
        resolve_counts.main()
    funcs = long_functions()
    print(f"functions over {LONG_FUNCTION} lines: {len(funcs)}")
    for f in funcs:
        print(f"  {f}")
    files = long_files()
    print(f"files over {LONG_FILE} lines: {sum(map(len, files.values()))}")
    for package, names in files.items():
        print(f"  {package}: {len(names)}  {', '.join(names)}")
    found = contracts()
    print(f"lint-imports contracts: {len(found)}")
    for c in found:
        print(f"  {c}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
