"""Runs of an online W&B project or group, in the shape ``analysis.compare`` reads from run folders.

    wandb:ENTITY/PROJECT            every finished run of the project
    wandb:ENTITY/PROJECT/GROUP      the finished runs of one group (a sweep: ``sweep-<folder>``)

Per run: the summary (``val/*`` final metrics and ``runtime.loggers.WANDB_SUMMARY_FIELDS``, written at the
end of every training run), the logged history (step =
``trainer/global_step``), and the varied options from the ``key=value`` tags every sweep job carries.
Needs network access and W&B credentials; nothing is written except the figures and tables of compare.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

PREFIX = "wandb:"


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


def summary_of(run: Any) -> dict[str, Any]:
    """A run's W&B summary in the shape of a run folder's summary.json."""
    summary = dict(run.summary)
    out: dict[str, Any] = {
        "name": run.name,
        "val": {
            k[len("val/") :]: v for k, v in summary.items() if k.startswith("val/") and isinstance(v, (int, float))
        },
    }
    from runtime.loggers import WANDB_SUMMARY_FIELDS

    for key in WANDB_SUMMARY_FIELDS:
        if key in summary:
            out[key] = summary[key]
    out["eval"] = {
        k[len("eval/") :]: v for k, v in summary.items() if k.startswith("eval/") and isinstance(v, (int, float))
    }
    if "steps" not in out and "trainer/global_step" in summary:
        out["steps"] = summary["trainer/global_step"]
    return out


def fetch_runs(path: str, api: Any = None) -> list[tuple[str, dict[str, str], dict[str, Any], list[dict[str, Any]]]]:
    """(run id, varied options, summary, history records) of every finished run under ``path``."""
    if api is None:
        import wandb

        api = wandb.Api()
    project, group = parse_path(path)
    filters = {"group": group} if group else {}
    out = []
    for run in api.runs(project, filters=filters):
        if getattr(run, "state", "finished") != "finished":
            continue
        out.append((run.id, varied_from_tags(run.tags), summary_of(run), history_records(run.scan_history())))
    if not out:
        raise FileNotFoundError(f"{path}: no finished W&B runs" + (f" in group {group}" if group else ""))
    return out
