"""Every import inside a function (or method) of the project says on its line why it is not at module top:
``# start-up time: ...`` (a heavy import kept off a path that must start quickly), ``# optional: ...``
(an extra of pyproject.toml, or a package the project never requires) or ``# GPU-only: ...`` (triton, fla).
Avoiding an import cycle is no reason: there is none (tests/test_import_graph.py)."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

from tests.import_graph import REPO, module_file
from tests.test_import_graph import PROJECT_MODULES

REASONS = ("start-up time:", "optional:", "GPU-only:")


def comments_by_line(source: str) -> dict[int, str]:
    """``{line: comment text}`` of every comment in ``source``."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {tok.start[0]: tok.string for tok in tokens if tok.type == tokenize.COMMENT}


def states_a_reason(comment: str) -> bool:
    """Whether a comment (possibly two, ``# why  # noqa: F401``) opens with one of the accepted reasons."""
    return any(part.strip().startswith(REASONS) for part in comment.split("#"))


def unmarked_imports(source: str, filename: str = "<source>") -> list[int]:
    """Lines of the imports inside functions of ``source`` whose statement carries no reason comment."""
    comments = comments_by_line(source)
    found: list[int] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function:
                lines = range(child.lineno, (child.end_lineno or child.lineno) + 1)
                if not any(states_a_reason(comments.get(line, "")) for line in lines):
                    found.append(child.lineno)
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, inner)

    visit(ast.parse(source, filename=filename), False)
    return sorted(found)


def project_files() -> list[Path]:
    return sorted(module_file(name) for name in PROJECT_MODULES)


def unmarked_in(files: list[Path]) -> list[str]:
    """``path:line: statement`` of every unmarked function-level import in ``files``."""
    out = []
    for path in files:
        source = path.read_text()
        lines = source.splitlines()
        rel = path.relative_to(REPO).as_posix()
        out.extend(f"{rel}:{n}: {lines[n - 1].strip()}" for n in unmarked_imports(source, str(path)))
    return out


def test_every_function_level_import_says_why():
    unmarked = unmarked_in(project_files())
    assert not unmarked, (
        "imports inside functions with no reason on their line (move them to module top, or end the line "
        f"with one of {', '.join('# ' + r for r in REASONS)} ...):\n" + "\n".join(unmarked)
    )


def test_the_walk_covers_the_project():
    rel = {p.relative_to(REPO).as_posix() for p in project_files()}
    assert {"train.py", "prepare.py", "components/model.py", "runtime/train_command.py", "analysis/compare.py"} <= rel
    assert any(r.startswith("sweeps/") for r in rel) and any(r.startswith("benchmarks/") for r in rel)


PLANTED = """\
import os  # module top: never reported


def plain():
    import json
    return json


def marked():
    import lm_eval  # optional: the eval extra
    from triton import jit  # GPU-only: triton
    import wandb  # start-up time: wandb, only once W&B is used
    return lm_eval, jit, wandb


def comment_on_another_line():
    # start-up time: the reason one line above does not count
    import scipy
    return scipy


def lint_comment_only():
    import wandb_workspaces  # noqa: F401


def lint_comment_after_a_reason():
    import wandb_workspaces  # optional: the wandb-workspaces extra  # noqa: F401


def wrapped():
    from collections import (  # start-up time: a reason on the statement's first line
        OrderedDict,
    )
    from itertools import (
        chain,
    )
    return OrderedDict, chain


class Holder:
    import math  # a class body is not a function

    def method(self):
        def nested():
            import csv
            return csv
        return nested
"""


def test_the_walker_finds_unmarked_imports_in_a_planted_source():
    lines = PLANTED.splitlines()
    expected = {
        lines.index("    import json") + 1,
        lines.index("    import scipy") + 1,
        lines.index("    import wandb_workspaces  # noqa: F401") + 1,
        lines.index("    from itertools import (") + 1,
        lines.index("            import csv") + 1,
    }
    assert unmarked_imports(PLANTED) == sorted(expected)


def test_an_unmarked_import_planted_in_a_real_module_is_named_with_its_line(tmp_path, monkeypatch):
    import tests.test_function_level_imports as this

    real = REPO / "runtime" / "cli.py"
    assert unmarked_in([real]) == []  # the module as it is: every function-level import says why
    planted = tmp_path / "runtime" / "cli.py"
    planted.parent.mkdir()
    source = real.read_text() + "\n\ndef planted_helper():\n    import json\n\n    return json\n"
    planted.write_text(source)
    monkeypatch.setattr(this, "REPO", tmp_path)
    line = source.splitlines().index("    import json") + 1
    assert unmarked_in([planted]) == [f"runtime/cli.py:{line}: import json"]
