"""Text to a prepared token folder (``prepare.py`` and the self-preparing ``data=text``).

Reads the inputs, splits documents into train and validation by a hash of their identity, trains the
tokenizer on the training split when asked (``bpe:N``), tokenises every document (the Hugging Face
tokenizers encode batches on all cores), and writes the folder described in ``prepared.py``. The work
happens in a hidden sibling folder that is renamed into place when complete, so an interrupted run
leaves nothing that looks finished and never damages an existing folder. A folder prepared from the
same inputs and options (one hash over both) is reused, not rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
from tqdm import tqdm

from components.atomic_folder import clear_stale, put_in_place, staging_path
from components.data.text.documents import (
    BINARY_POLICIES,
    ReadOptions,
    ReadStats,
    fingerprint_inputs,
    read_documents,
    split_of,
    why_nothing,
)
from components.data.text.input_files import FORMATS, Expansion, InputError, expand_input
from components.data.text.output_lock import OutputLock
from components.data.text.prepared import FORMAT, META, SPLITS, VERSION, is_prepared, read_meta
from components.data.text.tokenizers import (
    ByteTokenizer,
    TextTokenizer,
    TokenizerError,
    dtype_for_vocab,
    load_tokenizer_file,
    parse_bpe_spec,
    spec_vocab_size,
    train_bpe,
)

_BATCH_CHARS = 4 << 20  # text handed to the tokenizer per batch
# inputs up to this many characters are read once and kept for both passes (tokenizer training, then
# tokenisation); larger ones are read twice
_KEEP_CHARS = 512 << 20


class PrepareError(ValueError):
    """Preparation refused: the message names the input, file or option and what is wrong."""


class PrepareWriteError(PrepareError):
    """The folder could not be written (a full disk); the message says that the output is as it was."""


@dataclass
class PrepareOptions:
    inputs: list[str]
    out: str
    tokenizer: str = "bytes"
    val_fraction: float = 0.02
    read: ReadOptions = field(default_factory=ReadOptions)
    eod_token: Optional[str] = None  # end-of-document token of a tokenizer.json (None: the usual names)
    dtype: str = "auto"
    overwrite: bool = False
    progress: bool = True


@dataclass
class PrepareResult:
    folder: Path
    reused: bool
    seconds: float
    meta: dict


def check_options(opts: PrepareOptions) -> None:
    """Refuse bad options before any input is read."""
    if not opts.inputs:
        raise PrepareError(
            "no inputs: name text files, folders, glob patterns, JSONL or Parquet files, or stdlib:code / stdlib:docs"
        )
    if not 0 < opts.val_fraction < 0.5:
        raise PrepareError(f"--val-fraction must be in (0, 0.5), got {opts.val_fraction}")
    if opts.read.format not in FORMATS:
        raise PrepareError(f"--format '{opts.read.format}' is not allowed; choose one of {', '.join(FORMATS)}")
    if opts.read.binary not in BINARY_POLICIES:
        raise PrepareError(f"--binary '{opts.read.binary}' is not allowed; choose one of {', '.join(BINARY_POLICIES)}")
    if opts.dtype not in ("auto", "uint16", "uint32"):
        raise PrepareError(f"--dtype '{opts.dtype}' is not allowed; choose one of auto, uint16, uint32")
    out = Path(opts.out)
    for ancestor in [out, *out.parents]:
        if ancestor.exists():
            if ancestor != out and not ancestor.is_dir():
                raise PrepareError(f"--out {opts.out}: {ancestor} is a file, not a folder to write into")
            break


def _tokenizer_identity(spec: str, eod_token: Optional[str]) -> str:
    """What the options hash records of the tokenizer: the spec, or a tokenizer file's content hash."""
    if spec == "bytes" or parse_bpe_spec(spec) is not None:
        return spec
    return f"file:{load_tokenizer_file(spec, eod_token).fingerprint()}"


def _choose_dtype(opts: PrepareOptions, vocab_size: int) -> str:
    if opts.dtype == "auto":
        return dtype_for_vocab(vocab_size)
    limit = np.iinfo(np.dtype(opts.dtype)).max + 1
    if vocab_size > limit:
        raise PrepareError(
            f"--dtype {opts.dtype}: a vocabulary of {vocab_size:,} ids does not fit (at most {limit:,}); use --dtype "
            "uint32 or auto"
        )
    return opts.dtype


def prepare(opts: PrepareOptions, log: Callable[[str], None] = print) -> PrepareResult:
    """Prepare ``opts.out`` (or reuse it when it holds the same inputs and options). Raises
    PrepareError, InputError or TokenizerError with a message naming what is wrong; on any failure the
    output folder is as it was."""
    start = time.time()
    check_options(opts)
    out = Path(opts.out)
    expansion = Expansion()
    try:
        # the output folder and its hidden siblings (temporaries, lock) are never inputs
        exclude = [out, *out.parent.glob(f".{out.name}.*")]
        expanded = [expand_input(p, opts.read.format, exclude, expansion) for p in opts.inputs]
        tokenizer_identity = _tokenizer_identity(opts.tokenizer, opts.eod_token)
    except (InputError, TokenizerError) as err:
        raise PrepareError(str(err)) from None
    for note in expansion.notes:
        log(f"note: {note}")
    if opts.dtype != "auto":  # refuse a dtype too small before any input is read
        _choose_dtype(opts, spec_vocab_size(opts.tokenizer, opts.eod_token))
    options = {
        "format": FORMAT,
        "version": VERSION,
        "inputs": opts.inputs,
        "tokenizer": tokenizer_identity,
        "val_fraction": opts.val_fraction,
        "read": asdict(opts.read),
        "eod_token": opts.eod_token,
        "dtype": opts.dtype,
    }
    prepare_hash = hashlib.sha256(
        json.dumps([options, fingerprint_inputs(expanded)], sort_keys=True).encode()
    ).hexdigest()[:16]

    if out.exists():
        _check_replaceable(out, prepare_hash, opts)  # before the lock: refuse without writing anything
    # one preparation of a folder at a time: a second waits, then finds the folder the first wrote
    with OutputLock(out, log):
        if out.exists():
            old = _check_replaceable(out, prepare_hash, opts)
            if old is not None:
                log(f"{out}: already prepared from the same inputs and options (hash {prepare_hash}); reusing it")
                return PrepareResult(out, True, time.time() - start, old)
        clear_stale(out)  # what a killed preparation left beside the folder
        tmp = staging_path(out)
        try:
            tmp.mkdir()
            meta = _write(opts, expanded, tmp, log)
            meta["prepare_hash"] = prepare_hash
            meta["seconds"] = round(time.time() - start, 2)
            _write_json(tmp / META, meta)  # last: a folder with meta.json is complete
            put_in_place(tmp, out, replace=True)  # checked above: out is missing, empty, or may be replaced
        except OSError as err:  # a full disk, a folder that cannot be written
            shutil.rmtree(tmp, ignore_errors=True)
            raise PrepareWriteError(f"writing {out} failed ({_reason(err)}); {_unchanged(out)}") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return PrepareResult(out, False, time.time() - start, meta)


def _check_replaceable(out: Path, prepare_hash: str, opts: PrepareOptions) -> Optional[dict]:
    """The meta of ``out`` when it holds exactly this preparation (reuse it); None when it may be replaced;
    PrepareError when it holds something else and --overwrite is not given."""
    if is_prepared(out):
        try:
            old = read_meta(out)
        except ValueError:
            old = {}
        if old.get("prepare_hash") == prepare_hash:
            return old
        if not opts.overwrite:
            raise PrepareError(
                f"{out} holds data prepared from other inputs or options (hash {old.get('prepare_hash')}, now "
                f"{prepare_hash}); choose another output folder or pass --overwrite"
            )
    elif not out.is_dir() or any(out.iterdir()):
        raise PrepareError(f"{out} exists and is not a prepared folder (no {META}); refusing to write into it")
    return None


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _reason(err: OSError) -> str:
    return f"{err.strerror or err}: {err.filename}" if err.filename else str(err.strerror or err)


def _unchanged(out: Path) -> str:
    return f"{out} is as it was" if out.exists() else f"nothing was written at {out}"


def _documents(
    opts: PrepareOptions, expanded, stats: ReadStats, split: Optional[str] = None
) -> Iterator[tuple[str, str]]:
    try:
        for doc in read_documents(expanded, opts.read, stats, opts.inputs):
            s = split_of(doc.identity, opts.val_fraction)
            if split is None or s == split:
                yield s, doc.text
    except (InputError, OSError) as err:
        raise PrepareError(str(err)) from None


class _Reread:
    """The documents of a first pass, kept for the second when they are small enough."""

    def __init__(self) -> None:
        self.kept: Optional[list[tuple[str, str]]] = []
        self.stats = ReadStats()
        self.size = 0

    def first_pass(self, opts: PrepareOptions, expanded) -> Iterator[str]:
        for split, text in _documents(opts, expanded, self.stats):
            if self.kept is not None:
                self.size += len(text)
                self.kept.append((split, text))
                if self.size > _KEEP_CHARS:
                    self.kept = None
            if split == "train":
                yield text


def _build_tokenizer(opts: PrepareOptions, expanded, log: Callable[[str], None], kept: _Reread) -> TextTokenizer:
    if opts.tokenizer == "bytes":
        return ByteTokenizer()
    vocab = parse_bpe_spec(opts.tokenizer)
    if vocab is None:
        return load_tokenizer_file(opts.tokenizer, opts.eod_token)
    t = time.time()
    tok = train_bpe(kept.first_pass(opts, expanded), vocab)
    log(f"trained {opts.tokenizer} on the training split in {time.time() - t:.1f} s ({tok.vocab_size:,} ids)")
    return tok


def _progress(opts: PrepareOptions):
    if not opts.progress:
        return None
    return tqdm(unit="B", unit_scale=True, desc="tokenising", file=sys.stderr, mininterval=1.0)


def _write(opts: PrepareOptions, expanded, folder: Path, log: Callable[[str], None]) -> dict:
    kept = _Reread()
    tokenizer = _build_tokenizer(opts, expanded, log, kept)
    dtype = _choose_dtype(opts, tokenizer.vocab_size)
    lengths = np.array([len(b) for b in tokenizer.token_bytes()], dtype=np.int64)  # UTF-8 bytes per id
    eod = np.array([tokenizer.eod_id], dtype=dtype)
    files = {s: open(folder / f"{s}.bin", "wb") for s in SPLITS}
    offsets: dict[str, list[int]] = {s: [0] for s in SPLITS}
    counts = {s: {"documents": 0, "tokens": 0, "bytes": 0} for s in SPLITS}
    exact = True  # the per-id byte lengths add up to every document's UTF-8 size
    if kept.kept:  # the tokenizer's pass read everything already
        stats, documents = kept.stats, iter(kept.kept)
    else:
        stats = ReadStats()
        documents = _documents(opts, expanded, stats)
    bar = _progress(opts)

    def flush(batch: list[tuple[str, str]]) -> None:
        nonlocal exact
        encoded = tokenizer.encode_batch([text for _, text in batch])
        for (split, text), ids in zip(batch, encoded):
            n_bytes = len(text.encode("utf-8"))
            exact = exact and int(lengths[ids].sum()) == n_bytes
            files[split].write(ids.astype(dtype).tobytes() + eod.tobytes())
            c = counts[split]
            c["documents"] += 1
            c["tokens"] += len(ids) + 1
            c["bytes"] += n_bytes
            offsets[split].append(c["tokens"])
            if bar is not None:
                bar.update(n_bytes)

    try:
        batch: list[tuple[str, str]] = []
        size = 0
        for split, text in documents:
            batch.append((split, text))
            size += len(text)
            if size >= _BATCH_CHARS:
                flush(batch)
                batch, size = [], 0
        if batch:
            flush(batch)
    finally:
        for f in files.values():
            f.close()
        if bar is not None:
            bar.close()
    if stats.documents == 0:
        raise PrepareError(f"nothing to prepare: {why_nothing(stats)}")
    for split in SPLITS:
        if counts[split]["documents"] == 0:
            total = stats.documents
            raise PrepareError(
                f"the {split} split is empty: {total} document(s) in all and --val-fraction {opts.val_fraction} puts "
                "none in it; give more documents or change --val-fraction"
            )
        np.save(folder / f"{split}.docs.npy", np.asarray(offsets[split], dtype=np.int64))
    tokenizer_file = tokenizer.save(folder)
    return {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": {**tokenizer.describe(), "file": tokenizer_file},
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype,
        "splits": counts,
        "token_bytes_exact": exact,
        "val_fraction": opts.val_fraction,
        "inputs": opts.inputs,
        "read": {**asdict(opts.read), **stats.as_dict()},
        "skipped_binary_files": stats.binary_files[:100],
    }
