"""The two layers: the model side (``components``) never imports the runtime (``runtime``) or the
training framework, directly or through any chain of project modules.

The import graph is read from the source (every ``import`` statement, including those inside
functions), not from what happens to be loaded, so a lazy import deep in a function counts too.
"""

from __future__ import annotations

from typing import Optional

import pytest

from tests.helpers import REPO
from tests.import_graph import imports_of, module_file, module_name

MODEL_SIDE = "components"
# what the model side may not reach: the runtime package, and the libraries only the runtime uses
FORBIDDEN = ("runtime", "lightning", "wandb", "train")
PROJECT_PACKAGES = ("components", "runtime", "analysis", "sweeps", "benchmarks", "train")


def forbidden_chain(start: str) -> Optional[list[str]]:
    """The first import chain from ``start`` to a forbidden module, walking project modules; None if none."""
    parents: dict[str, Optional[str]] = {start: None}
    queue = [start]
    while queue:
        current = queue.pop(0)
        for imported in sorted(imports_of(current)):
            top = imported.split(".")[0]
            if top in FORBIDDEN:
                chain = [imported, current]
                while parents[chain[-1]] is not None:
                    chain.append(parents[chain[-1]])
                return chain[::-1]
            if top in PROJECT_PACKAGES and imported not in parents and module_file(imported) is not None:
                parents[imported] = current
                queue.append(imported)
    return None


MODEL_MODULES = sorted(module_name(p) for p in (REPO / MODEL_SIDE).rglob("*.py"))


def test_every_model_module_is_checked():
    assert "components.model" in MODEL_MODULES and "components.mixers.kda" in MODEL_MODULES
    assert len(MODEL_MODULES) > 30


@pytest.mark.parametrize("module", MODEL_MODULES)
def test_model_side_never_reaches_the_runtime(module):
    chain = forbidden_chain(module)
    assert chain is None, "model side imports the runtime: " + " -> ".join(chain)


def test_the_walk_finds_a_runtime_import_when_there_is_one():
    """The checker itself: the runtime's own modules reach lightning, and a chain through a lazy import
    inside a function is found."""
    assert forbidden_chain("runtime.training_run") is not None
    chain = forbidden_chain("analysis.model_report")  # imports runtime.compose at module level
    assert chain is not None and chain[0] == "analysis.model_report" and chain[-1].split(".")[0] in FORBIDDEN
