"""The engine's modules import each other without cycles, and the kernels stay a leaf.

Every import statement counts, at module level or inside a function (a lazy import hides a
cycle from Python until the day the call order changes; it does not remove it), and so do
`if TYPE_CHECKING:` imports. An import of a package is an edge to its `__init__`; importing
a submodule is an edge to that submodule only (its package's `__init__` runs first, but a
package importing its own submodules is the normal, downward direction).
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterable
from pathlib import Path

ENGINE_ROOT = Path(__file__).resolve().parents[2] / "engine"   # the source root holding kvfleet/engine
PACKAGE = "kvfleet.engine"

Edges = dict[str, dict[str, str]]   # module -> {imported module: "file:line" of the first such import}


def module_files(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's __init__) of every module of `package` under `root`."""
    mods = {}
    for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return mods


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_pkg: bool,
                    known: Iterable[str]) -> list[str]:
    known = set(known)
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:   # relative: from the module's package, one level up per extra dot
        base = module.split(".") if is_pkg else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    # `from pkg import name`: the submodule pkg.name when there is one, else pkg itself
    return [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix for a in node.names]


def import_graph(root: Path, package: str) -> Edges:
    mods = module_files(root, package)
    graph: Edges = {m: {} for m in mods}
    for module, (path, is_pkg) in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported_names(node, module, is_pkg, mods):
                while name and name not in mods:   # `import a.b.c` of something inside a module
                    name = name.rpartition(".")[0]
                if name and name != module:
                    graph[module].setdefault(name, f"{path.relative_to(root)}:{node.lineno}")
    return graph


def cycles(graph: Edges) -> list[list[str]]:
    """One concrete cycle (a path back to its start) per strongly connected component of size > 1."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for comp in components:   # shortest way from the component's first module back to itself
        members, start = set(comp), comp[0]
        paths = {start: [start]}
        frontier = [start]
        cycle: list[str] = []
        while frontier and not cycle:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w == start:
                        cycle = paths[v] + [start]
                        break
                    if w in members and w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
                if cycle:
                    break
            frontier = nxt
        found.append(cycle)
    return found


def describe(graph: Edges, cycle: list[str]) -> str:
    return "\n".join(f"  {a} -> {b}  ({graph[a][b]})" for a, b in itertools.pairwise(cycle))


def test_engine_modules_import_each_other_without_cycles() -> None:
    graph = import_graph(ENGINE_ROOT, PACKAGE)
    assert len(graph) > 50 and "kvfleet.engine.model_runner" in graph   # the walk found the engine
    found = cycles(graph)
    assert not found, "import cycles among the engine's modules:\n" + "\n\n".join(describe(graph, c) for c in found)


def test_kernels_import_only_torch_triton_and_themselves() -> None:
    graph = import_graph(ENGINE_ROOT, PACKAGE)
    kernels = f"{PACKAGE}.kernels"
    outside = {(m, dep, where) for m, deps in graph.items() if m == kernels or m.startswith(kernels + ".")
               for dep, where in deps.items() if not (dep == kernels or dep.startswith(kernels + "."))}
    assert not outside, f"kernels import engine modules: {sorted(outside)}"


def test_the_check_finds_a_cycle_hidden_in_a_function(tmp_path: Path) -> None:
    """The test above can fail: a lazy import that closes a cycle is reported with where it is."""
    pkg = tmp_path / "toy"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from toy.sub import b\n")
    (pkg / "a.py").write_text("from toy.sub.b import thing\n")
    (pkg / "sub" / "b.py").write_text("def thing():\n    from .. import a\n    return a\n")
    (pkg / "c.py").write_text("import toy.a\nfrom . import sub\n")
    graph = import_graph(tmp_path, "toy")
    assert graph["toy.c"] == {"toy.a": "toy/c.py:1", "toy.sub": "toy/c.py:2"}
    assert cycles(graph) == [["toy.a", "toy.sub.b", "toy.a"]]
    assert "toy.sub.b -> toy.a  (toy/sub/b.py:2)" in describe(graph, cycles(graph)[0])
