"""``@eager_island`` and ``@compile_constant``: TorchDynamo markers applied without importing TorchDynamo
when the model is imported.

Some model code must run eagerly even inside a compiled layer (data-dependent sizes, host reads,
per-step Python state). ``torch.compiler.disable`` marks such code, but applying it imports
``torch._dynamo``, about half of the model's import time, in every process: analysis tools, the
command line's ``--help`` and uncompiled runs included. An island is therefore left as the plain
function until TorchDynamo is imported (``torch.compile`` imports it before it traces anything); at that
moment every island is replaced, under the same module or class attribute, by its disabled form. Nothing
can be compiled before then, so both forms behave alike wherever they are called.

Islands are looked up by name when they are called (a module global, a class attribute), which is how
the model code calls them; the replacement checks that the attribute still holds the function it marked.

``@compile_constant`` marks a function of plain Python values (strings, numbers) whose result never
changes in a process, as ``torch.compiler.assume_constant_result``: TorchDynamo calls it while tracing
and puts its result into the graph as a constant, instead of tracing its body (which may import modules
or read caches, both of which break a graph). The kernel back-end decision (``components/ops/backend.py``)
is one. The mark is set in place once TorchDynamo is imported, like an island's.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any, Callable

import torch

_DYNAMO = "torch._dynamo"
# (function, recursive) of every island not yet replaced by its disabled form
_pending: list[tuple[Callable[..., Any], bool]] = []
# every compile_constant function not yet marked
_pending_constants: list[Callable[..., Any]] = []


def eager_island(fn: Callable[..., Any] | None = None, *, recursive: bool = True) -> Any:
    """Mark ``fn`` (a module-level function or a method, used as a decorator) to run eagerly inside
    compiled code, as ``torch.compiler.disable(fn, recursive=recursive)``."""

    def mark(f: Callable[..., Any]) -> Callable[..., Any]:
        if _DYNAMO in sys.modules:
            return torch.compiler.disable(f, recursive=recursive)
        _pending.append((f, recursive))
        _watch_for_dynamo()
        return f

    return mark if fn is None else mark(fn)


def compile_constant(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` (a decorator) as ``torch.compiler.assume_constant_result``: inside compiled code its
    result is a constant of the graph. Only for functions of constants whose result is fixed per process."""
    if _DYNAMO in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    _pending_constants.append(fn)
    _watch_for_dynamo()
    return fn


def _owner_and_name(fn: Callable[..., Any]) -> tuple[Any, str]:
    """The object whose attribute holds ``fn`` (its module, or the class of a method) and the name."""
    *path, name = fn.__qualname__.split(".")
    owner: Any = sys.modules[fn.__module__]
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _replace_pending() -> None:
    while _pending:
        fn, recursive = _pending.pop()
        owner, name = _owner_and_name(fn)
        if owner.__dict__.get(name) is not fn:
            raise RuntimeError(
                f"@eager_island {fn.__module__}.{fn.__qualname__} is no longer the attribute it was defined "
                "as, so it cannot be replaced by its torch.compiler.disable form; apply the decorator outermost"
            )
        setattr(owner, name, torch.compiler.disable(fn, recursive=recursive))
    while _pending_constants:
        torch.compiler.assume_constant_result(_pending_constants.pop())  # marks the function in place


class _DynamoImportWatch(importlib.abc.MetaPathFinder):
    """Finds ``torch._dynamo`` the usual way and runs ``_replace_pending`` once its module has executed."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != _DYNAMO:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_replace(module: Any) -> None:
            exec_module(module)
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _DynamoImportWatch)]
            _replace_pending()

        loader.exec_module = exec_then_replace  # type: ignore[method-assign]
        return spec


def _watch_for_dynamo() -> None:
    if not any(isinstance(f, _DynamoImportWatch) for f in sys.meta_path):
        sys.meta_path.insert(0, _DynamoImportWatch())
