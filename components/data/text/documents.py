"""Documents from inputs: text files, folders and glob patterns of them, JSONL, Parquet, and the two
embedded sources of this Python (``stdlib:code``, ``stdlib:docs``).

Each document has an identity, a stable name (a file's path below its input, ``file#line`` for a
JSONL record, or the value of a named id field); the validation split is a hash of it, so adding
files never moves a document between splits. Text is UTF-8: undecodable bytes become U+FFFD and are
counted; binary files (a NUL byte near the start) among text files are skipped and counted, or refused.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from pydoc_data.topics import topics
from typing import Iterator, Optional

from components.data.stdlib_sources import is_validation, stdlib_fingerprint, stdlib_root, stdlib_sources
from components.data.text.compression import CompressionError, iter_input_lines, read_input_bytes
from components.data.text.input_files import InputError, InputFile

BINARY_POLICIES = ("skip", "error")
_SNIFF = 8192  # bytes looked at for a NUL when deciding a file is binary
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass
class Document:
    identity: str
    text: str


@dataclass
class ReadOptions:
    format: str = "auto"
    text_field: str = "text"  # JSONL field / Parquet column holding the text
    id_field: Optional[str] = None  # JSONL field / Parquet column naming each document (None: file and line)
    binary: str = "skip"


@dataclass
class ReadStats:
    documents: int = 0
    empty_documents: int = 0
    binary_files: list[str] = field(default_factory=list)
    replaced_characters: int = 0
    # per input: files, documents, empty documents and binary files skipped (why an input gave nothing)
    per_input: dict[str, dict[str, int]] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "documents": self.documents,
            "empty_documents": self.empty_documents,
            "binary_files_skipped": len(self.binary_files),
            "replaced_characters": self.replaced_characters,
        }


def fingerprint_inputs(inputs: list[list[InputFile] | str]) -> str:
    """A hash of every input's name and content (embedded sources: this Python and its file sizes)."""
    h = hashlib.sha256()
    for item in inputs:
        if isinstance(item, str):
            root = stdlib_root()
            h.update(json.dumps([item, stdlib_fingerprint(root, stdlib_sources(root))]).encode())
            continue
        for f in item:
            h.update(f.name.encode() + b"\0" + f.format.encode() + b"\0")
            with open(f.path, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
            h.update(b"\1")
    return h.hexdigest()[:16]


def decode_utf8(data: bytes, stats: ReadStats) -> str:
    """UTF-8 text of ``data``; undecodable bytes become U+FFFD, counted in ``stats``."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        stats.replaced_characters += text.count("\ufffd") - data.count("\ufffd".encode())
        return text


def clean_text(text: str, stats: ReadStats) -> str:
    """``text`` as encodable UTF-8: each lone surrogate (possible in JSON strings) becomes one U+FFFD,
    counted once."""
    cleaned, replaced = _SURROGATE.subn("\ufffd", text)
    stats.replaced_characters += replaced
    return cleaned


def _read_text_file(f: InputFile, opts: ReadOptions, stats: ReadStats) -> Iterator[Document]:
    try:
        data = read_input_bytes(f.path)
    except CompressionError as err:
        raise InputError(str(err)) from None
    if b"\0" in data[:_SNIFF]:
        if opts.binary == "error":
            raise InputError(
                f"{f.path}: a binary file (NUL bytes) among the text inputs; remove it or pass --binary skip"
            )
        stats.binary_files.append(str(f.path))
        return
    yield Document(f.name, decode_utf8(data, stats))


def _field_text(value, where: str, opts: ReadOptions, stats: ReadStats) -> str:
    if not isinstance(value, str):
        raise InputError(f"{where}: field '{opts.text_field}' holds {type(value).__name__}, not text")
    return clean_text(value, stats)


def _read_jsonl(f: InputFile, opts: ReadOptions, stats: ReadStats) -> Iterator[Document]:
    lines = iter_input_lines(f.path)
    number = 0
    while True:
        try:
            raw = next(lines, None)
        except CompressionError as err:
            raise InputError(str(err)) from None
        if raw is None:
            return
        number += 1
        if not raw.strip():
            continue
        where = f"{f.path}:{number}"
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise InputError(f"{where}: not a JSON line ({err})") from None
        except RecursionError:
            raise InputError(f"{where}: the JSON is nested too deeply to read") from None
        if not isinstance(record, dict) or opts.text_field not in record:
            fields = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
            raise InputError(
                f"{where}: no field '{opts.text_field}' (the record has: {fields}); "
                "name the text field with --text-field"
            )
        text = _field_text(record[opts.text_field], where, opts, stats)
        identity = f"{f.name}#{number}"
        if opts.id_field is not None:
            if opts.id_field not in record:
                raise InputError(f"{where}: no id field '{opts.id_field}'")
            identity = str(record[opts.id_field])
        yield Document(identity, text)


def _read_parquet(f: InputFile, opts: ReadOptions, stats: ReadStats) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq  # optional: the parquet extra
    except ImportError:
        raise InputError(
            f"{f.path}: reading Parquet needs pyarrow, which is not installed: "
            "pip install 'k3-sandbox[parquet]' (or pyarrow)"
        ) from None
    try:
        pf = pq.ParquetFile(f.path)
    except Exception as err:
        raise InputError(f"{f.path}: not a readable Parquet file ({str(err).splitlines()[0]})") from None
    names = pf.schema_arrow.names
    columns = [opts.text_field] + ([opts.id_field] if opts.id_field else [])
    for c in columns:
        if c not in names:
            raise InputError(
                f"{f.path}: no column '{c}' (columns: {', '.join(names)}); name the text column with --text-field"
            )
    row = 0
    for batch in pf.iter_batches(columns=columns):
        texts = batch.column(0).to_pylist()
        ids = batch.column(1).to_pylist() if opts.id_field else None
        for i, value in enumerate(texts):
            where = f"{f.path} row {row}"
            if value is None:
                value = ""
            yield Document(str(ids[i]) if ids else f"{f.name}#{row}", _field_text(value, where, opts, stats))
            row += 1


_READERS = {"text": _read_text_file, "jsonl": _read_jsonl, "parquet": _read_parquet}


def stdlib_code_documents() -> Iterator[Document]:
    """This Python's standard-library ``.py`` sources, one document per file (the byte corpus's text)."""
    root = stdlib_root()
    for rel in stdlib_sources(root):
        yield Document(rel, (root / rel).read_bytes().decode("utf-8", errors="replace"))


def _module_docstrings(path: Path) -> Optional[str]:
    """A module's docstrings, each under its class or function name; None if it has none."""
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):
        return None
    parts = []
    module_doc = ast.get_docstring(tree)
    if module_doc:
        parts.append(module_doc)
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                parts.append(f"{node.name}\n\n{doc}")
    return "\n\n".join(parts) + "\n" if parts else None


def _is_test_module(rel: str) -> bool:
    return any(part.startswith(("test", "idle_test")) for part in Path(rel).parts)


def stdlib_docs_documents() -> Iterator[Document]:
    """English documentation that ships with Python: the reference manual's topics (``pydoc_data``) and,
    per standard-library module (test suites excluded), its docstrings (module, classes, functions, each
    under its name). Modules are parsed on every core."""
    for name in sorted(topics):
        yield Document(f"topics/{name}", topics[name])
    root = stdlib_root()
    modules = [rel for rel in stdlib_sources(root) if not _is_test_module(rel)]
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for rel, text in zip(modules, pool.map(_module_docstrings, [root / rel for rel in modules], chunksize=16)):
            if text:
                yield Document(f"docstrings/{rel}", text)


def read_documents(
    inputs: list[list[InputFile] | str],
    opts: ReadOptions,
    stats: ReadStats,
    names: Optional[list[str]] = None,
) -> Iterator[Document]:
    """Every document of the expanded inputs, in order; empty documents are counted and dropped. Counts per
    input (named by ``names``, the inputs as given) go to ``stats.per_input``."""
    for index, item in enumerate(inputs):
        name = names[index] if names is not None else str(index)
        counts = stats.per_input.setdefault(name, {"files": 0, "documents": 0, "empty": 0, "binary": 0})
        if item == "stdlib:code":
            docs: Iterator[Document] = stdlib_code_documents()
        elif item == "stdlib:docs":
            docs = stdlib_docs_documents()
        else:
            counts["files"] += len(item)
            docs = _file_documents(item, opts, stats, counts)
        for doc in docs:
            if not doc.text:
                stats.empty_documents += 1
                counts["empty"] += 1
                continue
            stats.documents += 1
            counts["documents"] += 1
            yield doc


def _file_documents(
    files: list[InputFile], opts: ReadOptions, stats: ReadStats, counts: dict[str, int]
) -> Iterator[Document]:
    for f in files:
        binary_before = len(stats.binary_files)
        yield from _READERS[f.format](f, opts, stats)
        counts["binary"] += len(stats.binary_files) - binary_before


def why_nothing(stats: ReadStats) -> str:
    """For each input that gave no document, what it held instead (the 'nothing to prepare' message)."""
    parts = []
    for name, c in stats.per_input.items():
        if c["documents"]:
            continue
        held = [f"{c['files']} file(s)"] if c["files"] else []
        if c["empty"]:
            held.append(f"{c['empty']} empty document(s)")
        if c["binary"]:
            held.append(f"{c['binary']} binary file(s) skipped (--binary skip)")
        parts.append(f"input '{name}': no documents ({', '.join(held) or 'nothing readable'})")
    return "; ".join(parts)


def split_of(identity: str, val_fraction: float) -> str:
    """``val`` or ``train``, from a hash of the document's identity (the byte corpus's rule)."""
    return "val" if is_validation(identity, 100.0 * val_fraction) else "train"
