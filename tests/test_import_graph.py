"""The package's import graph: data flows one way, so imports do too.

``carry/`` (the pipeline) never imports ``verify/`` (which checks what the
pipeline made: the rebase gate is passed in by the CLI), ``util/`` imports
neither, and no module imports itself back through others. Read from the
source with ``ast``, function-level imports included, so a lazy import counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "patchkit"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """Module -> the patchkit modules it imports (a name imported from a package that
    is itself a module counts as that module)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    here = here[: len(here) - node.level + 1]
                    base = ".".join([*here, base] if base else here)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in files:
                        edges.add(full)
                    elif base in files:
                        edges.add(base)
        graph[name] = edges - {name}
    return graph


GRAPH = _graph()


def test_the_graph_sees_the_package() -> None:
    # Control: known edges are found, or the checks below would pass on nothing.
    assert "patchkit.carry.render" in GRAPH["patchkit.carry.apply"]
    assert "patchkit.carry.rebase" in GRAPH["patchkit.verify.rebase_gate"]
    assert "patchkit.verify.emulate.extract" in GRAPH["patchkit.verify.emulate"]


@pytest.mark.parametrize(
    ("lower", "upper"),
    [
        ("patchkit.carry", "patchkit.verify"),  # the pipeline does not call its checker
        ("patchkit.util", "patchkit.carry"),  # util knows nothing of patchkit's steps
        ("patchkit.util", "patchkit.verify"),
        ("patchkit.carry", "patchkit.cli"),  # only the CLI talks to the terminal
        ("patchkit.verify", "patchkit.cli"),
    ],
)
def test_no_upward_import(lower: str, upper: str) -> None:
    upward = sorted(
        f"{m} -> {d}"
        for m, deps in GRAPH.items()
        if m.startswith(lower)
        for d in deps
        if d == upper or d.startswith(upper + ".")
    )
    assert upward == []


def test_no_cycle() -> None:
    done: set[str] = set()
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycles.append(" -> ".join([*path[path.index(module) :], module]))
            return
        if module in done:
            return
        for dep in sorted(GRAPH[module]):
            visit(dep, [*path, module])
        done.add(module)

    for module in sorted(GRAPH):
        visit(module, [])
    assert cycles == []
