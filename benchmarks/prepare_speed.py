"""Throughput of prepare.py on the embedded corpora, by tokenizer: MB of UTF-8 text per second, split into
tokenizer training and tokenisation, and the bytes per token each tokenizer gives.

    python benchmarks/prepare_speed.py [--inputs stdlib:code stdlib:docs] [--tokenizers bytes bpe:8192]

Every row prepares into a fresh temporary folder (no reuse), from the same inputs, one after another.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable without PYTHONPATH

from components.data.text.pipeline import PrepareOptions, prepare  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inputs", nargs="+", default=["stdlib:code", "stdlib:docs"])
    p.add_argument("--tokenizers", nargs="+", default=["bytes", "bpe:8192"])
    args = p.parse_args()
    print(f"{os.cpu_count()} cores")
    print(
        f"{'input':<14}{'tokenizer':<11}{'MB':>7}{'total s':>9}{'train s':>9}{'MB/s':>8}{'tok MB/s':>10}"
        f"{'bytes/token':>13}"
    )
    for source in args.inputs:
        for spec in args.tokenizers:
            trained: list[float] = []

            def log(msg: str) -> None:
                if msg.startswith("trained"):  # "trained bpe:N on the training split in X s (...)"
                    trained.append(float(msg.split(" in ")[1].split(" s")[0]))

            with tempfile.TemporaryDirectory() as tmp:
                start = time.perf_counter()
                result = prepare(
                    PrepareOptions([source], str(Path(tmp) / "out"), tokenizer=spec, progress=False), log=log
                )
                total = time.perf_counter() - start
            splits = result.meta["splits"].values()
            mb = sum(s["bytes"] for s in splits) / 1e6
            tokens = sum(s["tokens"] - s["documents"] for s in splits)
            train_s = trained[0] if trained else 0.0
            print(
                f"{source:<14}{spec:<11}{mb:>7.1f}{total:>9.1f}{train_s:>9.1f}{mb / total:>8.2f}"
                f"{mb / max(total - train_s, 1e-9):>10.2f}"
                f"{mb * 1e6 / tokens:>13.2f}"
            )


if __name__ == "__main__":
    main()
