"""``@eager_island`` / ``@compile_constant``: the model imports without TorchDynamo, and every island is
``torch.compiler.disable``'d (every constant marked ``torch.compiler.assume_constant_result``) once TorchDynamo
is imported, whichever comes first."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO

# every island of the model code, as (module, attribute path)
ISLANDS = [
    ("components.nn.segments", "Segments.cu_seqlens"),
    ("components.nn.segments", "Segments.packing"),
    ("components.ffn.experts", "_capacity_route_plan"),
    ("components.ffn.experts", "_gmm_island"),
    ("components.ffn.experts", "_padded_bmm_island"),
    ("components.ffn.router", "Router._record"),
    ("components.ops.kda", "_chunk_kda_apply"),
]
# every compile_constant of the model code
CONSTANTS = [("components.ops.backend", "_decide")]

CHECK = """
import importlib, sys
{first}
{second}
missing = []
for module, path in {islands!r}:
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    if not getattr(obj, "_torchdynamo_disable", False):
        missing.append(module + "." + path)
for module, path in {constants!r}:
    obj = getattr(importlib.import_module(module), path)
    if not getattr(obj, "_dynamo_marked_constant", False):  # what assume_constant_result sets
        missing.append(module + "." + path)
print("missing:", missing)
"""


def _python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_importing_the_model_does_not_import_dynamo():
    out = _python("import sys, components.model, components.catalog; print('torch._dynamo' in sys.modules)")
    assert out.strip() == "False"


@pytest.mark.parametrize("model_first", [True, False], ids=["model-then-dynamo", "dynamo-then-model"])
def test_every_island_is_disabled_once_dynamo_is_imported(model_first):
    imports = ["import components.model, components.ffn.moe, components.mixers.kda", "import torch._dynamo"]
    first, second = imports if model_first else imports[::-1]
    out = _python(CHECK.format(first=first, second=second, islands=ISLANDS, constants=CONSTANTS))
    assert out.strip() == "missing: []"


def test_an_island_runs_eagerly_inside_a_compiled_function():
    import torch
    import torch._dynamo

    from components.nn.segments import Segments

    def count_documents(x: torch.Tensor) -> torch.Tensor:
        segments = Segments.from_eod(x, 0)
        return segments.cu_seqlens().float().sum() * 2  # data-dependent size inside

    x = torch.tensor([[5, 0, 3, 4, 0, 2], [1, 2, 0, 0, 3, 3]])
    explained = torch._dynamo.explain(count_documents)(x)
    assert explained.break_reasons  # the graph ends at the island, which runs eagerly
    assert not any("nonzero" in graph.code for graph in explained.graphs)
    assert torch.compile(count_documents, backend="eager")(x) == count_documents(x)


def test_a_constant_is_called_once_while_tracing_and_never_traced():
    import importlib

    import torch
    import torch._dynamo

    from components.nn.eager_island import compile_constant

    calls = []

    @compile_constant
    def imports(name: str) -> bool:
        calls.append(name)
        importlib.import_module(name)  # TorchDynamo refuses to trace this
        return True

    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2 if imports("json") else x

    explained = torch._dynamo.explain(f)(torch.ones(3))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    assert calls == ["json"]


def test_an_island_under_another_decorator_is_refused_when_replaced():
    code = """
import functools
from components.nn import eager_island as e

def wrap(f):
    @functools.wraps(f)
    def g(*a):
        return f(*a)
    return g

class Holder:
    @wrap
    @e.eager_island
    def method(self):
        return 1

import __main__
try:
    import torch._dynamo
except RuntimeError as err:
    print("refused:", "apply the decorator outermost" in str(err))
else:
    print("accepted")
"""
    assert _python(code).strip() == "refused: True"
