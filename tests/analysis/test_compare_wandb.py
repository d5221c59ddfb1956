"""analysis.compare on an online W&B project/group.

No W&B server is reachable here, so the runs come from a real offline W&B run (read back with
``wandb leet inspect``) served through a stand-in for ``wandb.Api`` with the same interface
(``runs(path, filters)``; runs with ``id``, ``name``, ``state``, ``tags``, ``summary``, ``scan_history()``).
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from analysis import wandb_source
from analysis.compare import compare
from tests.helpers import run_train
from tests.training.test_train import FAST, only_run_dir


@dataclass
class FakeRun:
    id: str
    name: str
    tags: list[str]
    summary: dict
    history: list[dict]
    group: str
    state: str = "finished"

    def scan_history(self):
        return iter(self.history)


@dataclass
class FakeApi:
    runs_by_project: dict[str, list[FakeRun]]
    calls: list = field(default_factory=list)

    def runs(self, path, filters=None):
        self.calls.append((path, filters))
        group = (filters or {}).get("group")
        return [r for r in self.runs_by_project.get(path, []) if group is None or r.group == group]


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("wandb_run")
    result = run_train(
        *FAST,
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "logger=wandb",
        f"output_root={out}",
        env={"WANDB_MODE": "offline"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (wandb_dir,) = (only_run_dir(out) / "wandb").glob("offline-run-*")
    cli = str(Path(sys.executable).with_name("wandb"))
    info = json.loads(
        subprocess.run(
            [cli, "leet", "inspect", "--summary", "--json", str(wandb_dir)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
    )
    lines = subprocess.run(
        [cli, "leet", "inspect", "--json", str(wandb_dir)], capture_output=True, text=True, timeout=120, check=True
    ).stdout.splitlines()
    history = [json.loads(line)["history"]["item"] for line in lines if '"type":"history"' in line]
    return info, history


@pytest.mark.slow
def test_compare_reads_an_online_group_like_a_sweep_folder(offline_run, tmp_path):
    info, history = offline_run
    assert {"params", "active_params", "tokens_per_s", "steps"} <= set(
        info["summary"]
    )  # written at the end of training
    assert any("train/loss" in h for h in history) and all(
        "trainer/global_step" in h for h in history if "train/loss" in h
    )
    runs = [
        FakeRun("a1", "run-a", [*info["tags"], "point=a", "seed=0"], info["summary"], history, group="sweep-x"),
        FakeRun(
            "b1",
            "run-b",
            [*info["tags"], "point=b", "seed=0"],
            {**info["summary"], "val/loss": info["summary"]["val/loss"] + 0.5},
            history,
            group="sweep-x",
        ),
        FakeRun("c1", "run-c", ["point=c"], info["summary"], history, group="other"),
        FakeRun("d1", "run-d", ["point=d"], info["summary"], history, group="sweep-x", state="running"),
    ]
    api = FakeApi({"me/k3": runs})
    result = compare(["wandb:me/k3/sweep-x"], str(tmp_path / "cmp"), wandb_api=api)
    assert api.calls == [("me/k3", {"group": "sweep-x"})]
    assert result["runs"] == 2  # the other group and the unfinished run are left out
    with open(tmp_path / "cmp" / "table.csv") as f:
        rows = {r["point"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"a", "b"}
    assert float(rows["a"]["val loss (final)"]) == pytest.approx(info["summary"]["val/loss"], abs=5e-5)
    assert float(rows["b"]["val loss (final)"]) == pytest.approx(info["summary"]["val/loss"] + 0.5, abs=5e-5)
    assert int(rows["a"]["params"]) == info["summary"]["params"]
    assert Path(result["images"][0]).name == "loss.png" and Path(result["images"][0]).stat().st_size > 10_000


def test_history_rows_become_metrics_records():
    rows = [
        {"_step": 0, "_runtime": 1.0, "trainer/global_step": 3, "train/loss": 2.5},
        {"_step": 1, "val/loss": 2.0},
        {"_step": 2},
    ]
    assert wandb_source.history_records(rows) == [{"step": 3, "train/loss": 2.5}, {"step": 1, "val/loss": 2.0}]
    assert wandb_source.varied_from_tags(["mixer:gqa", "point=mla", "ffn.activation=swiglu"]) == {
        "point": "mla",
        "ffn.activation": "swiglu",
    }
    with pytest.raises(ValueError, match="wandb:ENTITY/PROJECT"):
        wandb_source.parse_path("wandb:just-a-project")
