"""analysis.compare on hand-written run folders: seed aggregation, offline-run paths and clear errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from analysis.compare import collect, compare, main


def fake_run(root: Path, job: int, varied: dict, final_loss: float, sweep: Path) -> None:
    run_dir = root / str(job)
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(
        json.dumps(
            {
                "name": f"run{job}",
                "steps": 10,
                "tokens_per_s": 1000.0,
                "params": 5,
                "active_params": 5,
                "val": {"loss": final_loss, "bpb": final_loss * 1.4427},
            }
        )
    )
    rows = [{"step": s, "train/loss": 5.0 - 0.3 * s} for s in range(10)] + [
        {"step": 4, "val/loss": final_loss + 0.5},
        {"step": 9, "val/loss": final_loss},
    ]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (run_dir / "wandb" / "offline-run-x").mkdir(parents=True)
    with open(sweep / "index.jsonl", "a") as f:
        f.write(
            json.dumps({"job": job, "run_dir": str(run_dir), "status": "finished", "overrides": [], "varied": varied})
            + "\n"
        )


@pytest.fixture
def sweep(tmp_path):
    s = tmp_path / "sweep"
    s.mkdir()
    losses = {("a", "0"): 1.00, ("a", "1"): 1.10, ("b", "0"): 1.04, ("b", "1"): 1.12, ("c", "0"): 2.0, ("c", "1"): 2.02}
    for job, ((opt, seed), loss) in enumerate(losses.items()):
        fake_run(s, job, {"opt": opt, "seed": seed}, loss, s)
    return s


def test_seed_table_marks_differences_within_the_spread(sweep, tmp_path):
    compare([str(sweep)], str(tmp_path / "out"))
    with open(tmp_path / "out" / "seeds.csv") as f:
        rows = {r["opt"]: r for r in csv.DictReader(f)}
    assert float(rows["a"]["val loss mean"]) == pytest.approx(1.05)
    assert float(rows["a"]["val loss std"]) == pytest.approx(0.0707107, rel=1e-5)
    assert rows["a"]["vs best"] == "best"
    assert rows["b"]["vs best"].startswith("~")  # 1.08 vs 1.05: inside a's seed spread
    assert rows["c"]["vs best"] == ""  # 2.01: a real difference


def test_offline_run_directory_resolves_to_its_run(sweep):
    runs = collect([str(sweep / "0" / "wandb" / "offline-run-x")])
    assert len(runs) == 1 and runs[0].summary["name"] == "run0"


def test_not_a_run_is_one_clear_error(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert str(tmp_path) in capsys.readouterr().err


def test_tokens_per_s_is_the_median_logged_step_not_the_compile_inclusive_average(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    fake_run(sweep, 0, {"opt": "logged"}, 1.0, sweep)
    fake_run(sweep, 1, {"opt": "unlogged"}, 1.0, sweep)
    with open(sweep / "0" / "metrics.jsonl", "a") as f:  # summary says 1000 (compilation counted); steps ran at ~4000
        for step, tps in [(9, 3900.0), (19, 4100.0), (29, 4000.0), (39, 100.0)]:
            f.write(json.dumps({"step": step, "perf/tokens_per_s": tps}) + "\n")
    compare([str(sweep)], str(tmp_path / "out"))
    with open(tmp_path / "out" / "table.csv") as f:
        rows = {r["opt"]: r for r in csv.DictReader(f)}
    assert float(rows["logged"]["tokens/s"]) == 3950
    assert float(rows["unlogged"]["tokens/s"]) == 1000  # too short to log a step: the summary's average


def test_runs_with_attnres_get_one_depth_figure_each_named_by_their_options(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    fake_run(sweep, 0, {"point": "block2"}, 1.0, sweep)
    fake_run(sweep, 1, {"point": "plain"}, 1.0, sweep)
    entry = {
        "step": 9,
        "sources": ["embedding", "block 1", "partial"],
        "rows": [
            {"sublayer": "L0.attn", "weights": [1.0, None, None]},
            {"sublayer": "final", "weights": [0.2, 0.5, 0.3]},
        ],
    }
    (sweep / "0" / "depth_weights.json").write_text(json.dumps([entry]))
    result = compare([str(sweep)], str(tmp_path / "out"))
    depth = [Path(p) for p in result["images"] if Path(p).name.startswith("depth_")]
    assert [p.name for p in depth] == ["depth_0_point-block2.png"]  # the plain run has no AttnRes: no figure
    assert depth[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and depth[0].stat().st_size > 5_000
