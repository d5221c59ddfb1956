"""Evaluate a trained run beyond its validation loss: loss and bits per byte at multiples of the training
length, bucketed by position; benchmark tasks through the lm-evaluation-harness.

    python -m analysis.evaluate RUN --lengths 1x,2x,4x,8x [--tokens 65536] [--batch-tokens 16384] [--device cpu]
        [--out DIR]
    python -m analysis.evaluate RUN --tasks hellaswag,arc_easy [--include-path DIR] [--limit N] [--num-fewshot K]

RUN is anything ``runtime/load_run.py`` loads (run folder, checkpoint, exported folder). Each length (a
multiple ``Nx`` of the run's ``data.seq_len``, or a number of tokens) is scored on consecutive windows of
the run's validation split, about ``--tokens`` tokens of them. The loss is also reported per position
bucket -- [0, T/4), [T/4, T/2), [T/2, T), [T, 2T), [2T, 4T), ... for training length T -- so RoPE and
NoPE attention and KDA can be compared beyond the length they trained on. With document masking the
position is the one within the document, which is what the model sees.

``--tasks`` runs harness tasks on the run (``analysis/harness.py``; the ``eval`` extra): tasks whose data
is on this machine (the harness's cache, or ``--include-path`` folders of task YAML files such as
``tests/harness_tasks``). Results go to ``eval/harness.json``.

Length results go to ``<run folder>/eval/lengths.json`` and ``lengths.png`` (``--out`` for a checkpoint or
exported folder outside a run folder) and, when the run recorded a W&B run, into that run's summary
(``eval/length_<L>/loss``, ``.../bpb``, ``eval/<task>/<metric>``). ``analysis.compare`` shows them beside the
training metrics.
Exit status 2, with one message, for a missing run, a checkpoint that does not load, data without a
validation token stream, or a length that a mixer or the validation split cannot hold.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from analysis.plotting import pyplot
from components.data.base import NoValidationStream, TokenDataset
from components.nn.segments import Segments
from components.objective import IGNORE_INDEX, document_segments, token_losses
from components.registry import DATASETS
from runtime.cli import finite_float, int_at_least, new_output_path, torch_device
from runtime.cpu_thread_tuning import LoopThreadTuner, cpu_thread_tuner, thread_invariant
from runtime.load_run import RunLoadError, load_run
from runtime.loggers import wandb_mode, wandb_settings
from runtime.precision import forward_autocast
from runtime.wandb_offline import wait_for_a_new_segment_name

RESULTS_FILE = "lengths.json"
HARNESS_FILE = "harness.json"


class EvaluationError(ValueError):
    """An evaluation that cannot run; the message names the run, option or length and why."""


def length_summary(results: list[dict[str, Any]]) -> dict[str, float]:
    """``lengths.json`` results as flat keys (``length_<L>/loss``, ``.../bpb``): the run's W&B summary
    (under ``eval/``) and ``analysis.compare``'s evaluation table both use them."""
    return {f"length_{r['length']}/{k}": r[k] for r in results for k in ("loss", "bpb", "accuracy") if k in r}


def task_summary(scores: dict[str, dict[str, float]]) -> dict[str, float]:
    """``harness.json`` results as flat keys (``<task>/<metric>``), as ``length_summary``."""
    return {f"{task}/{k}": v for task, metrics in scores.items() for k, v in metrics.items()}


def parse_length_spec(spec: str) -> list[tuple[str, float]]:
    """``"1x,2x,512"`` -> ``[("x", 1.0), ("x", 2.0), ("tokens", 512)]``; EvaluationError naming a bad part."""
    parts = []
    for part in (p.strip() for p in spec.split(",")):
        try:
            kind, value = ("x", float(part[:-1])) if part.endswith("x") else ("tokens", int(part))
            if not (math.isfinite(value) and value > 0):
                raise ValueError(part)
        except ValueError:
            raise EvaluationError(
                f"--lengths: '{part}' is neither a positive multiple of the training length (e.g. 2x) nor a number "
                "of tokens"
            ) from None
        parts.append((kind, value))
    return parts


def parse_lengths(spec: str, train_len: int) -> list[int]:
    """``"1x,2x,4x"`` (multiples of the training length) or token counts -> lengths in tokens."""
    out = []
    for kind, value in parse_length_spec(spec):
        length = round(value * train_len) if kind == "x" else int(value)
        if length < 2:
            shown = f"{value:g}x" if kind == "x" else str(int(value))
            raise EvaluationError(f"--lengths: '{shown}' gives {length} tokens; a length needs at least 2")
        out.append(length)
    return sorted(set(out))


def position_buckets(train_len: int, length: int) -> list[tuple[int, int]]:
    """[0, T/4), [T/4, T/2), [T/2, T), [T, 2T), [2T, 4T), ... cut at ``length``."""
    edges = sorted({0, *(e for e in (train_len // 4, train_len // 2) if e > 0)})
    edge = train_len
    while edge < length:
        edges.append(edge)
        edge *= 2
    edges.append(length)
    return [(a, b) for a, b in zip(edges, edges[1:]) if a < b]


def check_mixers(model: Any, length: int) -> None:
    for i, layer in enumerate(model.layers):
        limit = layer.mixer.max_seq_len()
        if limit is not None and length > limit:
            raise EvaluationError(
                f"--lengths: {length} tokens is beyond what layer {i}'s mixer ({layer.spec.mixer.name}) supports: at "
                f"most {limit}"
            )


def positions_in_context(x: torch.Tensor, eod_id: Optional[int]) -> torch.Tensor:
    """``[B, T]``: each token's position within what it may attend to (its document with masking)."""
    T = x.shape[1]
    t = torch.arange(T, device=x.device).expand_as(x)
    if eod_id is None:
        return t
    starts = torch.where(Segments.from_eod(x, eod_id).starts, t, torch.zeros_like(t))
    return t - starts.cummax(dim=1).values


@torch.no_grad()
def evaluate_length(
    model: Any,
    dataset: TokenDataset,
    val: Any,
    length: int,
    tokens: int,
    batch_tokens: int,
    device: str,
    tuner: Optional[LoopThreadTuner] = None,
    precision: str = "32-true",
) -> dict[str, Any]:
    """Loss (and the dataset's metrics, e.g. bpb) at ``length`` over consecutive windows of the validation
    stream ``val [N]``, overall and per position bucket. ``tuner``: keeps the CPU thread count right for the
    machine's load (``runtime/cpu_thread_tuning.py``); None: the count as it is. ``precision``: the run's
    (``trainer.precision``, resolved): a mixed-precision run's forward is computed under its autocast, as
    its validation was."""
    tuner = tuner or cpu_thread_tuner(device, invariant=False)
    windows = min(max(1, tokens // length), (len(val) - 1) // length)
    masking = dataset.eod_id if dataset.document_masking else None
    buckets = position_buckets(dataset.seq_len, length)
    sums: list[dict[str, float]] = [{} for _ in range(len(buckets) + 1)]  # per bucket, then overall
    rows = max(1, batch_tokens // length)
    for first in range(0, windows, rows):
        starts = range(first * length, min(first + rows, windows) * length, length)
        chunk = torch.stack([torch.from_numpy(val[s : s + length + 1].astype("int64")) for s in starts]).to(
            device
        )  # [B, L+1]
        x, y = chunk[:, :-1], chunk[:, 1:]
        segments = document_segments(x, dataset.eod_id, dataset.document_masking)
        with tuner.timed_step(work=x.numel()), forward_autocast(precision, device):
            logits = model(x, segments=segments).float()  # [B, L, V]
        token_loss = token_losses(logits, y)  # [B, L]
        position = positions_in_context(x, masking)
        for i, (a, b) in enumerate([*buckets, (0, length)]):
            scored = torch.where((position >= a) & (position < b), y, torch.full_like(y, IGNORE_INDEX))
            for k, v in dataset.metric_sums(logits, scored, token_loss).items():
                sums[i][k] = sums[i].get(k, 0.0) + float(v)
    finished = [dataset.finish_metrics(s) if s.get("tokens") else {} for s in sums]
    return {
        "length": length,
        "multiple": length / dataset.seq_len,
        "windows": windows,
        "tokens": windows * length,
        **{k: float(v) for k, v in finished[-1].items()},
        "buckets": [
            {
                "from": a,
                "to": b,
                "tokens": int(sums[i].get("tokens", 0)),
                **{k: float(v) for k, v in finished[i].items()},
            }
            for i, (a, b) in enumerate(buckets)
        ],
    }


def run_folder_of(path: str) -> Optional[Path]:
    """The run folder ``path`` is or lies in (a checkpoint under ``<run>/checkpoints/``), else None."""
    p = Path(path).resolve()
    for candidate in (p, p.parent.parent if p.parent.name == "checkpoints" else None):
        if candidate is not None and (candidate / "checkpoints").is_dir():
            return candidate
    return None


def log_to_wandb(run_dir: Path, root: Any, metrics: dict[str, float]) -> Optional[str]:
    """Write ``metrics`` into the summary of the W&B run the training run recorded (offline runs get a
    new offline segment of the same id, which ``wandb sync`` merges). Returns the run id, or None."""
    info_path = run_dir / "run.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    if not info.get("wandb_id"):
        return None
    mode = wandb_mode(root.logger.mode)
    if mode == "disabled":
        return None
    import wandb  # start-up time: wandb, only for runs W&B recorded

    if mode == "offline":
        wait_for_a_new_segment_name(run_dir / "wandb", info["wandb_id"])
    run = wandb.init(
        id=info["wandb_id"],
        resume="allow",
        project=root.logger.project,
        entity=root.logger.entity,
        dir=str(run_dir),
        mode=mode,
        settings=wandb_settings(root.logger.init_timeout_s),
    )
    try:
        run.summary.update(metrics)
    finally:
        run.finish()
        # stop this process's W&B service and drop its address from the environment: processes started
        # from here later (a resumed training run) must not attach to it and find the run id still "in use"
        wandb.teardown()
    return info["wandb_id"]


def plot_lengths(results: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    for r in results:
        mids = [(b["from"] + b["to"]) / 2 for b in r["buckets"] if b.get("tokens")]
        losses = [b["loss"] for b in r["buckets"] if b.get("tokens")]
        ax.plot(mids, losses, marker="o", label=f"{r['length']} tokens ({r['multiple']:g}x)")
    ax.axvline(results[0]["length"] / results[0]["multiple"], color="grey", ls=":", lw=1, label="training length")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position in context (bucket middle, tokens)")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def evaluate_lengths(
    run: str, spec: str, tokens: int, batch_tokens: int, device: str, out: Optional[str]
) -> dict[str, Any]:
    out_dir = results_folder(run, out)
    root, model = load_run(run, device=device)
    try:
        dataset = DATASETS.build(root.data, root.seed)
    except (ValueError, OSError) as err:
        raise EvaluationError(f"the run's data ({root.data.name}) does not load here: {err}") from None
    try:
        val = dataset.validation_stream()  # [N]
    except NoValidationStream as err:
        raise EvaluationError(f"the run's data ({root.data.name}) {err}") from None
    lengths = parse_lengths(spec, dataset.seq_len)
    for length in lengths:
        check_mixers(model, length)
        if length + 1 > len(val):
            raise EvaluationError(
                f"--lengths: {length} tokens is longer than the validation split ({len(val):,} tokens)"
            )
    results = []
    tuner = cpu_thread_tuner(device, invariant=thread_invariant(root))  # evaluation keeps its share of the cores
    for length in lengths:
        r = evaluate_length(model, dataset, val, length, tokens, batch_tokens, device, tuner, root.trainer.precision)
        results.append(r)
        metric = dataset.metrics.primary if dataset.metrics.primary in r else "loss"
        print(
            f"{length:>7} tokens ({r['multiple']:g}x): loss {r['loss']:.4f}"
            + (f", {metric} {r[metric]:.4f}" if metric != "loss" else "")
            + f"  [{r['windows']} windows]"
        )
        print(
            "        by position: "
            + "  ".join(f"[{b['from']},{b['to']}) {b['loss']:.3f}" for b in r["buckets"] if b.get("tokens"))
        )
    tuner.restore()
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "run": str(run),
        "name": root.name,
        "train_length": dataset.seq_len,
        "mixer": root.mixer.name,
        "results": results,
    }
    (out_dir / RESULTS_FILE).write_text(json.dumps(record, indent=1))
    plot_lengths(
        results,
        out_dir / "lengths.png",
        f"{root.name or root.mixer.name}: loss by position at several lengths (trained at {dataset.seq_len})",
    )
    flat = {f"eval/{k}": v for k, v in length_summary(results).items()}
    run_dir = run_folder_of(run)
    wandb_id = log_to_wandb(run_dir, root, flat) if run_dir else None
    print(
        f"wrote {out_dir / RESULTS_FILE}, {out_dir / 'lengths.png'}"
        + (f"; W&B run {wandb_id} summary" if wandb_id else "")
    )
    return record


def results_folder(run: str, out: Optional[str]) -> Path:
    if out:
        return Path(out)
    run_dir = run_folder_of(run)
    if run_dir is None:
        raise EvaluationError(f"{run} is not in a run folder: name where the results go with --out")
    return run_dir / "eval"


def evaluate_tasks(
    run: str,
    tasks: list[str],
    include_path: Optional[str],
    limit: Optional[float],
    num_fewshot: Optional[int],
    device: str,
    out: Optional[str],
    batch_size: int = 8,
) -> dict[str, Any]:
    """The harness's tasks on the run; returns ``{task: {metric: value}}`` and writes ``eval/harness.json``."""
    try:
        import lm_eval  # optional: the eval extra
    except ImportError:
        raise EvaluationError("--tasks needs the lm-evaluation-harness: pip install -e '.[eval]'") from None
    from analysis.harness import HarnessArgumentError, K3HarnessModel, task_manager  # optional: the eval extra

    out_dir = results_folder(run, out)
    try:
        manager = task_manager(tasks, include_path)
    except HarnessArgumentError as err:
        raise EvaluationError(str(err)) from None
    lm = K3HarnessModel(run, device=device, batch_size=batch_size)
    result = lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=manager,
        limit=limit,
        num_fewshot=num_fewshot,
        log_samples=False,
        bootstrap_iters=0,
    )
    scores = {
        task: {
            k.split(",")[0]: float(v)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not k.startswith("alias") and "_stderr" not in k
        }
        for task, metrics in result["results"].items()
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "run": str(run),
        "tasks": tasks,
        "limit": limit,
        "num_fewshot": num_fewshot,
        "max_length": lm.max_length,
        "results": scores,
    }
    (out_dir / HARNESS_FILE).write_text(json.dumps(record, indent=1))
    for task, metrics in scores.items():
        print(f"{task}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    run_dir = run_folder_of(run)
    flat = {f"eval/{k}": v for k, v in task_summary(scores).items()}
    wandb_id = log_to_wandb(run_dir, lm.root, flat) if run_dir else None
    print(f"wrote {out_dir / HARNESS_FILE}" + (f"; W&B run {wandb_id} summary" if wandb_id else ""))
    return scores


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a run folder, a checkpoint (file or sharded folder) or an exported folder")
    p.add_argument("--lengths", help="comma-separated multiples of the training length (1x,2x,4x) or token counts")
    p.add_argument("--tasks", help="comma-separated lm-evaluation-harness tasks")
    p.add_argument("--include-path", default=None, help="a folder of extra task YAML files for --tasks")
    p.add_argument(
        "--limit", type=finite_float(0.0, above=True), default=None, help="documents per task (a fraction if below 1)"
    )
    p.add_argument("--num-fewshot", type=int_at_least(0), default=None)
    p.add_argument(
        "--tokens", type=int_at_least(1), default=65536, help="validation tokens scored per length (default 65536)"
    )
    p.add_argument(
        "--batch-tokens", type=int_at_least(1), default=16384, help="tokens per forward pass (default 16384)"
    )
    p.add_argument("--device", type=torch_device, default="cpu")
    p.add_argument("--out", type=new_output_path, default=None, help="results folder (default: <run folder>/eval)")
    args = p.parse_args(argv)
    try:
        if not os.path.exists(args.run):
            raise EvaluationError(f"{args.run}: no such run folder, checkpoint or exported folder")
        if not (args.lengths or args.tasks):
            raise EvaluationError("name what to evaluate: --lengths and/or --tasks")
        if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
            raise EvaluationError(f"--out {args.out}: a file, not a folder for the results")
        if args.lengths:
            parse_length_spec(args.lengths)  # the form, before the run loads (tokens need its training length)
        if args.lengths:
            evaluate_lengths(args.run, args.lengths, args.tokens, args.batch_tokens, args.device, args.out)
        if args.tasks:
            evaluate_tasks(
                args.run,
                [t.strip() for t in args.tasks.split(",") if t.strip()],
                args.include_path,
                args.limit,
                args.num_fewshot,
                args.device,
                args.out,
            )
    except (EvaluationError, RunLoadError) as err:
        print(f"analysis.evaluate: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
