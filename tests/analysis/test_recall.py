"""MQAR with test segments end to end: training reports accuracy per segment and the decoding state size;
analysis.compare tabulates and plots recall against width and state size, one line per mixer."""

from __future__ import annotations

import json
from pathlib import Path

from analysis.compare import compare

SMALL = [
    "experiment=mqar_segments",
    "data.seq_len=64",
    "data.batch_size=8",
    "trainer.max_steps=3",
    "trainer.val_check_interval=3",
    "trainer.enable_progress_bar=false",
    "trainer.max_time_minutes=null",
    "logger=csv",
    "data.train_segments=[{seq_len:32,num_kv_pairs:4,num_examples:32},{seq_len:64,num_kv_pairs:8,num_examples:32}]",
    "data.test_segments=[{seq_len:32,num_kv_pairs:4,num_examples:8},{seq_len:128,num_kv_pairs:16,num_examples:8}]",
]


def test_segments_train_report_and_compare(tmp_path, train_run):
    run_dir = train_run(*SMALL, "mixer=mha", f"output_root={tmp_path / 'runs'}").run_dir
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {"accuracy/T32_P4", "accuracy/T128_P16", "accuracy"} <= set(summary["val"])
    # MHA, 2 layers, 4 heads of 16: keys and values of every layer grow with each token; nothing is fixed
    assert summary["decode_state_numbers"] == {"per_token": 2 * 2 * 4 * 16, "fixed": 0} and summary["d_model"] == 64

    from analysis.evaluate import main as evaluate

    assert evaluate([str(run_dir), "--lengths", "2x"]) == 2  # MQAR has segments, not a validation stream to lengthen

    # a second line: a recurrent model whose state does not grow (hand-written, as a run folder holds it)
    kda = tmp_path / "kda_run"
    kda.mkdir()
    (kda / "summary.json").write_text(
        json.dumps(
            {
                "name": "kda",
                "steps": 3,
                "d_model": 64,
                "decode_state_numbers": {"per_token": 0, "fixed": 9000},
                "val": {"loss": 1.0, "accuracy": 0.5, "accuracy/T32_P4": 0.75, "accuracy/T128_P16": 0.25},
            }
        )
    )
    out = compare([str(run_dir), str(kda)], str(tmp_path / "cmp"))
    assert {Path(p).name for p in out["images"]} >= {"recall_width.png", "recall_state.png"}
    rows = (tmp_path / "cmp" / "recall.csv").read_text().splitlines()
    assert rows[0] == "mixer,d_model,n_layers,state numbers per token,fixed state numbers,T32 P4,T128 P16"
    assert any(r.startswith("kda,64,,0,9000,0.75,0.25") for r in rows)  # a summary without n_layers: blank
    mha_row = next(r for r in rows[1:] if not r.startswith("kda"))
    assert mha_row.split(",")[2] == str(summary["n_layers"])
    assert mha_row.split(",")[5] == str(summary["val"]["accuracy/T32_P4"])


def test_recall_state_axis_is_the_state_at_each_segment_length():
    from analysis.recall import state_numbers

    class R:
        summary = {"decode_state_numbers": {"per_token": 256, "fixed": 10}}

    assert state_numbers(R(), 128) == 256 * 128 + 10
    R.summary = {}
    assert state_numbers(R(), 128) is None


def test_a_point_swept_over_learning_rates_is_shown_at_its_best(tmp_path):
    """Zoology reports each (mixer, width) at its best learning rate: runs that differ only in
    optimizer.lr become one row and one plotted point, the run with the highest mean segment accuracy;
    runs of another depth are another point."""
    from analysis.compare import Run
    from analysis.recall import best_runs, plot, table

    def run(point, d, lr, short, long, layers=2):
        summary = {
            "d_model": d,
            "n_layers": layers,
            "decode_state_numbers": {"per_token": 8 * d, "fixed": 0},
            "val": {"accuracy/T64_P4": short, "accuracy/T128_P16": long},
        }
        return Run(
            tmp_path, f"{point} {d} {lr}", {"point": point, "model.d_model": str(d), "optimizer.lr": lr}, summary, []
        )

    runs = [
        run("mha", 64, "0.001", 0.9, 0.1),
        run("mha", 64, "0.003", 0.2, 0.95),
        run("mha", 128, "0.001", 1.0, 0.9),
        run("mha", 128, "0.003", 0.3, 0.3),
        run("kda", 64, "0.003", 0.99, 0.8),
        run("mha", 64, "0.001", 0.1, 0.1, layers=4),
        run("mha", 64, "0.003", 0.5, 0.4, layers=4),
    ]
    header, rows = table(runs)
    assert header[:4] == ["mixer", "d_model", "n_layers", "best optimizer.lr"]
    assert header[-2:] == ["T64 P4", "T128 P16"]
    assert [r[:4] + r[-2:] for r in rows] == [
        ["kda", 64, 2, "0.003", 0.99, 0.8],
        ["mha", 64, 2, "0.003", 0.2, 0.95],
        ["mha", 64, 4, "0.003", 0.5, 0.4],
        ["mha", 128, 2, "0.001", 1.0, 0.9],
    ]
    assert len(best_runs(runs)) == 4
    assert plot(runs, tmp_path, "width").name == "recall_width.png"
