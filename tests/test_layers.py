"""The package's layers (`[tool.importlinter]` in pyproject.toml) hold, and no two modules import
each other, directly or through others (docs/design.md, "Layers").

Both checks read the import graph grimp builds from the source: every import counts, module
level or inside a function, except those under `if TYPE_CHECKING:` (they never run).
"""

from __future__ import annotations

import pkgutil
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli, a dependency of import-linter
    import tomli as tomllib

import grimp
import importlinter.api  # noqa: F401  (import-linter's settings: graph builder, file readers)
from importlinter.application import output, use_cases

import hybridmem

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "hybridmem"
OUTSIDE_LAYERS = {"hybridmem.__init__", "hybridmem.__main__"}
"""The package's entry points: they import from every layer and nothing imports them."""

def _config() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["importlinter"]


def test_import_contracts_hold():
    """lint-imports on pyproject.toml's contracts; its report is the failure message."""
    with output.console.capture() as captured:
        passed = use_cases.lint_imports(config_filename=str(ROOT / "pyproject.toml"),
                                        cache_dir=None, no_logo=True)
    assert passed, "import-linter contracts broken:\n" + captured.get()


def test_every_top_level_module_is_in_a_layer():
    """A new top-level module or subpackage must be placed in a layer, or nothing checks it."""
    named = set()
    for contract in _config()["contracts"]:
        for layer in contract.get("layers", []):
            named |= {m.strip() for m in layer.replace("|", ":").split(":")}
    found = {f"{PACKAGE}.{m.name}" for m in pkgutil.iter_modules(hybridmem.__path__)}
    missing = found - named - OUTSIDE_LAYERS
    assert not missing, f"modules in no layer of [tool.importlinter]: {sorted(missing)}"


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (iterative: no
    recursion limit), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_strongly_connected_finds_a_cycle_and_ignores_a_chain():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert strongly_connected(edges) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_no_module_cycles():
    graph = grimp.build_graph(PACKAGE, exclude_type_checking_imports=True, cache_dir=None)
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    found = strongly_connected(edges)
    lines = []
    for comp in found:
        lines.append(" <-> ".join(comp))
        for a in comp:
            for b in sorted(edges[a] & set(comp)):
                where = sorted(d["line_number"] for d in
                               graph.get_import_details(importer=a, imported=b))
                lines.append(f"    {a} -> {b} (l.{', l.'.join(map(str, where))})")
    assert not lines, "module import cycles:\n" + "\n".join(lines)


def _by_name_edges(graph) -> dict[str, set[str]]:
    """Module -> the modules it loads by a "package.module:function" string (a lookup the
    import graph cannot see), for every such string constant in the package's source."""
    import ast
    import re

    target = re.compile(rf"^({PACKAGE}(?:\.\w+)+):\w+$")
    out: dict[str, set[str]] = {}
    for module in graph.modules:
        path = ROOT / (module.replace(".", "/") + ".py")
        if not path.exists():
            path = ROOT / module.replace(".", "/") / "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found = target.match(node.value)
                if found and found.group(1) in graph.modules:
                    out.setdefault(module, set()).add(found.group(1))
    return out


def test_no_tier_is_looked_up_by_name():
    """The tiers are imported (`hybridmem.tiers`) and the learned one registers itself from
    above (`learned/tier.py`): no "package.module:function" string loads a module the import
    graph would not see (a lookup once hid the learned tier's cycle through `predict`)."""
    graph = grimp.build_graph(PACKAGE, exclude_type_checking_imports=True, cache_dir=None)
    # a module naming its own class (the harness's default probe, sent to the child) is no lookup
    across = {m: targets - {m} for m, targets in _by_name_edges(graph).items() if targets - {m}}
    assert across == {}


def test_by_name_edges_finds_a_lookup(tmp_path, monkeypatch):
    """The check above can fail: a string naming a module's function is found."""
    class Graph:
        modules = {"hybridmem.predict", "hybridmem.learned.predictor"}

    monkeypatch.setitem(globals(), "ROOT", tmp_path)  # `_by_name_edges` reads the sources there
    (tmp_path / "hybridmem").mkdir()
    (tmp_path / "hybridmem" / "predict.py").write_text('X = "hybridmem.learned.predictor:estimate"\n')
    (tmp_path / "hybridmem" / "learned").mkdir()
    (tmp_path / "hybridmem" / "learned" / "predictor.py").write_text("")
    assert _by_name_edges(Graph()) == {"hybridmem.predict": {"hybridmem.learned.predictor"}}


def family_folders() -> list[str]:
    """The family folders (`hybridmem/families/<family>/`, each a package declaring
    `FAMILIES`); `common/` is what they share."""
    import hybridmem.families as fam

    return [f"{fam.__name__}.{m.name}" for m in pkgutil.iter_modules(fam.__path__)
            if m.ispkg and m.name != "common"]


def test_no_family_folder_imports_another():
    """A family is its folder: it shares `families/common/` and the registry, never another
    family's modules (an independence contract over the folders found, so a new family needs
    no pyproject.toml edit); nor does `common/` import a family."""
    graph = grimp.build_graph(PACKAGE, exclude_type_checking_imports=True, cache_dir=None)
    folders = family_folders()
    assert len(folders) >= 8, folders  # the check would check nothing
    found = [f"{a} -> {b}" for a in [*folders, "hybridmem.families.common"] for b in folders
             if a != b and graph.chain_exists(importer=a, imported=b, as_packages=True)]
    assert not found, "family folders importing each other:\n" + "\n".join(found)
