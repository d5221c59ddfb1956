"""Turn text into training data: a folder of train / validation token memmaps for ``data=memmap``.

    python prepare.py stdlib:docs --tokenizer bpe:8192 --out data/docs-bpe8k
    python prepare.py 'books/**/*.txt' notes/ --tokenizer bytes --out data/books
    python prepare.py crawl.jsonl --text-field content --tokenizer path/to/tokenizer.json --out data/crawl
    python train.py data=memmap data.path=data/docs-bpe8k

Inputs are text files, folders of them (recursive), glob patterns, JSONL files (``.jsonl``: one JSON
object per line, the text under ``--text-field``), Parquet files (``.parquet``, the text in column
``--text-field``; needs pyarrow), any of these compressed (``.gz``, ``.bz2``, ``.xz``; ``.zst`` with
zstandard), and the embedded ``stdlib:code`` (this Python's standard-library
sources) and ``stdlib:docs`` (its English documentation: reference topics and docstrings). The folder
holds the tokens, document boundaries, the tokenizer, and ``meta.json`` with everything needed to
report bits per byte for any tokenizer. Exit status 2 on bad input, with nothing written; 1 when the
folder cannot be written (a full disk), the previous folder as it was.
"""

from __future__ import annotations

import argparse
import sys

from components.data.text.documents import BINARY_POLICIES, ReadOptions
from components.data.text.input_files import FORMATS
from components.data.text.pipeline import PrepareError, PrepareOptions, PrepareWriteError, prepare
from components.data.text.prepared import bytes_per_token
from runtime.cli import ToolError, finite_float, new_output_path, reports_errors


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prepare.py",
        description=__doc__.split("\n\n")[0] + ".",
        epilog="Reruns with the same inputs and options reuse the folder; other inputs need a new --out or "
        "--overwrite.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="text files, folders, glob patterns ('**' recurses; quote them), .jsonl or .parquet files, stdlib:code, "
        "stdlib:docs",
    )
    p.add_argument(
        "--out",
        required=True,
        type=new_output_path,
        help="the folder to write (created; refused if it holds something else)",
    )
    p.add_argument(
        "--tokenizer",
        default="bytes",
        help="bytes (UTF-8 bytes + end-of-document, 257 ids), bpe:N (byte-level BPE with N ids, trained on the "
        "training split), or the path of a tokenizer.json (default: bytes)",
    )
    p.add_argument(
        "--val-fraction",
        type=finite_float(),
        default=0.02,
        help="share of documents held out for validation, chosen by a hash of each document's identity (default: 0.02)",
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="auto",
        help="how to read the input files (default: auto, by extension: .jsonl/.ndjson, .parquet, else text)",
    )
    p.add_argument(
        "--text-field", default="text", help="JSONL field or Parquet column that holds the text (default: text)"
    )
    p.add_argument(
        "--id-field",
        default=None,
        help="JSONL field or Parquet column naming each document for the split (default: file and line)",
    )
    p.add_argument(
        "--binary",
        choices=BINARY_POLICIES,
        default="skip",
        help="binary files among text inputs: skip them (counted in meta.json) or refuse (default: skip)",
    )
    p.add_argument(
        "--eod-token",
        default=None,
        help="the end-of-document token of a tokenizer.json (default: the first of <|endoftext|>, <|end_of_text|>, "
        "</s>, <eos>, <|eos|>, [SEP] that it has)",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "uint16", "uint32"),
        default="auto",
        help="token file dtype (default: auto, uint16 up to 65,536 ids)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace an output folder prepared from other inputs or options"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    return _prepare(parser().parse_args(argv))


@reports_errors("prepare.py", PrepareError, ValueError)  # the inputs' and options' errors, named by prepare()
def _prepare(args: argparse.Namespace) -> int:
    opts = PrepareOptions(
        inputs=args.inputs,
        out=args.out,
        tokenizer=args.tokenizer,
        val_fraction=args.val_fraction,
        read=ReadOptions(format=args.format, text_field=args.text_field, id_field=args.id_field, binary=args.binary),
        eod_token=args.eod_token,
        dtype=args.dtype,
        overwrite=args.overwrite,
        progress=not args.quiet,
    )
    try:
        result = prepare(opts)
    except PrepareWriteError as err:  # not bad input: the folder could not be written (a full disk)
        raise ToolError(str(err), 1) from None
    m = result.meta
    if not result.reused:
        mb = sum(s["bytes"] for s in m["splits"].values()) / 1e6
        print(f"prepared {result.folder} in {result.seconds:.1f} s ({mb / max(result.seconds, 1e-9):.2f} MB/s of text)")
    for split, s in m["splits"].items():
        print(
            f"  {split}: {s['documents']:,} documents, {s['tokens']:,} tokens, {s['bytes']:,} UTF-8 bytes "
            f"({bytes_per_token(s):.2f} bytes per token)"
        )
    r = m["read"]
    if r.get("binary_files_skipped") or r.get("replaced_characters") or r.get("empty_documents"):
        print(
            f"  skipped {r['binary_files_skipped']} binary file(s), {r['empty_documents']} empty document(s); replaced "
            f"{r['replaced_characters']} undecodable byte sequence(s) with U+FFFD"
        )
    print(
        f"  tokenizer {m['tokenizer']['spec']} (hash {m['tokenizer']['hash']}, {m['vocab_size']:,} ids, {m['dtype']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
