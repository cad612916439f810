"""Imports point one way (docs/design.md §1): server.cli -> server.api / server.bench -> engine, and nothing in
`engine` or `kernels_fake` imports `server`. Read from the source with ast, so imports inside functions (the lazy
ones that keep torch out of `ember bench`) count too, and no module is imported to check."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("server", "engine", "kernels_fake")

# Which top-level layers each layer may import (besides itself). A layer is the longest matching prefix.
ALLOWED: dict[str, set[str]] = {
    "server.cli": {"server.api", "server.bench", "engine", "kernels_fake"},
    "server.api": {"engine", "kernels_fake"},
    "server.bench": {"engine", "kernels_fake"},
    "server": set(),  # server/__init__.py: a docstring
    "engine": {"kernels_fake"},
    "kernels_fake": {"engine"},  # fake kernels register against the ops they stand in for
}


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = f
    return mods


def _resolve(module: str, level: int, importer: str, is_package: bool) -> str:
    if level == 0:
        return module
    base = importer.split(".")
    if not is_package:
        base.pop()
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its source (`from pkg import mod` names the module)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node.module or "", node.level, name, path.name == "__init__.py")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods:  # `import a.b.c` of a project module, or a name inside a module
                    t = t.rpartition(".")[0]
                if t and t != name:
                    graph[name].add(t)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, list[str]]] = [(root, sorted(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, todo = work[-1]
            if todo:
                w = todo.pop()
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, sorted(graph[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component: list[str] = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def _layer(module: str) -> str:
    return max((layer for layer in ALLOWED if module == layer or module.startswith(layer + ".")), key=len)


def test_no_import_cycles() -> None:
    assert find_cycles(import_graph()) == []


def test_imports_point_one_way() -> None:
    wrong = sorted(f"{m} -> {t}" for m, targets in import_graph().items() for t in targets
                   if _layer(t) != _layer(m) and _layer(t) not in ALLOWED[_layer(m)])
    assert wrong == []


def test_the_checks_see_a_cycle_and_the_real_edges() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = import_graph()
    assert "server.api.app" in graph["server.cli.serve"]  # a lazy import inside a function counts
    assert "server.api.routes_native" in graph["server.api.app"]  # `from server.api import routes_native`
    assert "engine.config" in graph["server.bench.engine"]
