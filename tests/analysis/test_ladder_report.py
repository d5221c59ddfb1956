"""``python -m analysis.ladder_report``: from a ladder table to ``fits.json``, ``table.md`` and the figures; a
table it cannot use is refused with one line naming the problem, exit status 2, and nothing written."""

from __future__ import annotations

import csv
import json
import random

import pytest

from analysis.ladder_report import FIGURES, main, read_rows
from runtime.cli import ToolError
from tests.analysis.synthetic_ladder import synthetic_runs, write_ladder_csv
from tests.helpers import run_python


@pytest.fixture
def ladder_dir(tmp_path):
    folder = tmp_path / "ladder"
    folder.mkdir()
    write_ladder_csv(folder / "ladder.csv", synthetic_runs(rng_seed=11))
    return folder


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _write(path, rows, columns=None):
    columns = columns or list(rows[0])
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def test_the_report_writes_every_output(ladder_dir, capsys):
    assert main([str(ladder_dir), "--bootstrap", "200", "--target-flops", "1e17", "--confidence", "0.95"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("k = ") and "wrote" in out
    figures = [*FIGURES, "stability_max_activation.png", "stability_grad_norm_spikes.png"]
    for name in ["fits.json", "table.md", *figures]:
        assert (ladder_dir / name).is_file() and (ladder_dir / name).stat().st_size > 0, name
    assert not (ladder_dir / "stability_maxvio.png").exists()  # the column is empty in every run
    fits = json.loads((ladder_dir / "fits.json").read_text())  # strict JSON: no NaN or Infinity
    assert fits["decision"] == "block_attnres" and fits["metric"] == "val_bpb" and fits["confidence"] == 0.95
    # 100 replicates give the 95% intervals but not the 99% rollout check and A/A null: no verdict called
    assert fits["k"]["status"] == "ok" and fits["k"]["verdict"] is None and fits["k"]["interval"][0] > 1
    assert "variant better by its interval, not called" in fits["k"]["verdict_withheld"]
    assert not fits["guards"]["rollout_shared"]["passed"] and fits["guards"]["screen"]["passed"]
    assert [x["label"] for x in fits["extrapolations"]] == ["10x largest", "100x largest", "target"]
    assert fits["extrapolations"][2]["compute"] == 1e17 and "needs at least 1000" in fits["aa"]["reason"]
    assert len(fits["cells"]) == 10 and len(fits["rung_multipliers"]) == 5 and fits["figures"] == figures
    table = (ladder_dir / "table.md").read_text()
    for heading in [
        "## Runs per arm and rung",
        "## Compute multiplier at each rung (no fit)",
        "## Fits",
        "## Rollout check",
        "## A/A null",
        "## Guards on the fitted verdicts",
        "## Extrapolation",
        "## Stability metrics",
        "## Learning rates at the edge of their sweep",
    ]:
        assert heading in table, heading
    assert "(at the high edge of its sweep)" in table and "- variant r0: lr" in table


def test_permuting_the_rows_leaves_the_report_unchanged(ladder_dir, tmp_path):
    rows = _rows(ladder_dir / "ladder.csv")
    random.Random(1).shuffle(rows)
    other = tmp_path / "shuffled"
    other.mkdir()
    _write(other / "ladder.csv", rows)
    for folder in (ladder_dir, other):
        assert main([str(folder), "--bootstrap", "100"]) == 0
    a, b = (json.loads((f / "fits.json").read_text()) for f in (ladder_dir, other))
    a.pop("source"), b.pop("source")
    assert a == b
    assert (ladder_dir / "table.md").read_text() == (other / "table.md").read_text()


def _broken(folder, edit):
    rows = _rows(folder / "ladder.csv")
    columns = list(rows[0])
    rows, columns = edit(rows, columns)
    _write(folder / "ladder.csv", rows, columns)


def _drop_column(rows, columns):
    return rows, [c for c in columns if c != "train_flops"]


def _one_rung(rows, columns):
    return [r for r in rows if r["arm"] == "baseline" or r["rung"] == "r0"], columns


def _not_a_number(rows, columns):
    rows[3]["val_bpb"] = "n/a"
    return rows, columns


def _negative_flops(rows, columns):
    rows[0]["train_flops"] = "-1"
    return rows, columns


def _duplicate(rows, columns):
    return rows + [dict(rows[0])], columns


def _bad_arm(rows, columns):
    rows[1]["arm"] = "treatment"
    return rows, columns


def _two_decisions(rows, columns):
    rows[0]["decision"] = "other"
    return rows, columns


BAD_TABLES = {
    "missing column": (_drop_column, "ladder.csv: missing column(s) train_flops"),
    "one rung": (_one_rung, "the variant has 1 rung(s) (r0); a ladder needs at least 2"),
    "not a number": (_not_a_number, "ladder.csv line 5: val_bpb 'n/a' is not a number"),
    "negative compute": (_negative_flops, "ladder.csv line 2: train_flops '-1' must be positive"),
    "duplicated run": (_duplicate, "the same run (baseline, r0, 0) twice"),
    "bad arm": (_bad_arm, "line 3: arm 'treatment' is neither baseline nor variant"),
    "two decisions": (_two_decisions, "holds 2 decisions (block_attnres, other); choose one with --decision"),
}


@pytest.mark.parametrize("case", BAD_TABLES)
def test_a_bad_table_is_refused_by_name_and_nothing_is_written(ladder_dir, capsys, case):
    edit, message = BAD_TABLES[case]
    _broken(ladder_dir, edit)
    assert main([str(ladder_dir), "--bootstrap", "100"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("analysis.ladder_report: error: ") and message in err, err
    assert sorted(p.name for p in ladder_dir.iterdir()) == ["ladder.csv"]


def test_a_missing_ladder_is_refused(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "nowhere: no such file or folder" in capsys.readouterr().err
    assert main([str(tmp_path)]) == 2
    assert "no ladder.csv in this folder" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_an_out_that_is_a_file_is_refused(ladder_dir, capsys):
    (ladder_dir / "report").write_text("mine")
    assert main([str(ladder_dir), "--out", str(ladder_dir / "report")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert (ladder_dir / "report").read_text() == "mine" and not (ladder_dir / "fits.json").exists()


@pytest.mark.parametrize(
    "option, message",
    [
        (["--confidence", "1.5"], "argument --confidence: must be <= 0.999"),
        (["--bootstrap", "0"], "argument --bootstrap: must be >= 1"),
        (["--target-flops", "-5"], "argument --target-flops: must be > 0"),
        (["--metric", "accuracy"], "argument --metric: invalid choice"),
    ],
)
def test_a_bad_option_is_refused_by_name(ladder_dir, capsys, option, message):
    with pytest.raises(SystemExit) as exit_:
        main([str(ladder_dir), *option])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_too_few_replicates_for_the_interval_are_refused_by_flag_name(ladder_dir, capsys):
    assert main([str(ladder_dir), "--confidence", "0.99", "--bootstrap", "100"]) == 2
    err = capsys.readouterr().err
    assert "--bootstrap 100 is too few for a 99% interval (--confidence 0.99): at least 1000" in err
    assert sorted(p.name for p in ladder_dir.iterdir()) == ["ladder.csv"]


def test_several_decisions_and_token_multiples_are_chosen_by_option(ladder_dir, tmp_path, capsys):
    rows = _rows(ladder_dir / "ladder.csv")
    rows = rows + [{**r, "decision": "situ_glu"} for r in rows]
    _write(tmp_path / "both.csv", [{**r, "tokens_per_param": m} for m in ("20", "40") for r in rows])
    decision, chosen = read_rows(tmp_path / "both.csv", "situ_glu", 40.0)
    assert decision == "situ_glu" and len(chosen) == 20 and {r["tokens_per_param"] for r in chosen} == {40.0}
    with pytest.raises(ToolError, match=r"several token multiples \(20, 40\); choose one with --tokens-per-param"):
        read_rows(tmp_path / "both.csv", "situ_glu")
    with pytest.raises(ToolError, match="no runs of decision 'k3'"):
        read_rows(tmp_path / "both.csv", "k3", 40.0)
    argv = [str(tmp_path / "both.csv"), "--bootstrap", "100", "--decision", "situ_glu", "--tokens-per-param", "40"]
    assert main(argv) == 0
    fits = json.loads((tmp_path / "fits.json").read_text())
    assert fits["decision"] == "situ_glu" and fits["tokens_per_param"] == 40


def test_a_ladder_too_small_to_fit_is_reported_not_refused(ladder_dir):
    """Two rungs are a valid table: the fits report why they cannot run; the per-rung multipliers stand."""
    _broken(ladder_dir, lambda rows, cols: ([r for r in rows if r["rung"] in ("r0", "r1")], cols))
    assert main([str(ladder_dir), "--bootstrap", "100"]) == 0
    fits = json.loads((ladder_dir / "fits.json").read_text())
    assert fits["k"]["estimate"] is None and "too few points" in fits["k"]["reason"]
    assert fits["rung_multipliers"][0]["status"] == "ok"
    assert "too few points" in (ladder_dir / "table.md").read_text()


def test_the_module_runs_from_the_command_line_into_out(ladder_dir, tmp_path):
    """The CSV named instead of its folder, the outputs in --out, the loss in nats fitted instead."""
    out = tmp_path / "report" / "nested"
    argv = [str(ladder_dir / "ladder.csv"), "--bootstrap", "100", "--out", str(out), "--metric", "val_loss"]
    proc = run_python("-m", "analysis.ladder_report", *argv, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "fits.json").read_text())["metric"] == "val_loss"
    assert not (ladder_dir / "fits.json").exists()
    proc = run_python("-m", "analysis.ladder_report", str(ladder_dir / "missing.csv"), timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "missing.csv" in proc.stderr
