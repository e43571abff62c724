"""Field names of other libraries' config dataclasses, read from their installed source.

Why: the config readers sort every key of a user's file by what the file's own library accepts
(`config_keys`: TrainingArguments, LLaMA-Factory's Seq2SeqTrainingArguments, TRL's SFTConfig,
PEFT's config classes). Asking `dataclasses.fields` means importing transformers or peft, and
both import torch: seconds, many times the analytic answer itself. A dataclass's fields are
the annotated names of its class body and of its dataclass bases (`dataclasses._process_class`
collects each base's `__dataclass_fields__`, then the class's own `__annotations__`, leaving
out ClassVar, InitVar and the KW_ONLY marker), so they can be read from the source with `ast`,
which `importlib.util.find_spec` locates without importing a top-level package.

Where the source does not say (a class or base this reader cannot follow, a library not
installed), the answer is None and the caller imports the library as before. Against the
installed versions, tests/test_library_fields.py checks the reading equals `dataclasses.fields`.
"""

from __future__ import annotations

import ast
import importlib.util
from functools import lru_cache
from pathlib import Path

NOT_DATACLASSES: frozenset[str] = frozenset({"object", "ABC", "Generic", "PushToHubMixin"})
"""Bases known to hold no dataclass fields (plain classes, or transformers' hub mixin, a plain
class in `transformers/utils/hub.py`), which a class may name without this reader following
them into another package."""

_SKIPPED = ("ClassVar", "InitVar", "KW_ONLY")
_MAX_DEPTH = 8  # re-exports followed per base: a bound against import cycles


@lru_cache(maxsize=None)
def _package_dir(package: str) -> Path | None:
    """Folder of an installed top-level package; `find_spec` of a top-level name does not
    run its `__init__` (of a dotted name it would)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _module_file(module: str) -> Path | None:
    top, _, rest = module.partition(".")
    folder = _package_dir(top)
    if folder is None:
        return None
    base = folder.joinpath(*rest.split(".")) if rest else folder
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@lru_cache(maxsize=64)
def _tree(module: str) -> ast.Module | None:
    path = _module_file(module)
    if path is None:
        return None
    try:
        return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None


def _top_level(tree: ast.Module):
    """Module-level statements, including those under `if` / `try` (optional imports)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop(0)
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            stack[:0] = [*node.body, *getattr(node, "orelse", ()),
                         *(s for h in getattr(node, "handlers", ()) for s in h.body)]


def _absolute(module: str, level: int, target: str | None) -> str:
    """The absolute module a `from ...target import x` in `module` names."""
    if not level:
        return target or ""
    is_package = (_module_file(module) or Path()).name == "__init__.py"
    parts = module.split(".")
    keep = len(parts) - level + (1 if is_package else 0)
    base = ".".join(parts[:keep])
    return f"{base}.{target}" if target else base


def _find(module: str, name: str, depth: int = 0) -> tuple[str, ast.ClassDef] | None:
    """(module, class node) of class `name` as `module` defines or imports it."""
    tree = _tree(module)
    if tree is None or depth > _MAX_DEPTH:
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return module, node
    for node in _top_level(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    source = _absolute(module, node.level, node.module)
                    return _find(source, alias.name, depth + 1)
    return None


def _is_dataclass(node: ast.ClassDef) -> bool:
    for deco in node.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        if (isinstance(target, ast.Name) and target.id == "dataclass") or (
                isinstance(target, ast.Attribute) and target.attr == "dataclass"):
            return True
    return False


def _own_fields(node: ast.ClassDef) -> set[str]:
    out = set()
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            annotation = ast.unparse(stmt.annotation).strip("'\"")
            if not any(annotation.split("[")[0].split(".")[-1] == s for s in _SKIPPED):
                out.add(stmt.target.id)
    return out


def _fields(module: str, node: ast.ClassDef, hints: dict[str, tuple[str, str]],
            depth: int = 0) -> set[str] | None:
    if depth > _MAX_DEPTH:
        return None
    out: set[str] = set()
    for base in node.bases:
        name = base.id if isinstance(base, ast.Name) else (
            base.attr if isinstance(base, ast.Attribute) else None)
        if name in NOT_DATACLASSES:
            continue
        found = _find(*hints[name]) if name in hints else (
            _find(module, name) if isinstance(base, ast.Name) else None)
        if found is None:
            return None
        inherited = _fields(*found, hints, depth + 1)
        if inherited is None:
            return None
        out |= inherited
    if _is_dataclass(node):
        out |= _own_fields(node)
    return out


def class_fields(module: str, name: str,
                 hints: dict[str, tuple[str, str]] | None = None) -> frozenset[str] | None:
    """`{f.name for f in dataclasses.fields(module.name)}` read from the installed source, or
    None where it cannot be read (the class or a base not followed, not a dataclass, the
    package not installed). `hints`: base name -> (module, class) for a base imported from a
    package that re-exports it lazily (e.g. `from transformers import TrainingArguments`)."""
    found = _find(module, name)
    if found is None or not _is_dataclass(found[1]):
        return None
    fields = _fields(*found, hints or {})
    return None if fields is None else frozenset(fields)


def installed(package: str) -> bool:
    """Whether a top-level package is importable, without importing it."""
    return _package_dir(package) is not None


def peft_config_class(peft_type: str) -> tuple[str, str] | None:
    """(module, class) PEFT registers for `peft_type` (e.g. LORA -> peft.tuners.lora.config,
    LoraConfig): each tuner package's `register_peft_method(name=..., config_cls=...)`
    (peft/utils/peft_types.py), read from source; None if not found."""
    folder = _package_dir("peft")
    if folder is None:
        return None
    want = str(peft_type).lower()
    for init in sorted((folder / "tuners").glob("*/__init__.py")):
        module = f"peft.tuners.{init.parent.name}"
        tree = _tree(module)
        for node in ast.walk(tree) if tree is not None else ():
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(
                    node.func, "attr", None)) == "register_peft_method"):
                continue
            kw = {k.arg: k.value for k in node.keywords}
            name, cls = kw.get("name"), kw.get("config_cls")
            if (isinstance(name, ast.Constant) and str(name.value).lower() == want
                    and isinstance(cls, ast.Name)):
                found = _find(module, cls.id)
                return None if found is None else (found[0], cls.id)
    return None
