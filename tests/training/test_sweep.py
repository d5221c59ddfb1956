"""A 2x2 multirun: four finished offline W&B runs in one group, tagged with the varied options, and a
local index of the sweep's runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.jsonl_logger import read_metrics
from runtime.sweep_job import read_index
from tests.helpers import FAST, run_train


@pytest.mark.slow
def test_two_by_two_multirun_groups_tags_and_indexes(tmp_path):
    result = run_train(
        "-m",
        "mixer=mha,mqa",
        "ffn.activation=swiglu,situ_glu",
        *FAST,
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "logger=wandb",
        f"output_root={tmp_path}",
        env={"WANDB_MODE": "offline"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (sweep_dir,) = list((tmp_path / "sweeps").iterdir())
    index = read_index(str(sweep_dir))
    assert sorted(e["job"] for e in index) == [0, 1, 2, 3] and {e["status"] for e in index} == {"finished"}
    assert {(e["varied"]["mixer"], e["varied"]["ffn.activation"]) for e in index} == {
        ("mha", "swiglu"),
        ("mha", "situ_glu"),
        ("mqa", "swiglu"),
        ("mqa", "situ_glu"),
    }
    wandb_cli = str(Path(sys.executable).with_name("wandb"))
    for entry in index:
        run_dir = Path(entry["run_dir"])
        local = json.loads((run_dir / "summary.json").read_text())
        assert entry["val"]["loss"] == local["val"]["loss"]
        (run,) = list((run_dir / "wandb").glob("offline-run-*"))
        info = json.loads(
            subprocess.run(
                [wandb_cli, "leet", "inspect", "--summary", "--json", str(run)],
                capture_output=True,
                text=True,
                timeout=120,
            ).stdout
        )
        assert info["state"] == "finished" and info["exit_code"] == 0
        assert {f"mixer={entry['varied']['mixer']}", f"ffn.activation={entry['varied']['ffn.activation']}"} <= set(
            info["tags"]
        )
        assert info["config"]["logger"]["group"] == f"sweep-{sweep_dir.name}"
        assert info["config"]["sweep"] == {
            "group": f"sweep-{sweep_dir.name}",
            **entry["varied"],
        }  # varied options as config fields
        records = subprocess.run(
            [wandb_cli, "leet", "inspect", "--json", str(run)], capture_output=True, text=True, timeout=120
        ).stdout
        run_record = next(json.loads(line)["run"] for line in records.splitlines() if '"type":"run"' in line)
        assert run_record["run_group"] == f"sweep-{sweep_dir.name}"

    # analysis.compare on the sweep: table numbers are the runs' logged values; real figures
    import csv

    from analysis.compare import compare

    out = tmp_path / "cmp"
    result = compare([str(sweep_dir)], str(out), make_html=True)
    assert result["runs"] == 4
    with open(out / "table.csv") as f:
        rows = list(csv.DictReader(f))
    by_point = {(r["mixer"], r["ffn.activation"]): r for r in rows}
    for entry in index:
        row = by_point[(entry["varied"]["mixer"], entry["varied"]["ffn.activation"])]
        logged = [m["val/loss"] for m in read_metrics(str(Path(entry["run_dir"]) / "metrics.jsonl")) if "val/loss" in m]
        assert float(row["val loss (final)"]) == entry["val"]["loss"]
        assert float(row["val loss (best)"]) == min(logged + [entry["val"]["loss"]])
        assert float(row["val bpb (final)"]) == entry["val"]["bpb"]
        assert int(row["steps"]) == 2 and int(row["params"]) == entry["params"]
    for image in result["images"]:
        assert Path(image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "loss.png" in (out / "index.html").read_text()
