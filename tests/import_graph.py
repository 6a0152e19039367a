"""sgrpo's import graph, drawn from the code: which room (subpackage) imports which, and the cycles if any.

A *room* is a subpackage of ``sgrpo`` (``sgrpo.rollout``, ``sgrpo.train``, ...), a top-level module of ``sgrpo``
(``sgrpo.fit``, ``sgrpo.types``, ...), or one of the companion packages ``tasks`` and ``estimators``. Every
``import`` statement counts, function-level ones included. ``python -m tests.import_graph`` prints the rooms in
dependency order (each after everything it imports), the block docs/architecture.md shows.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("sgrpo", "estimators", "tasks")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The project modules ``path`` imports (``from a.b import c`` counts ``a.b.c`` when that is a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def module_graph() -> dict[str, set[str]]:
    files = library_files()
    known = {module_name(p) for p in files}
    graph = {module_name(p): imported_modules(p, known) for p in files}
    for name, deps in graph.items():  # a package's __init__ is not an edge of its own modules
        deps.discard(name)
        deps -= {d for d in deps if name.startswith(d + ".")}
    return graph


def room(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "sgrpo":
        return parts[0]
    if len(parts) == 1:
        return "sgrpo"
    return ".".join(parts[:2])


def room_graph(graph: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = defaultdict(set)
    for module, deps in (graph or module_graph()).items():
        rooms[room(module)] |= {room(d) for d in deps} - {room(module)}
    return dict(rooms)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def layers(graph: dict[str, set[str]]) -> list[list[str]]:
    """Nodes by depth: layer 0 imports nothing of the project; layer k only nodes of layers below k."""
    depth: dict[str, int] = {}

    def of(node: str) -> int:
        if node not in depth:
            depth[node] = 0  # guards recursion on a cycle (which the tests refuse)
            depth[node] = 1 + max((of(d) for d in graph.get(node, ())), default=-1)
        return depth[node]

    for node in graph:
        of(node)
    out: list[list[str]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for node, d in depth.items():
        out[d].append(node)
    return [sorted(layer) for layer in out]


def drawing() -> str:
    """The rooms in dependency order, one line each: the room, then what it imports."""
    graph = room_graph()
    lines = []
    for level, layer in enumerate(layers(graph)):
        for node in layer:
            deps = ", ".join(sorted(graph[node])) or "(nothing of sgrpo's)"
            lines.append(f"{level}  {node:<18} imports {deps}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(drawing(), end="")
