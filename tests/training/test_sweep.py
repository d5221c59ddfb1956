"""A 2x2 multirun: four finished offline W&B runs in one group, tagged with the varied options, and a
local index of the sweep's runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from components.sweep_job import read_index
from tests.conftest import run_train
from tests.training.test_train import FAST


def test_two_by_two_multirun_groups_tags_and_indexes(tmp_path):
    result = run_train("-m", "mixer=mha,mqa", "ffn.activation=swiglu,situ_glu", *FAST, "trainer.max_steps=2",
                       "trainer.val_check_interval=2", "logger=wandb", f"output_root={tmp_path}", env={"WANDB_MODE": "offline"})
    assert result.returncode == 0, result.stderr[-3000:]
    (sweep_dir,) = list((tmp_path / "sweeps").iterdir())
    index = read_index(str(sweep_dir))
    assert sorted(e["job"] for e in index) == [0, 1, 2, 3] and {e["status"] for e in index} == {"finished"}
    assert {(e["varied"]["mixer"], e["varied"]["ffn.activation"]) for e in index} == {
        ("mha", "swiglu"), ("mha", "situ_glu"), ("mqa", "swiglu"), ("mqa", "situ_glu")}
    wandb_cli = str(Path(sys.executable).with_name("wandb"))
    for entry in index:
        run_dir = Path(entry["run_dir"])
        local = json.loads((run_dir / "summary.json").read_text())
        assert entry["val"]["loss"] == local["val"]["loss"]
        (run,) = list((run_dir / "wandb").glob("offline-run-*"))
        info = json.loads(subprocess.run([wandb_cli, "leet", "inspect", "--summary", "--json", str(run)],
                                         capture_output=True, text=True, timeout=120).stdout)
        assert info["state"] == "finished" and info["exit_code"] == 0
        assert {f"mixer={entry['varied']['mixer']}", f"ffn.activation={entry['varied']['ffn.activation']}"} <= set(info["tags"])
        assert info["config"]["logger"]["group"] == f"sweep-{sweep_dir.name}"
        records = subprocess.run([wandb_cli, "leet", "inspect", "--json", str(run)], capture_output=True, text=True, timeout=120).stdout
        run_record = next(json.loads(line)["run"] for line in records.splitlines() if '"type":"run"' in line)
        assert run_record["run_group"] == f"sweep-{sweep_dir.name}"
