"""Compare runs side by side: a table (markdown + CSV) and plots, from local run or sweep folders.

    python -m analysis.compare RUNS... [--out outputs/compare] [--html] [--wandb-workspace FILE.json]

RUNS: sweep folders (their ``index.jsonl`` lists the jobs and the options the sweep varied), run folders
(``summary.json`` + ``metrics.jsonl``), W&B offline runs (an ``offline-run-*`` folder, copied alone or in
place, or a run folder's ``wandb/`` folder: read with wandb's own reader, the same columns, a sweep's point
and varied options from the run's config), or online W&B runs: ``wandb:ENTITY/PROJECT`` or
``wandb:ENTITY/PROJECT/GROUP`` (analysis/wandb_source.py).

Writes into ``--out``:
* ``table.md`` / ``table.csv``: per run its varied options, steps, final and best validation loss and
  primary metric (the one the run's data recorded in its summary, e.g. bits per byte or accuracy),
  tokens/s (median of the logged steps, so compilation is not counted) and parameter counts. With a
  ``seed`` among the varied
  options, a second table aggregates the seeds of each point: mean and standard deviation of the final
  validation loss, and marks ("~") points whose difference from the best point is within the seed spread.
* ``loss.png``: training loss (lines) and validation loss (markers) against step, one colour per run,
  labelled by its varied options;
* ``maxvio.png``: MaxVio per MoE layer against step (runs with routed experts);
* runs evaluated with ``analysis.evaluate``: an evaluation table (also ``eval.csv``: loss and bits per
  byte per length, harness task metrics) and ``eval_lengths.png``, loss against evaluation length;
* MQAR runs with test segments: a recall table per segment (also ``recall.csv``) and
  ``recall_width.png`` / ``recall_state.png``, accuracy against width and against decoding state size,
  one line per mixer (``analysis/recall.py``);
* ``depth_<n>_<label>.png``: AttnRes depth weights of the last validation (runs with AttnRes);
* ``index.html`` with ``--html``: the tables and figures on one page;
* with ``--wandb-workspace FILE.json``: the study's W&B workspace as a saved-view definition (loss and
  bits per byte against tokens and FLOPs grouped by what the study varies, MaxVio per layer, largest
  activations; analysis/wandb_workspace.py), saved to the server too with ``--save-workspace``.
"""

from __future__ import annotations

import argparse
import csv
import html
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from analysis import depth_weights, recall, wandb_source, wandb_workspace
from analysis.evaluate import HARNESS_FILE, RESULTS_FILE, length_summary, task_summary
from analysis.plotting import pyplot
from components.data.metrics import LOSS, MetricContract
from runtime.cli import new_output_path
from runtime.json_records import read_json_file
from runtime.jsonl_logger import read_metrics
from runtime.sweep_job import INDEX_FILE, read_index


@dataclass
class Run:
    run_dir: Optional[Path]  # None for runs read from the W&B server
    label: str
    varied: dict[str, str]
    summary: dict[str, Any]
    metrics: list[dict[str, Any]] = field(default_factory=list)

    @property
    def contract(self) -> MetricContract:
        """The data's metric contract the run recorded (its primary metric, whether higher is better)."""
        return MetricContract.from_record(self.summary.get("metric"))

    def series(self, key: str) -> tuple[list[int], list[float]]:
        rows = [(r["step"], r[key]) for r in self.metrics if key in r]
        seen: dict[int, float] = {}
        for step, v in rows:
            seen[int(step)] = float(v)  # the last value logged at a step wins
        steps = sorted(seen)
        return steps, [seen[s] for s in steps]

    def tokens_per_s(self) -> Optional[float]:
        """Median of the per-step throughput logged during training: what a step costs once compiled and
        warm. The summary's whole-run average (the fallback for runs too short to log a step) also counts
        compilation, which dominates a short run."""
        _, values = self.series("perf/tokens_per_s")
        return statistics.median(values) if values else self.summary.get("tokens_per_s")

    def final_and_best(self, key: str, contract: MetricContract = LOSS) -> tuple[Optional[float], Optional[float]]:
        _, values = self.series(f"val/{key}")
        final = self.summary.get("val", {}).get(key)
        if final is None and values:
            final = values[-1]
        pool = values + ([final] if final is not None else [])
        best = contract.best(pool)
        return final, best


def _load_run(run_dir: Path, varied: Optional[dict[str, str]] = None) -> Run:
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise FileNotFoundError(f"{run_dir}: no summary.json (not a finished run folder)")
    summary = read_json_file(summary_path)
    summary["eval"] = read_evaluations(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    metrics = read_metrics(str(metrics_path)) if metrics_path.exists() else []
    varied = dict(varied or {})
    label = ", ".join(f"{k}={v}" for k, v in varied.items()) or summary.get("name") or run_dir.name
    return Run(run_dir, label, varied, summary, metrics)


def read_evaluations(run_dir: Path) -> dict[str, float]:
    """``analysis.evaluate``'s results in a run folder, keyed as in the run's W&B summary without the
    ``eval/`` prefix: ``length_<L>/loss``, ``length_<L>/bpb``, ``<task>/<metric>``."""
    out: dict[str, float] = {}
    lengths, harness = run_dir / "eval" / RESULTS_FILE, run_dir / "eval" / HARNESS_FILE
    if lengths.is_file():
        out.update(length_summary(read_json_file(lengths)["results"]))
    if harness.is_file():
        out.update(task_summary(read_json_file(harness)["results"]))
    return out


def eval_rows(runs: list[Run]) -> Optional[tuple[list[str], list[list[Any]]]]:
    """Evaluation results beside each run (lengths in increasing order, then tasks)."""
    keys = list(dict.fromkeys(k for r in runs for k in r.summary.get("eval", {})))
    if not keys:
        return None

    def order(key: str) -> tuple:
        head = key.partition("/")[0]
        return (
            (0, int(head[len("length_") :]), "") if head.startswith("length_") and head[7:].isdigit() else (1, 0, head)
        )

    keys.sort(key=order)  # stable: each length's or task's metrics stay in the order they were written
    rows = [[r.label, *[r.summary.get("eval", {}).get(k) for k in keys]] for r in runs if r.summary.get("eval")]
    return ["run", *keys], rows


def plot_lengths(runs: list[Run], out: Path) -> Optional[Path]:
    """Loss at each evaluated length, one line per run (``analysis.evaluate --lengths``)."""
    series = []
    for r in runs:
        points = sorted(
            (int(k.split("/")[0][len("length_") :]), v)
            for k, v in r.summary.get("eval", {}).items()
            if k.startswith("length_") and k.endswith("/loss")
        )
        if points:
            series.append((r.label, points))
    if not series:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    for label, points in series:
        ax.plot(*zip(*points), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("validation loss (nats per token)")
    ax.set_title("loss beyond the training length")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    path = out / "eval_lengths.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def collect(paths: list[str], wandb_api: Any = None) -> list[Run]:
    """Runs of every path (sweep folder, run folder, W&B offline run directory or online W&B
    project/group), in order."""
    runs: list[Run] = []
    for path in paths:
        if wandb_source.is_wandb_path(path) or wandb_source.is_offline_path(path):
            found = (
                wandb_source.fetch_runs(path, wandb_api)
                if wandb_source.is_wandb_path(path)
                else wandb_source.read_offline(path)
            )
            for run_id, varied, summary, metrics in found:
                label = ", ".join(f"{k}={v}" for k, v in varied.items()) or summary.get("name") or run_id
                runs.append(Run(None, label, varied, summary, metrics))
            continue
        p = Path(path)
        if p.name.startswith("offline-run-") and p.parent.name == "wandb":
            p = p.parent.parent  # a W&B folder without its log: the run folder around it
        if (p / INDEX_FILE).exists():
            for entry in sorted(read_index(str(p)), key=lambda e: e["job"]):
                if entry.get("status") == "finished":
                    runs.append(_load_run(Path(entry["run_dir"]), entry.get("varied")))
        elif (p / "summary.json").exists():
            runs.append(_load_run(p))
        else:
            raise FileNotFoundError(
                f"{p}: not a sweep folder ({INDEX_FILE}), a run folder (summary.json) or a W&B offline run"
            )
    if not runs:
        raise FileNotFoundError("no finished runs found in " + ", ".join(paths))
    return runs


def _round(v: Any) -> Any:
    return round(v) if isinstance(v, float) else v


# -- tables ------------------------------------------------------------------------------------------------
def table_rows(runs: list[Run]) -> tuple[list[str], list[list[Any]]]:
    varied_keys = list(dict.fromkeys(k for r in runs for k in r.varied))
    contract = runs[0].contract
    metric = [] if contract.primary == "loss" else [contract.primary]  # the loss has its own columns
    header = [
        "run",
        *varied_keys,
        "steps",
        "val loss (final)",
        "val loss (best)",
        *[f"val {m} ({which})" for m in metric for which in ("final", "best")],
        "tokens/s",
        "params",
        "active params",
    ]
    rows = []
    for r in runs:
        loss_final, loss_best = r.final_and_best("loss")
        rows.append(
            [
                r.summary.get("name") or (r.run_dir.name if r.run_dir else ""),
                *[r.varied.get(k, "") for k in varied_keys],
                r.summary.get("steps"),
                loss_final,
                loss_best,
                *[v for m in metric for v in r.final_and_best(m, contract)],
                _round(r.tokens_per_s()),
                r.summary.get("params"),
                r.summary.get("active_params"),
            ]
        )
    return header, rows


def seed_rows(runs: list[Run]) -> Optional[tuple[list[str], list[list[Any]]]]:
    """Mean and spread of the final validation loss over seeds, per point of the other varied options."""
    if not any("seed" in r.varied for r in runs):
        return None
    keys = [k for k in dict.fromkeys(k for r in runs for k in r.varied) if k != "seed"]
    points: dict[tuple, list[float]] = {}
    for r in runs:
        loss = r.final_and_best("loss")[0]
        if loss is not None:
            points.setdefault(tuple(r.varied.get(k, "") for k in keys), []).append(loss)
    stats = {p: (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0, len(v)) for p, v in points.items()}
    best = min(stats, key=lambda p: stats[p][0])
    rows = []
    for p, (mean, sd, n) in stats.items():
        spread = max(sd, stats[best][1])
        within = p != best and abs(mean - stats[best][0]) <= spread
        rows.append([*p, n, mean, sd, "best" if p == best else ("~ (within seed spread)" if within else "")])
    return [*keys, "seeds", "val loss mean", "val loss std", "vs best"], rows


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 1e4 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def markdown(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_csv(path: Path, header: list[str], rows: list[list[Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


# -- plots -------------------------------------------------------------------------------------------------
def plot_loss(runs: list[Run], out: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(runs):
        c = colors[i % len(colors)]
        steps, loss = r.series("train/loss")
        if steps:
            ax.plot(steps, loss, color=c, lw=1.2, alpha=0.85, label=f"{r.label} (train)")
        vsteps, vloss = r.series("val/loss")
        if vsteps:
            ax.plot(vsteps, vloss, color=c, marker="o", ls="--", lw=1.0, label=f"{r.label} (val)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title("training and validation loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2 if len(runs) > 4 else 1)
    path = out / "loss.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_maxvio(runs: list[Run], out: Path) -> Optional[Path]:
    with_moe = [r for r in runs if any(k.startswith("balance/maxvio/layer_") for row in r.metrics for k in row)]
    if not with_moe:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), constrained_layout=True)
    styles = ["-", "--", ":", "-."]  # one line style per run, one colour per layer
    for i, r in enumerate(with_moe):
        layers = sorted(
            {k for row in r.metrics for k in row if k.startswith("balance/maxvio/layer_")},
            key=lambda k: int(k.rsplit("_", 1)[-1]),
        )
        cmap = plt.get_cmap("viridis", max(len(layers), 2))
        for j, key in enumerate(layers):
            steps, values = r.series(key)
            ax.plot(
                steps,
                values,
                color=cmap(j),
                ls=styles[i % len(styles)],
                lw=1.0,
                label=f"{r.label} {key.rsplit('/', 1)[-1]}",
            )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("MaxVio (busiest expert's overload)")
    ax.set_title("MaxVio per MoE layer")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    path = out / "maxvio.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_depth(runs: list[Run], out: Path) -> list[Path]:
    paths = []
    for i, r in enumerate(runs):
        if r.run_dir is not None and (r.run_dir / "depth_weights.json").exists():
            history = depth_weights.load(str(r.run_dir))
            if history:
                slug = "".join(
                    c if c.isalnum() or c in "._-" else "_" for c in r.label.replace(", ", "_").replace("=", "-")
                )[:80]
                path = out / f"depth_{i}_{slug}.png"  # index first: labels of different runs may coincide
                title = f"depth weights: {r.label}, step {history[-1]['step']}"
                depth_weights.plot(history[-1], str(path), title=title)
                paths.append(path)
    return paths


def write_html(out: Path, tables: list[tuple[str, list[str], list[list[Any]]]], images: list[Path]) -> Path:
    parts = [
        "<!doctype html><meta charset='utf-8'><title>run comparison</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}</style>",
    ]
    for title, header, rows in tables:
        parts.append(
            f"<h2>{html.escape(title)}</h2><table><tr>"
            + "".join(f"<th>{html.escape(h)}</th>" for h in header)
            + "</tr>"
        )
        parts += ["<tr>" + "".join(f"<td>{html.escape(_cell(v))}</td>" for v in row) + "</tr>" for row in rows]
        parts.append("</table>")
    parts += [f"<h2>{html.escape(p.stem)}</h2><img src='{html.escape(p.name)}'>" for p in images]
    path = out / "index.html"
    path.write_text("\n".join(parts))
    return path


def study_group(paths: list[str]) -> Optional[str]:
    """The W&B group of a study given as one sweep folder (``sweep-<folder>``) or one W&B group; else None."""
    if len(paths) != 1:
        return None
    if wandb_source.is_wandb_path(paths[0]):
        return wandb_source.parse_path(paths[0])[1]
    p = Path(paths[0])
    return f"sweep-{p.resolve().name}" if (p / INDEX_FILE).exists() else None


def write_workspace(
    runs: list[Run], paths: list[str], path: str, entity: str, project: str, save: bool = False
) -> dict[str, Any]:
    """The study's W&B workspace definition written to ``path`` (analysis/wandb_workspace.py); saved to the
    server with ``save`` where credentials allow."""
    varied = list(dict.fromkeys(k for r in runs for k in r.varied))
    name = "study " + ", ".join(Path(p.rstrip("/")).name for p in paths)
    workspace = wandb_workspace.study_workspace(name[:120], varied, entity, project, study_group(paths))
    out = {"workspace": str(wandb_workspace.write_definition(workspace, Path(path)))}
    if save:
        out["workspace_url"] = wandb_workspace.save(workspace)
    return out


def compare(
    paths: list[str],
    out: str,
    make_html: bool = False,
    wandb_api: Any = None,
    workspace: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """``workspace``: also write the study's W&B workspace (``write_workspace``'s path, entity, project, save)."""
    runs = collect(paths, wandb_api)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    header, rows = table_rows(runs)
    md = markdown(header, rows)
    tables = [("runs", header, rows)]
    seeds = seed_rows(runs)
    if seeds is not None:
        md += "\n" + markdown(*seeds)
        tables.append(("seeds", *seeds))
        write_csv(out_dir / "seeds.csv", *seeds)
    evaluations = eval_rows(runs)
    if evaluations is not None:
        md += "\n" + markdown(*evaluations)
        tables.append(("evaluation", *evaluations))
        write_csv(out_dir / "eval.csv", *evaluations)
    recall_table = recall.table(runs)
    if recall_table is not None:
        md += "\n" + markdown(*recall_table)
        tables.append(("recall per test segment", *recall_table))
        write_csv(out_dir / "recall.csv", *recall_table)
    (out_dir / "table.md").write_text(md)
    write_csv(out_dir / "table.csv", header, rows)
    images = [plot_loss(runs, out_dir)]
    maxvio = plot_maxvio(runs, out_dir)
    if maxvio is not None:
        images.append(maxvio)
    images += [
        p
        for p in (recall.plot(runs, out_dir, "width"), recall.plot(runs, out_dir, "state"), plot_lengths(runs, out_dir))
        if p is not None
    ]
    images += plot_depth(runs, out_dir)
    result = {"runs": len(runs), "table": str(out_dir / "table.md"), "images": [str(p) for p in images]}
    if make_html:
        result["html"] = str(write_html(out_dir, tables, images))
    if workspace is not None:
        result.update(write_workspace(runs, paths, **workspace))
    print(md)
    return result


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "runs",
        nargs="+",
        help="sweep folders, run folders, W&B offline run directories, or wandb:ENTITY/PROJECT[/GROUP]",
    )
    p.add_argument(
        "--out", type=new_output_path, default="outputs/compare", help="output folder (default: outputs/compare)"
    )
    p.add_argument("--html", action="store_true", help="also write index.html with the tables and figures")
    p.add_argument(
        "--wandb-workspace",
        metavar="FILE.json",
        help="also write the study's W&B workspace (loss and bpb against tokens and FLOPs grouped by what it "
        "varies, MaxVio per layer, largest activations) as a saved-view definition; needs the "
        "wandb-workspaces extra",
    )
    p.add_argument("--wandb-entity", default=os.environ.get("WANDB_ENTITY", ""), help="the workspace's W&B entity")
    p.add_argument("--wandb-project", default="k3-sandbox", help="the workspace's W&B project (default: k3-sandbox)")
    p.add_argument(
        "--save-workspace", action="store_true", help="also save the workspace to the W&B server (needs credentials)"
    )
    args = p.parse_args(argv)
    workspace = None
    if args.wandb_workspace:
        try:
            import wandb_workspaces  # optional: the wandb-workspaces extra  # noqa: F401
        except ImportError:
            p.error("--wandb-workspace needs the wandb-workspaces package: pip install -e '.[wandb-workspaces]'")
        workspace = dict(
            path=args.wandb_workspace, entity=args.wandb_entity, project=args.wandb_project, save=args.save_workspace
        )
    elif args.save_workspace:
        p.error("--save-workspace saves the workspace --wandb-workspace FILE.json writes: give that too")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"argument --out: '{args.out}' is a file, not a folder for the comparison")
    try:
        result = compare(args.runs, args.out, args.html, workspace=workspace)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    extra = [result[k] for k in ("html", "workspace") if k in result]
    print("wrote " + ", ".join([result["table"], *result["images"], *extra]))
    if result.get("workspace_url"):
        print(f"saved the W&B workspace: {result['workspace_url']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
