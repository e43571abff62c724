"""No module reaches another module's private (underscore) names.

An underscore says "this module's own, free to change"; a name another module needs is part of
its interface and is spelled as such (docs/design.md, "The packages, one way"). Read from the
AST of every module in the package, so a lazy import inside a function counts too: both
`from hybridmem.x import _y` and `x._y` where `x` is a hybridmem module imported by name.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hybridmem"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_module(dotted: str) -> bool:
    """Whether `hybridmem.a.b` is a module or package of this checkout."""
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def private_reaches(source: str, where: str) -> list[str]:
    """`where:line module.name` for each private name of another hybridmem module `source`
    imports or reads as an attribute."""
    tree = ast.parse(source)
    found, modules = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hybridmem"):
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{where}:{node.lineno} {node.module}.{alias.name}")
                elif _is_module(f"{node.module}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("hybridmem.") and alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules and _private(node.attr)):
            found.append(f"{where}:{node.lineno} {modules[node.value.id]}.{node.attr}")
    return found


def test_no_module_reaches_another_modules_private_names():
    found = [hit for p in sorted(PACKAGE.rglob("*.py"))
             for hit in private_reaches(p.read_text(), str(p.relative_to(PACKAGE.parent)))]
    assert not found, "private names reached across modules:\n" + "\n".join(found)


def test_the_rule_catches_both_spellings():
    source = ("from hybridmem.models import light\n"
              "def f():\n"
              "    from hybridmem.allocator.reserved import _hidden, bounded\n"
              "    return light._text, light.TEXT_DEFAULTS, bounded.__name__\n")
    assert private_reaches(source, "x.py") == ["x.py:3 hybridmem.allocator.reserved._hidden",
                                              "x.py:4 hybridmem.models.light._text"]
