"""The package's imports form no circle, and the layers below the strategies import neither.

Every import counts, a function's own included (a late import is still an arrow between two
modules); only those under ``if TYPE_CHECKING:`` do not, since they never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import celery_caps

PACKAGE = Path(celery_caps.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports when it runs."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in modules else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {module for module in found if module in modules and module != name}


def _graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(path) for path in paths}
    return {_module_name(path): _imports(path, modules) for path in paths}


def _a_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports, if there is any (a depth-first search)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def search(module: str) -> list[str] | None:
        state[module] = "open"
        stack.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return [*stack[stack.index(imported) :], imported]
            if imported not in state:
                circle = search(imported)
                if circle:
                    return circle
        stack.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            circle = search(module)
            if circle:
                return circle
    return None


def test_the_package_has_no_import_circle() -> None:
    graph = _graph()
    assert "celery_caps.caps" in graph["celery_caps.task"]  # the reading works
    assert _a_circle(graph) is None, " -> ".join(_a_circle(graph) or [])


def test_the_layers_below_the_strategies_import_neither_strategy() -> None:
    graph = _graph()
    strategies = {"celery_caps.park", "celery_caps.backoff"}
    for below in ("celery_caps.messages", "celery_caps.handover", "celery_caps.runtime", "celery_caps.worker"):
        assert not graph[below] & strategies, f"{below} imports {sorted(graph[below] & strategies)}"
    assert "celery_caps.park" not in graph["celery_caps.backoff"]
    assert "celery_caps.backoff" not in graph["celery_caps.park"]


def test_the_stores_import_nothing_of_celery_nor_of_the_layers_above() -> None:
    for path in sorted((PACKAGE / "stores").rglob("*.py")):
        text = path.read_text()
        assert "import celery" not in text and "from celery" not in text, path
    graph = _graph()
    allowed = {"celery_caps.errors", "celery_caps.caps"}
    for module, imported in graph.items():
        if module.startswith("celery_caps.stores"):
            outside = {m for m in imported if not m.startswith("celery_caps.stores")} - allowed
            assert not outside, f"{module} imports {sorted(outside)}"
