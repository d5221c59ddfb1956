"""No import cycle among the ``components`` modules: each module can be imported on its own, at module top,
without leaning on a function-level import to break a loop. Imports inside functions count as edges too,
so a cycle hidden behind a lazy import is still found."""

from __future__ import annotations

from typing import Optional

from tests.import_graph import REPO, imports_of, module_name

COMPONENT_MODULES = sorted(module_name(p) for p in (REPO / "components").rglob("*.py"))
MODULE_SET = set(COMPONENT_MODULES)


def component_edges(name: str) -> list[str]:
    """The ``components`` modules ``name`` imports, itself excluded (``from . import x`` in a package)."""
    return sorted(m for m in imports_of(name) if m in MODULE_SET and m != name)


def find_cycle(graph: dict[str, list[str]]) -> Optional[list[str]]:
    """One cycle ``[a, b, ..., a]`` of ``graph`` (depth-first search), or None when it is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> Optional[list[str]]:
        state[node] = 1
        path.append(node)
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found is not None:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found is not None:
                return found
    return None


def test_no_cycle_among_component_modules():
    graph = {name: component_edges(name) for name in COMPONENT_MODULES}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle among components modules: " + " -> ".join(cycle)


def test_the_search_finds_a_cycle_when_there_is_one():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"], "d": []}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b"], "b": [], "c": ["a"]}) is None
    assert "components.model" in COMPONENT_MODULES and len(COMPONENT_MODULES) > 30
