"""The project's import graph read from the source: every ``import`` statement, including those inside
functions, so a lazy import deep in a function counts too (shared by the layer and cycle checks)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent


def module_file(name: str) -> Optional[Path]:
    """The source file of a project module (``a.b`` -> ``a/b.py`` or ``a/b/__init__.py``), or None."""
    base = REPO.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports_of(name: str) -> set[str]:
    """Every module ``name`` imports (absolute names; ``from a import b`` yields ``a`` and ``a.b``)."""
    path = module_file(name)
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out
