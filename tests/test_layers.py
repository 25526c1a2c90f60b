"""The layers import only downward, and no modules import each other in a circle.

Read from the source (``ast``), not by importing it: an import inside a
function counts for the layers, and an import under ``TYPE_CHECKING`` counts
for the circles, since both are the modules' text a reader follows.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import headgate

PACKAGE = Path(headgate.__file__).parent

#: What each layer may not import (DESIGN.md's layers; README's Layout).
FORBIDDEN: dict[str, set[str]] = {
    "protocol": {"asyncio", "socket", "time", "headgate.log", "headgate.gateway", "headgate.client"}
    | {"headgate.spark", "headgate.cli"},
    "log": {"headgate.gateway", "headgate.client", "headgate.spark", "headgate.cli"},
    "gateway": {"headgate.client", "headgate.spark", "headgate.cli"},
    "client": {"headgate.gateway", "headgate.spark", "headgate.cli"},
}


def module_name(path: Path) -> str:
    parts = ["headgate", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(path: Path, *, everywhere: bool) -> set[str]:
    """The modules ``path`` imports: at its top level (and under TYPE_CHECKING), or anywhere."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = ast.walk(tree) if everywhere else iter(top_level(tree.body))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            submodules = {f"{node.module}.{a.name}" for a in node.names} & MODULES.keys()
            found.update(submodules)
            if len(submodules) < len(node.names):
                found.add(node.module)
    return found


def top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements run when the module is imported (and its TYPE_CHECKING block)."""
    statements: list[ast.stmt] = []
    for node in body:
        statements.append(node)
        if isinstance(node, ast.If | ast.Try):
            statements += top_level(node.body) + top_level(node.orelse)
            for handler in getattr(node, "handlers", []):
                statements += top_level(handler.body)
    return statements


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_imports_nothing_above_it(layer: str) -> None:
    wrong = {
        (name, target)
        for name, path in MODULES.items()
        if name.startswith(f"headgate.{layer}.") or name == f"headgate.{layer}"
        for target in imported(path, everywhere=True)
        if any(target == f or target.startswith(f + ".") for f in FORBIDDEN[layer])
    }
    assert not wrong, sorted(wrong)


def test_no_modules_import_each_other_in_a_circle() -> None:
    graph = {
        name: {t for t in imported(path, everywhere=False) if t in MODULES and t != name}
        for name, path in MODULES.items()
    }
    # A package imports its own modules; its modules importing a name from
    # the package (not a module of it) is the one way back, and none does.
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    path: list[str] = []

    def walk(name: str) -> None:
        state[name] = 1
        path.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                walk(target)
        path.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name)
    assert not circles, circles
    assert len(graph) > 50 and graph["headgate.gateway.server"], "the graph was read"
