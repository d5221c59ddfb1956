"""A whole (tiny) associative-recall study of a mixer decision through train.py: both arms train MQAR at
each rate, the table keeps each point's best rate with its accuracy per segment, the decoding state and
the ladder's loss beside it, and the state figure is drawn."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from sweeps import ladder

TINY_PRESET = """
rungs: [[16, 4], [32, 4]]
tokens_per_param: 0.3
seeds: [0]
lr: {base: 3.0e-3}
overrides: [data=corpus, data.seq_len=64, data.batch_size=4, trainer.precision=32-true, trainer.compile=false,
  logger=csv, trainer.enable_progress_bar=false]
recall:
  rungs: [[16, 4]]
  overrides: [data=mqar, data.vocab_size=64, data.seq_len=32,
    "data.train_segments=[{seq_len:32,num_kv_pairs:4,num_examples:32}]",
    "data.test_segments=[{seq_len:32,num_kv_pairs:4,num_examples:8},{seq_len:64,num_kv_pairs:8,num_examples:8}]"]
  steps: 6
  batch_size: 4
  lrs: [1.0e-3, 3.0e-3]
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_recall_study_trains_both_arms_and_tabulates_each_points_best_rate(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    preset = tmp_path / "tiny.yaml"
    preset.write_text(TINY_PRESET)
    loss_table = tmp_path / "ladders" / "kda_hybrid-tiny" / "ladder.csv"
    loss_table.parent.mkdir(parents=True)
    loss_table.write_text("arm,rung,seed,val_bpb\nbaseline,d16x4,0,3.25\nvariant,d16x4,0,3.5\n")
    argv = ["kda_hybrid", "--recall", "--preset", str(preset), "--jobs", "2", "--output-root", str(tmp_path)]
    assert ladder.main(argv) == 0
    folder = tmp_path / "ladders" / "kda_hybrid-tiny-recall"
    with open(folder / "recall.csv") as f:
        rows = {row["arm"]: row for row in csv.DictReader(f)}
    assert set(rows) == {"baseline", "variant"}
    for arm, row in rows.items():
        assert row["rung"] == "d16x4" and row["lr"] in ("0.001", "0.003")
        assert 0 <= float(row["accuracy/T32_P4"]) <= 1 and 0 <= float(row["accuracy/T64_P8"]) <= 1
        assert Path(row["run_dir"]).is_dir()
    # MLA in every layer caches per token and holds nothing fixed; KDA's three layers hold a fixed state
    assert int(rows["baseline"]["state_fixed"]) == 0 < int(rows["baseline"]["state_per_token"])
    assert int(rows["variant"]["state_fixed"]) > 0
    assert int(rows["variant"]["state_per_token"]) < int(rows["baseline"]["state_per_token"])
    assert (float(rows["baseline"]["ladder_val_bpb"]), float(rows["variant"]["ladder_val_bpb"])) == (3.25, 3.5)
    assert (folder / "recall_state.png").stat().st_size > 0 and (folder / "recall.md").is_file()
    assert len(list((folder / "curves").glob("*.csv"))) == 4
    assert {row["lrs_failed"] for row in rows.values()} == {""}
    # run again: every run is finished, nothing trains (no summary rewritten), the same table
    before = (folder / "recall.csv").read_text()
    summaries = {p: p.stat().st_mtime_ns for p in tmp_path.glob("ladders/runs-tiny-recall-*/*/summary.json")}
    assert len(summaries) == 4
    capsys.readouterr()
    assert ladder.main(argv) == 0
    assert "to run" not in capsys.readouterr().out
    assert (folder / "recall.csv").read_text() == before
    assert {p: p.stat().st_mtime_ns for p in summaries} == summaries
