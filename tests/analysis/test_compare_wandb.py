"""analysis.compare on W&B runs: offline run folders read with wandb's own reader, and an online project or
group.

No W&B server is reachable here. Offline runs are real ones (a two-job sweep trained with ``logger=wandb``),
compared from their W&B folders alone against their run folders. An online group comes from the same runs
served through a stand-in for ``wandb.Api`` with its interface (``runs(path, filters)``; runs with ``id``,
``name``, ``state``, ``tags``, ``config``, ``summary``, ``scan_history()``).
"""

from __future__ import annotations

import csv
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from analysis import wandb_source
from analysis.compare import compare
from runtime.sweep_job import read_index
from runtime.wandb_offline import read_folder, segments
from tests.helpers import FAST, run_train


@dataclass
class FakeRun:
    id: str
    name: str
    tags: list[str]
    summary: dict
    history: list[dict]
    group: str
    config: dict = field(default_factory=dict)
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
def sweep(tmp_path_factory):
    """A two-job sweep (seed=1,2) with W&B offline runs: (sweep folder, its index)."""
    out = tmp_path_factory.mktemp("wandb_sweep")
    result = run_train(
        "-m",
        "seed=1,2",
        *FAST,
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "logger=wandb",
        f"output_root={out}",
        env={"WANDB_MODE": "offline"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (sweep_dir,) = list((out / "sweeps").iterdir())
    return sweep_dir, sorted(read_index(str(sweep_dir)), key=lambda e: e["job"])


def _table(paths: list[str], out: Path) -> list[dict]:
    compare(paths, str(out))
    with open(out / "table.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_copied_offline_runs_alone_give_the_run_folders_table(sweep, tmp_path):
    sweep_dir, index = sweep
    copies = []
    for entry in index:  # each offline run copied out of its run folder: nothing else travels with it
        (folder,) = segments(Path(entry["run_dir"]) / "wandb")
        copies.append(shutil.copytree(folder, tmp_path / "copies" / str(entry["job"]) / folder.name))
    from_folders = _table([str(sweep_dir)], tmp_path / "a")
    from_wandb = _table([str(c) for c in copies], tmp_path / "b")
    assert from_wandb == from_folders
    assert [r["seed"] for r in from_wandb] == ["1", "2"]  # the sweep's varied option, from the W&B config
    assert all(float(r["val loss (final)"]) > 0 and int(r["params"]) > 0 for r in from_wandb)
    # a run folder's wandb/ folder reads the same way
    in_place = _table([str(Path(e["run_dir"]) / "wandb") for e in index], tmp_path / "c")
    assert in_place == from_folders


@pytest.mark.slow
def test_compare_reads_an_online_group_like_a_sweep_folder(sweep, tmp_path):
    _, index = sweep
    run = read_folder(segments(Path(index[0]["run_dir"]) / "wandb")[0])
    worse = {**run.summary, "val": {**run.summary["val"], "loss": run.summary["val"]["loss"] + 0.5}}
    rows = [{**{k: v for k, v in r.items() if k != "step"}, "trainer/global_step": r["step"]} for r in run.history]
    runs = [
        FakeRun("a1", "run-a", [*run.tags, "point=a"], run.summary, rows, "sweep-x", {"sweep": {"point": "a"}}),
        FakeRun("b1", "run-b", ["point=b"], worse, rows, "sweep-x"),  # varied options from the tags
        FakeRun("c1", "run-c", ["point=c"], run.summary, rows, group="other"),
        FakeRun("d1", "run-d", ["point=d"], run.summary, rows, group="sweep-x", state="running"),
    ]
    api = FakeApi({"me/k3": runs})
    result = compare(["wandb:me/k3/sweep-x"], str(tmp_path / "cmp"), wandb_api=api)
    assert api.calls == [("me/k3", {"group": "sweep-x"})]
    assert result["runs"] == 2  # the other group and the unfinished run are left out
    with open(tmp_path / "cmp" / "table.csv") as f:
        table = {r["point"]: r for r in csv.DictReader(f)}
    assert set(table) == {"a", "b"}
    assert float(table["a"]["val loss (final)"]) == pytest.approx(run.summary["val"]["loss"], abs=5e-5)
    assert float(table["b"]["val loss (final)"]) == pytest.approx(run.summary["val"]["loss"] + 0.5, abs=5e-5)
    assert int(table["a"]["params"]) == run.summary["params"]
    assert float(table["a"]["tokens/s"]) > 0  # the median of the history's logged intervals
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
    # a sweep job's config names its point and varied options in full (a tag may be cut to 64 characters)
    assert wandb_source.varied_of({"sweep": {"group": "sweep-x", "point": "a", "lr": 0.1}}, ["point=b"]) == {
        "point": "a",
        "lr": "0.1",
    }
    with pytest.raises(ValueError, match="wandb:ENTITY/PROJECT"):
        wandb_source.parse_path("wandb:just-a-project")


def test_summary_of_old_and_new_runs():
    """The whole summary.json record when the run wrote it; the few fields and val/ keys of older runs."""
    new = {"val": {"loss": 2.0}, "params": 5, "compute": {"train_flops": 1e9}, "val/loss": {"min": 1.9, "last": 2.0}}
    record = wandb_source.summary_record(new, "r")
    assert record["val"] == {"loss": 2.0} and record["compute"]["train_flops"] == 1e9 and record["name"] == "r"
    old = wandb_source.summary_record({"val/loss": 2.5, "params": 7, "_step": 3}, "old")
    assert old["val"] == {"loss": 2.5} and old["params"] == 7 and "_step" not in old
