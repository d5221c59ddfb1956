"""W&B runs in the shape ``analysis.compare`` reads from run folders: online projects and groups, and
offline run folders read with wandb's own reader.

    wandb:ENTITY/PROJECT            every finished run of the project
    wandb:ENTITY/PROJECT/GROUP      the finished runs of one group (a sweep: ``sweep-<folder>``)
    <run folder>/wandb              the offline runs recorded there
    .../offline-run-<time>-<id>     one offline run (a copied folder alone is enough)

Per run: the summary (the run's whole ``summary.json`` record, written into its W&B summary at the end of
training; runs from before that: ``val/*`` and a few counts), the logged history (step =
``trainer/global_step``), and the varied options: the ``sweep`` node of the run's config (a sweep's point
and varied keys), else the ``key=value`` tags every sweep job carries. Online projects need network access
and W&B credentials; offline folders are read with ``wandb leet inspect`` (``runtime/wandb_offline.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Optional

from runtime.wandb_offline import is_offline_run, read_folder, runs_in, segments

PREFIX = "wandb:"
# the summary.json fields the W&B summary of runs from before the whole record held
_OLD_SUMMARY_FIELDS = ("steps", "train_tokens", "tokens_per_s", "params", "active_params", "d_model", "metric")


def is_wandb_path(path: str) -> bool:
    return path.startswith(PREFIX)


def parse_path(path: str) -> tuple[str, Optional[str]]:
    """``wandb:entity/project[/group]`` -> (``entity/project``, group or None)."""
    parts = [p for p in path[len(PREFIX) :].strip("/").split("/") if p]
    if len(parts) not in (2, 3):
        raise ValueError(f"{path}: expected wandb:ENTITY/PROJECT or wandb:ENTITY/PROJECT/GROUP")
    return "/".join(parts[:2]), (parts[2] if len(parts) == 3 else None)


def varied_from_tags(tags: Iterable[str]) -> dict[str, str]:
    """Sweep tags ``key=value`` (including ``point=...``) back into the varied options."""
    varied = {}
    for tag in tags:
        key, sep, value = tag.partition("=")
        if sep and key:
            varied[key] = value
    return varied


def history_records(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """W&B history rows -> metrics.jsonl-style records (``step`` = the trainer's global step)."""
    records = []
    for row in rows:
        step = row.get("trainer/global_step", row.get("_step"))
        if step is None:
            continue
        metrics = {
            k: v
            for k, v in row.items()
            if not k.startswith("_") and k != "trainer/global_step" and isinstance(v, (int, float)) and v is not None
        }
        if metrics:
            records.append({"step": int(step), **metrics})
    return records


def _last(value: Any) -> Any:
    """A summary value, or the last of a ``define_metric`` summary (``{"min": .., "last": ..}``)."""
    return value.get("last") if isinstance(value, dict) else value


def summary_record(summary: dict[str, Any], name: str) -> dict[str, Any]:
    """A run's W&B summary in the shape of a run folder's summary.json."""
    out: dict[str, Any] = {"name": name}
    if isinstance(summary.get("val"), dict):  # the whole summary.json record
        out.update({k: v for k, v in summary.items() if "/" not in k and not k.startswith("_")})
    else:
        out["val"] = {
            k[len("val/") :]: _last(v)
            for k, v in summary.items()
            if k.startswith("val/") and isinstance(_last(v), (int, float))
        }
        out.update({k: summary[k] for k in _OLD_SUMMARY_FIELDS if k in summary})
    out["name"] = out.get("name") or name
    out["eval"] = {
        k[len("eval/") :]: v for k, v in summary.items() if k.startswith("eval/") and isinstance(v, (int, float))
    }
    if "steps" not in out and "trainer/global_step" in summary:
        out["steps"] = summary["trainer/global_step"]
    return out


def summary_of(run: Any) -> dict[str, Any]:
    """An online run's W&B summary in the shape of a run folder's summary.json."""
    return summary_record(dict(run.summary), run.name)


def varied_of(config: dict[str, Any], tags: Iterable[str]) -> dict[str, str]:
    """A sweep job's point and varied options: its config's ``sweep`` node (full values), else its tags."""
    sweep = config.get("sweep")
    if isinstance(sweep, dict) and sweep:
        return {k: str(v) for k, v in sweep.items() if k != "group"}
    return varied_from_tags(tags)


def is_offline_path(path: str) -> bool:
    """A W&B offline run folder, or a ``wandb`` folder holding some (a run folder's)."""
    p = Path(path)
    return is_offline_run(p) or (p.is_dir() and p.name == "wandb" and bool(segments(p)))


def read_offline(path: str) -> list[tuple[str, dict[str, str], dict[str, Any], list[dict[str, Any]]]]:
    """(run id, varied options, summary, history records) of every finished offline run at ``path``."""
    p = Path(path)
    runs = [read_folder(p)] if is_offline_run(p) else runs_in(p)
    out = []
    for run in runs:
        if not run.finished:
            continue
        out.append((run.run_id, varied_of(run.config, run.tags), summary_record(run.summary, run.name), run.history))
    if not out:
        raise FileNotFoundError(f"{path}: no finished W&B offline run")
    return out


def fetch_runs(path: str, api: Any = None) -> list[tuple[str, dict[str, str], dict[str, Any], list[dict[str, Any]]]]:
    """(run id, varied options, summary, history records) of every finished run under ``path``."""
    if api is None:
        import wandb  # start-up time: wandb, only for online W&B sources

        api = wandb.Api()
    project, group = parse_path(path)
    filters = {"group": group} if group else {}
    out = []
    for run in api.runs(project, filters=filters):
        if getattr(run, "state", "finished") != "finished":
            continue
        config = dict(getattr(run, "config", {}) or {})
        out.append((run.id, varied_of(config, run.tags), summary_of(run), history_records(run.scan_history())))
    if not out:
        raise FileNotFoundError(f"{path}: no finished W&B runs" + (f" in group {group}" if group else ""))
    return out
