"""Which files an input names: a file, a folder (recursive), or a glob pattern (``**`` recurses).

Directory links are followed once: a directory reached a second time (a link loop, or two links to one
folder) is not walked again and is named in the expansion's notes, so no file is read twice and a loop
cannot multiply documents. A path that exists is always that path, never a pattern (``notes[1].txt``).
Folders to leave out (the output folder, its temporaries) are never walked.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

from components.data.text.compression import compression_of, inner_suffix

EMBEDDED = ("stdlib:code", "stdlib:docs")
FORMATS = ("auto", "text", "jsonl", "parquet")
_JSONL_SUFFIXES = (".jsonl", ".ndjson")


class InputError(ValueError):
    """An input that cannot be read as asked; the message names the file and what is wrong."""


@dataclass
class InputFile:
    path: Path
    name: str  # path below its input (the identity of a whole-file document)
    format: str  # text, jsonl or parquet


@dataclass
class Expansion:
    """What walking the inputs noticed besides the files: links not followed again, files named twice."""

    notes: list[str] = field(default_factory=list)
    seen_files: set[tuple[int, int]] = field(default_factory=set)  # (device, inode) of every file taken


def _has_glob(s: str) -> bool:
    return any(c in s for c in "*?[")


def format_of(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    suffix = inner_suffix(path)
    if suffix in _JSONL_SUFFIXES:
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    return "text"


def _identity(p: Path) -> tuple[int, int]:
    st = p.stat()
    return st.st_dev, st.st_ino


def _walk(
    root: Path, excluded: frozenset[str], expansion: Expansion, max_depth: Optional[int], hidden: bool
) -> Iterator[Path]:
    """Files below ``root``, directory links followed once; hidden names skipped unless ``hidden``."""
    visited: set[tuple[int, int]] = set()
    stack: list[tuple[Path, int]] = [(root, 0)]
    while stack:
        folder, depth = stack.pop()
        key = _identity(folder)
        if key in visited:
            expansion.notes.append(f"{folder}: a directory link back to a folder already read; not read again")
            continue
        visited.add(key)
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as err:
            raise InputError(f"{folder}: cannot list the folder ({err.strerror})") from None
        subfolders = []
        for entry in entries:
            if entry.name.startswith(".") and not hidden:
                continue
            path = Path(entry.path)
            if os.path.realpath(path) in excluded:
                continue
            try:
                is_dir = entry.is_dir()  # follows links
            except OSError:
                continue
            if is_dir:
                if max_depth is None or depth + 1 < max_depth:
                    subfolders.append((path, depth + 1))
            elif entry.is_file():
                yield path
        stack.extend(reversed(subfolders))


def _matches(parts: Sequence[str], patterns: Sequence[str]) -> bool:
    """``parts`` (a relative path) against glob ``patterns``, one per path segment, ``**`` any depth."""
    if not patterns:
        return not parts
    head, rest = patterns[0], patterns[1:]
    if head == "**":
        return any(_matches(parts[i:], rest) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], head) and _matches(parts[1:], rest)


def _take_once(paths: list[Path], expansion: Expansion) -> list[Path]:
    """``paths`` without files already taken (through another link or an earlier input)."""
    kept = []
    for p in paths:
        key = _identity(p)
        if key in expansion.seen_files:
            expansion.notes.append(f"{p}: the same file as one already read; not read again")
            continue
        expansion.seen_files.add(key)
        kept.append(p)
    return kept


def expand_input(
    pattern: str, fmt: str = "auto", exclude: Sequence[Path] = (), expansion: Optional[Expansion] = None
) -> list[InputFile] | str:
    """The files one input names (sorted), or the embedded source's name. InputError if it names nothing.

    ``exclude``: folders never walked (nor taken when named directly). ``expansion``: shared across the
    inputs of one preparation, so a file named by two inputs is read once."""
    if pattern in EMBEDDED:
        return pattern
    if pattern.startswith("stdlib:"):
        raise InputError(f"input '{pattern}': unknown embedded source; choose one of {', '.join(EMBEDDED)}")
    expansion = expansion if expansion is not None else Expansion()
    excluded = frozenset(os.path.realpath(p) for p in exclude)
    p = Path(pattern)
    if p.exists():
        if any(os.path.realpath(p) == e or os.path.realpath(p).startswith(e + os.sep) for e in excluded):
            raise InputError(f"input '{pattern}': it is the output folder (or inside it), which cannot be an input")
        if p.is_file():
            if p.stat().st_size == 0:
                raise InputError(f"input '{pattern}': the file is empty")
            base, paths = p.parent, [p]
        else:
            base = p
            paths = sorted(_walk(p, excluded, expansion, max_depth=None, hidden=False))
            if not paths:
                raise InputError(f"input '{pattern}': the folder holds no files")
    elif _has_glob(pattern):
        parts = p.parts
        fixed = next(i for i, part in enumerate(parts) if _has_glob(part))
        base = Path(*parts[:fixed]) if fixed else Path(".")
        patterns = parts[fixed:]
        depth = None if "**" in patterns else len(patterns)
        hidden = any(part.startswith(".") for part in patterns)
        paths = sorted(
            q
            for q in (_walk(base, excluded, expansion, depth, hidden) if base.is_dir() else ())
            if _matches(q.relative_to(base).parts, patterns)
        )
        if not paths:
            raise InputError(f"input '{pattern}': the pattern matches no files")
    else:
        raise InputError(f"input '{pattern}': no such file or folder")
    for q in paths:
        if format_of(q, fmt) == "parquet" and compression_of(q):
            raise InputError(f"{q}: a compressed Parquet file; Parquet compresses inside the file, decompress it first")
    return [
        InputFile(q, q.relative_to(base).as_posix() if q.is_relative_to(base) else q.as_posix(), format_of(q, fmt))
        for q in _take_once(paths, expansion)
    ]
