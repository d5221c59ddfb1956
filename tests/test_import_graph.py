"""No import cycle anywhere in the project (components, runtime, analysis, sweeps, benchmarks, train.py,
prepare.py): each module can be imported on its own, at module top, without leaning on a function-level
import to break a loop. Imports inside functions count as edges too, so a cycle hidden behind a lazy import
is still found."""

from __future__ import annotations

from typing import Optional

from tests.import_graph import REPO, imports_of, module_name

PACKAGES = ("components", "runtime", "analysis", "sweeps", "benchmarks")
SCRIPTS = ("train.py", "prepare.py")
PROJECT_MODULES = sorted(
    [module_name(p) for package in PACKAGES for p in (REPO / package).rglob("*.py")]
    + [module_name(REPO / script) for script in SCRIPTS]
)
MODULE_SET = set(PROJECT_MODULES)


def project_edges(name: str, modules: set[str] = MODULE_SET) -> list[str]:
    """The project modules ``name`` imports, itself excluded (``from . import x`` in a package)."""
    return sorted(m for m in imports_of(name) if m in modules and m != name)


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


def project_graph() -> dict[str, list[str]]:
    return {name: project_edges(name) for name in PROJECT_MODULES}


def test_no_import_cycle_in_the_project():
    cycle = find_cycle(project_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_walk_covers_every_package():
    for package in (*PACKAGES, "train", "prepare"):
        assert any(m == package or m.startswith(f"{package}.") for m in PROJECT_MODULES), package
    assert {"components.model", "runtime.training_run", "runtime.train_command", "analysis.compare"} <= MODULE_SET


def test_the_search_finds_a_cycle_when_there_is_one():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"], "d": []}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b"], "b": [], "c": ["a"]}) is None


def test_a_planted_cycle_through_a_function_level_import_is_found(tmp_path, monkeypatch):
    """A lazy import planted in a real module (runtime.validation importing the command line, which imports
    it back) closes a cycle the walk must report."""
    import tests.import_graph as import_graph

    planted = tmp_path / "runtime" / "validation.py"
    planted.parent.mkdir()
    source = (REPO / "runtime" / "validation.py").read_text()
    planted.write_text(source + "\n\ndef _planted():\n    from runtime.train_command import main  # noqa\n")
    real_module_file = import_graph.module_file
    monkeypatch.setattr(
        import_graph,
        "module_file",
        lambda name: planted if name == "runtime.validation" else real_module_file(name),
    )
    cycle = find_cycle(project_graph())
    assert cycle is not None and "runtime.validation" in cycle and "runtime.train_command" in cycle
