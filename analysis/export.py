"""Export a run's model as a Hugging Face checkpoint folder, or check a checkpoint against a composed model.

    python -m analysis.export RUN OUT [--prefix text|multimodal] [--dtype fp32|bf16] [--max-shard-gb 5]
        [--mxfp4-experts]
    python -m analysis.export --check-only FOLDER [overrides ...]     # default: experiment=k3_full

The first form loads RUN (a run folder or checkpoint file, ``runtime/load_run.py``) and writes OUT:
``model.safetensors`` (or shards with ``model.safetensors.index.json`` above ``--max-shard-gb``),
``config.json``, the tokenizer files and ``generation_config.json`` (``components/hf/export_folder.py``).
K3-family models take the released K3 layout; other components take their conventional names
(``components/hf/key_map.py``). The config names the class that computes the model (Llama, Kimi Linear,
the release's ``kimi_k3`` schema or the project's registered class), and the message says why a model
is not one of transformers' own classes.
OUT is written beside its final name (a hidden ``.OUT.tmp-<pid>``) and
renamed into place when complete, so a killed or failing export (a full disk) leaves nothing at OUT; an
existing OUT that holds anything is refused.

``--check-only`` compares every key, shape and dtype of FOLDER (its index and the shards' headers; no
tensor data is read) with the model the overrides compose, built on the meta device, and names the
first tensor that differs (exit status 1). ``init_from=OUT`` starts a training run from exported weights.

Every option is checked before anything loads; a bad one, a run that does not load or overrides that do
not compose give one message and exit status 2, with nothing written.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from components.atomic_folder import clear_stale, put_in_place, staging_path
from components.hf.export_folder import write_model_folder
from components.hf.key_map import PREFIXES
from components.hf.safetensors_files import CheckpointError
from components.hf.weights_folder import WeightsMismatch, check_weights
from components.model import Decoder
from components.registry import ConfigError
from runtime.cli import ToolError, finite_float, new_output_path, reports_errors
from runtime.compose import compose_root
from runtime.config import to_container
from runtime.load_run import NoTokenizerError, RunLoadError, load_run, load_tokenizer

PROG = "python -m analysis.export"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def check_out(out: str) -> None:
    """ToolError unless ``out`` is a folder export may create: nothing there (or an empty folder), and
    no file on the way to it."""
    try:
        new_output_path(out)
    except argparse.ArgumentTypeError as err:
        raise ToolError(f"OUT {err}; nothing was written") from None
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ToolError(f"OUT {out} exists; choose a new folder (nothing was written)")


def export(run: str, out: str, prefix: str, dtype: str | None, max_shard_gb: float, mxfp4_experts: bool) -> int:
    check_out(out)
    root, model = load_run(run)  # verified completely (headers, sizes, shapes) before anything is written
    target = Path(os.path.abspath(out))
    target.parent.mkdir(parents=True, exist_ok=True)
    clear_stale(target)  # what a killed export left beside OUT
    staging = staging_path(target)
    try:
        staging.mkdir()
        try:  # the tokenizer travels with the weights, as in any Hugging Face model folder
            tokenizer = load_tokenizer(run, root)
        except NoTokenizerError as err:
            tokenizer = None
            print(f"note: no tokenizer written: {err}", file=sys.stderr)
        written = write_model_folder(
            str(staging),
            root,
            model,
            to_container(root),
            PREFIXES[prefix],
            max(1, int(max_shard_gb * (1 << 30))),
            DTYPES[dtype] if dtype else None,
            mxfp4_experts,
            tokenizer,
        )
        put_in_place(staging, target)
    except OSError as err:  # a full disk, a folder that cannot be written, an OUT filled meanwhile
        shutil.rmtree(staging, ignore_errors=True)
        where = f": {err.filename}" if err.filename else ""
        raise ToolError(
            f"writing {out} failed ({err.strerror or err}{where}); nothing was written at {out}", 1
        ) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    print(f"{out}: {written.summary()}")
    return 0


def check_only(folder: str, overrides: list[str]) -> int:
    t0 = time.perf_counter()
    root = compose_root(overrides or ["experiment=k3_full"])  # ConfigError naming the key: exit 2
    with torch.device("meta"):
        model = Decoder(root.decoder_config())
    try:
        prefix = check_weights(folder, model)
    except (WeightsMismatch, CheckpointError) as err:
        raise ToolError(str(err), 1) from None  # the documented result "does not match"
    n = sum(p.numel() for p in model.state_dict().values())
    print(
        f"{folder}: every key, shape and dtype matches the composed model ({n:,} numbers, prefix '{prefix}'), "
        f"checked in {time.perf_counter() - t0:.1f} s"
    )
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--check-only",
        metavar="FOLDER",
        help="check FOLDER's keys, shapes and dtypes against the model the overrides compose",
    )
    ap.add_argument("args", nargs="*", help="RUN OUT (export), or overrides (--check-only)")
    ap.add_argument(
        "--prefix",
        choices=["text", "multimodal"],
        default="text",
        help="key prefix: 'model.' (text-only) or the release's 'language_model.model.'",
    )
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast floating weights (default: as trained)")
    ap.add_argument(
        "--max-shard-gb", type=finite_float(0.0, above=True), default=5.0, help="shard above this size (GiB)"
    )
    ap.add_argument("--mxfp4-experts", action="store_true", help="store routed experts as MXFP4, as the release does")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.check_only:
        return _check_only(args)
    if len(args.args) != 2:
        ap.error("export needs RUN and OUT")
    return _export(args)


@reports_errors(PROG, ConfigError, CheckpointError)
def _check_only(args: argparse.Namespace) -> int:
    return check_only(args.check_only, args.args)


@reports_errors(PROG, RunLoadError)
def _export(args: argparse.Namespace) -> int:
    run, out = args.args
    return export(run, out, args.prefix, args.dtype, args.max_shard_gb, args.mxfp4_experts)


if __name__ == "__main__":
    raise SystemExit(main())
