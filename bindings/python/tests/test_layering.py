"""The package's modules import each other without a cycle (function-level imports included):
core <- numpy, ep, dlpack; torch <- distributed; nothing imports back up."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "moeblaze"


def imports_of(path: Path) -> set:
    """The package modules `path` imports anywhere in its body ("torch" for `from .torch ...`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and \
                node.module.startswith("moeblaze."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names
                         if a.name.startswith("moeblaze."))
    return found


def test_no_import_cycle():
    modules = {p.stem: p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    graph = {name: imports_of(path) & set(modules) for name, path in modules.items()}
    # Depth-first search for a back edge.
    state = {}

    def visit(name, stack):
        state[name] = "open"
        for other in sorted(graph[name]):
            assert state.get(other) != "open", \
                f"import cycle: {' -> '.join(stack + [name, other])}"
            if other not in state:
                visit(other, stack + [name])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert "distributed" not in graph.get("torch", set())
