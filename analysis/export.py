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
OUT is written beside its final name and
renamed into place when complete; an existing OUT is refused.

``--check-only`` compares every key, shape and dtype of FOLDER (its index and the shards' headers; no
tensor data is read) with the model the overrides compose, built on the meta device, and names the
first tensor that differs. ``init_from=OUT`` starts a training run from exported weights.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def export(run: str, out: str, prefix: str, dtype: str | None, max_shard_gb: float, mxfp4_experts: bool) -> int:
    from components.hf.export_folder import write_model_folder
    from components.hf.key_map import PREFIXES
    from runtime.config import to_container
    from runtime.load_run import NoTokenizerError, RunLoadError, load_run, load_tokenizer

    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        print(f"error: {out} exists; choose a new folder (nothing was written)", file=sys.stderr)
        return 2
    try:
        root, model = load_run(run)
    except RunLoadError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    staging = f"{out.rstrip(os.sep)}.partial-{os.getpid()}"
    os.makedirs(staging)
    try:
        try:  # the tokenizer travels with the weights, as in any Hugging Face model folder
            tokenizer = load_tokenizer(run, root)
        except NoTokenizerError as err:
            tokenizer = None
            print(f"note: no tokenizer written: {err}", file=sys.stderr)
        written = write_model_folder(
            staging,
            root,
            model,
            to_container(root),
            PREFIXES[prefix],
            int(max_shard_gb * (1 << 30)),
            DTYPES[dtype] if dtype else None,
            mxfp4_experts,
            tokenizer,
        )
        if os.path.isdir(out):
            os.rmdir(out)  # empty, checked above
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    print(f"{out}: {written.summary()}")
    return 0


def check_only(folder: str, overrides: list[str]) -> int:
    from components.hf.checkpoint import WeightsMismatch, check_weights
    from components.hf.safetensors_files import CheckpointError
    from components.model import Decoder
    from runtime.launch import validate_overrides

    t0 = time.perf_counter()
    root = validate_overrides(overrides or ["experiment=k3_full"])
    with torch.device("meta"):
        model = Decoder(root.decoder_config())
    try:
        prefix = check_weights(folder, model)
    except (WeightsMismatch, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    n = sum(p.numel() for p in model.state_dict().values())
    print(
        f"{folder}: every key, shape and dtype matches the composed model ({n:,} numbers, prefix '{prefix}'), "
        f"checked in {time.perf_counter() - t0:.1f} s"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    ap.add_argument("--max-shard-gb", type=float, default=5.0, help="shard above this size (GiB)")
    ap.add_argument("--mxfp4-experts", action="store_true", help="store routed experts as MXFP4, as the release does")
    args = ap.parse_args(argv)
    if args.check_only:
        return check_only(args.check_only, args.args)
    if len(args.args) != 2:
        ap.error("export needs RUN and OUT")
    return export(args.args[0], args.args[1], args.prefix, args.dtype, args.max_shard_gb, args.mxfp4_experts)


if __name__ == "__main__":
    raise SystemExit(main())
