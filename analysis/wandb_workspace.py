"""A study's W&B dashboard: the saved-view definition of a workspace for the runs ``analysis.compare`` read.

    python -m analysis.compare SWEEP --wandb-workspace study.json [--wandb-entity E] [--wandb-project P]
                                     [--save-workspace]

Sections, every chart grouped by what the study varies (its point, else the varied keys, which are config
paths; seeds of one point are one group):

* loss against compute: ``val/loss`` and ``val/bpb`` against ``perf/tokens`` and ``perf/flops`` (log scale),
  training loss against FLOPs;
* MoE balance: MaxVio per layer (``balance/maxvio/layer_*``) against the step;
* activations: the largest GLU intermediate and FFN output (``act/glu_max``, ``act/ffn_out_max``) per
  validation;
* throughput: ``perf/tokens_per_s`` over each logging interval.

The runs are the study's (W&B's ``config.sweep.group``, or the W&B groups of its runs). The definition is
written as JSON, what the ``wandb-workspaces`` package sends when it saves the view (the optional extra
``k3-sandbox[wandb-workspaces]``); it is saved to the W&B server only with ``--save-workspace`` and W&B
credentials.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from runtime.loggers import wandb_credentials_present

COMPUTE_AXES = (("perf/tokens", "tokens"), ("perf/flops", "training FLOPs"))
VALIDATION = ("val/loss", "val/bpb")
MAXVIO = "balance/maxvio/layer_.*"
ACTIVATIONS = ("act/glu_max", "act/ffn_out_max")
STEP = "trainer/global_step"


def group_keys(varied_keys: list[str]) -> list[str]:
    """The config paths a study's charts group by: its point (``sweep.point``), else each varied key but the
    seed (seeds of one configuration are one group, their spread the group's band)."""
    if "point" in varied_keys:
        return ["sweep.point"]
    return [k for k in varied_keys if k != "seed"]


def study_workspace(
    name: str, varied_keys: list[str], entity: str, project: str, sweep_group: Optional[str] = None
) -> Any:
    """The W&B workspace of a study whose runs vary ``varied_keys`` (``wandb_workspaces.workspaces.Workspace``)."""
    import wandb_workspaces.reports.v2 as wr  # optional: the wandb-workspaces extra
    import wandb_workspaces.workspaces as ws  # optional: the wandb-workspaces extra

    keys = group_keys(varied_keys)
    panel_group = {"groupby": wr.Config(keys[0])} if len(keys) == 1 else {}

    def line(title: str, x: str, y: list[str], log_x: bool = False, **more: Any) -> Any:
        return wr.LinePlot(title=title, x=x, y=y, log_x=log_x, **panel_group, **more)

    compute = [
        line(f"{metric} against {label}", axis, [metric], log_x=True)
        for metric in VALIDATION
        for axis, label in COMPUTE_AXES
    ]
    compute.append(line("train/loss against training FLOPs", "perf/flops", ["train/loss"], log_x=True))
    sections = [
        ws.Section(name="loss against compute", panels=compute, is_open=True),
        ws.Section(
            name="MoE balance",
            panels=[wr.LinePlot(title="MaxVio per layer", x=STEP, metric_regex=MAXVIO, **panel_group)],
            is_open=True,
        ),
        ws.Section(
            name="activations",
            panels=[line(f"largest {key.split('/')[1]}", STEP, [key]) for key in ACTIVATIONS],
            is_open=True,
        ),
        ws.Section(name="throughput", panels=[line("tokens/s (logging interval)", STEP, ["perf/tokens_per_s"])]),
    ]
    runset = ws.RunsetSettings(
        filters=[ws.Config("sweep.group") == sweep_group] if sweep_group else [],
        groupby=[ws.Config(k) for k in keys],
    )
    return ws.Workspace(
        entity=entity,
        project=project,
        name=name,
        sections=sections,
        settings=ws.WorkspaceSettings(x_axis=STEP),
        runset_settings=runset,
    )


def definition(workspace: Any) -> dict[str, Any]:
    """The saved view ``workspace.save()`` would send (W&B's view spec), as plain JSON data."""
    return workspace._to_model().model_dump(by_alias=True, exclude_none=True, mode="json")


def write_definition(workspace: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(definition(workspace), indent=1))
    return path


def save(workspace: Any) -> Optional[str]:
    """Saves the view to the W&B server when credentials are there; its URL, or None (with the reason printed)."""
    if not wandb_credentials_present():
        print("W&B workspace not saved: no W&B credentials (WANDB_API_KEY or ~/.netrc); the definition is written")
        return None
    try:
        saved = workspace.save()
    except Exception as err:  # no server, no network, no access: the written definition stays
        print(f"W&B workspace not saved ({type(err).__name__}: {err})")
        return None
    return saved.url
