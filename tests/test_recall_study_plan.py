"""The associative-recall study of a mixer decision (sweeps/recall_study.py), planned and tabulated
without training: both arms at every rung on MQAR, paired in seed, batch and steps, the best rate per
point, and the ladder's loss beside it."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from runtime.rate_probe import Rate
from sweeps import ladder, ladder_plan
from sweeps.recall_study import ladder_bpb, plan_recall, recall_preset, recall_rows


def _arms(decision: str) -> dict[str, list[str]]:
    d = ladder_plan.load_decision(decision)
    return {arm: d[arm] for arm in ladder_plan.ARMS}


def test_both_arms_train_recall_at_every_rung_with_the_same_examples():
    p = ladder_plan.load_preset("cpu")
    study = recall_preset(p)
    runs = plan_recall("kda_hybrid", study, [], _arms("kda_hybrid"))
    spec = p.recall
    assert study.rungs == p.rungs and study.name == "cpu-recall"
    assert len(runs) == 2 * len(p.rungs) * len(study.seeds) * len(spec["lrs"])
    assert len({r.name for r in runs}) == len(runs)
    for run in runs:
        twin = next(r for r in runs if r.arm != run.arm and (r.rung, r.seed, r.lr) == (run.rung, run.seed, run.lr))
        assert (twin.run_seed, twin.batch_rows, twin.steps, twin.warmup) == (
            run.run_seed,
            run.batch_rows,
            run.steps,
            run.warmup,
        )
        assert run.steps == spec["steps"] and run.batch_rows == spec["batch_size"]
        argv = ladder_plan.run_overrides(run, _arms("kda_hybrid")[run.arm], study, [], Path("/r"))
        # the task replaces the preset's data; the preset's trainer settings stay
        assert "data=mqar" in argv and "data=corpus" not in argv and "data.seq_len=64" in argv
        assert "trainer.precision=32-true" in argv and f"optimizer.lr={run.lr:.6g}" in argv
        assert f"model.d_model={run.rung.d_model}" in argv
    # the runs' shapes are the ladder's: the same parameters outside the embedding at a rung
    ladder_runs = ladder_plan.plan("kda_hybrid", p, [], _arms("kda_hybrid"))
    for run in runs:
        twin = next(r for r in ladder_runs if (r.arm, r.rung) == (run.arm, run.rung))
        assert run.size.non_embedding_params == twin.size.non_embedding_params
    assert ladder_plan.runs_folder(Path("/o"), study, []) != ladder_plan.runs_folder(Path("/o"), p, [])


@pytest.mark.parametrize(
    "section, named",
    [
        ({}, "has no recall: section"),
        (
            {"overrides": ["data=mqar"], "steps": 1, "batch_size": 4, "lrs": [1e-3], "rung": [32, 4]},
            "unknown keys rung",
        ),
        ({"overrides": ["data=mqar"], "steps": 10, "lrs": [1e-3]}, "missing batch_size"),
        ({"overrides": ["data=corpus"], "steps": 10, "batch_size": 4, "lrs": [1e-3]}, "must choose the recall task"),
        ({"overrides": ["data=mqar"], "steps": 10, "batch_size": 4, "lrs": []}, "lrs: a non-empty list"),
        ({"overrides": ["data=mqar"], "steps": 0, "batch_size": 4, "lrs": [1e-3]}, "steps: must be a at least 1 int"),
        ({"overrides": ["data=mqar"], "steps": "abc", "batch_size": 4, "lrs": [1e-3]}, "recall.steps: must be"),
        ({"overrides": ["data=mqar"], "steps": 1, "batch_size": 4, "lrs": [3e-3, 0.003]}, "lrs: .* repeats a value"),
        ({"overrides": ["data=mqar"], "steps": 1, "batch_size": 4, "lrs": [1e-3], "rungs": [32, 8]}, "pairs, got"),
        (
            {"overrides": ["data=mqar"], "steps": 1, "batch_size": 4, "lrs": [1e-3], "seeds": [0, 0]},
            "seeds: .* repeats",
        ),
    ],
)
def test_a_bad_recall_section_is_refused_by_name(section, named):
    bad = ladder_plan.replace(ladder_plan.load_preset("cpu"), recall=section)
    with pytest.raises(ladder_plan.LadderError, match=named):
        recall_preset(bad)


def test_the_recall_dry_run_lists_its_runs_and_other_studies_are_refused_beside_it(capsys):
    assert ladder.main(["kda_hybrid", "--recall", "--dry-run", "--measure-steps", "0"]) == 0
    out = capsys.readouterr().out
    assert "preset cpu-recall" in out and "k3_small-d64x4-mqar-s0-lr0.03" in out
    assert ladder.main(["kda_hybrid", "--recall", "--local", "--dry-run"]) == 2
    assert "--local and --recall are different studies" in capsys.readouterr().err
    assert ladder.main(["kda_hybrid", "--recall", "--preset", "cpu_depth", "--rung", "32x8", "--dry-run"]) == 2
    assert "preset cpu_depth has no recall: section" in capsys.readouterr().err


def test_the_recall_study_at_one_rung_reads_the_whole_ladders_loss(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(ladder, "run_recall", lambda *args: seen.update(preset=args[1], table=args[-1]))
    assert ladder.main(["kda_hybrid", "--recall", "--rung", "64x4", "--output-root", str(tmp_path)]) == 0
    assert seen["table"] == tmp_path.resolve() / "ladders" / "kda_hybrid-cpu" / "ladder.csv"
    study = recall_preset(seen["preset"])
    assert study.rungs == [ladder_plan.Rung(64, 4)] and study.name == "cpu-d64x4-recall"


def test_the_recall_section_shapes_only_the_recall_studys_runs_folder():
    p = ladder_plan.load_preset("cpu")
    without = ladder_plan.replace(p, recall={})
    # the ladder's, the local comparison's and the sensitivity study's runs folders ignore the section
    assert ladder_plan.runs_folder(Path("/o"), p, []) == ladder_plan.runs_folder(Path("/o"), without, [])
    local = [ladder_plan.runs_folder(Path("/o"), ladder_plan.local_preset(q), []) for q in (p, without)]
    assert local[0] == local[1]
    study = recall_preset(p)
    changed = recall_preset(ladder_plan.replace(p, recall={**p.recall, "steps": 2 * p.recall["steps"]}))
    first = ladder_plan.runs_folder(Path("/o"), study, [], study=study.recall)
    assert first != ladder_plan.runs_folder(Path("/o"), changed, [], study=changed.recall)
    assert first != ladder_plan.runs_folder(Path("/o"), p, [])


def test_the_recall_runs_count_in_the_time_estimate():
    p = ladder_plan.load_preset("cpu")
    study = ladder_plan.replace(recall_preset(p), rungs=p.rungs[:1])
    runs = plan_recall("kda_hybrid", study, [], _arms("kda_hybrid"))
    rate = Rate(tokens_per_s=1000.0, overhead_s=0.0)
    assert ladder_plan.scheduled_seconds(runs, {"d16x4": rate}, 1) == pytest.approx(
        sum(r.tokens for r in runs) / 1000.0
    )


FROZEN_PRESET = """
rungs: [[16, 4], [32, 4]]
tokens_per_param: 20
seeds: [0, 1]
lr: {base: 1.0e-2}
overrides: [data=corpus]
"""


def test_runs_folders_keep_their_names_where_a_preset_has_no_recall_section(tmp_path):
    """A runs folder's name hashes the preset's settings: the recall section, added after ladders had run,
    counts only for the recall study's own runs, so the ladders' runs are found again instead of trained
    anew (and stay found when the section changes)."""
    path = tmp_path / "frozen.yaml"
    path.write_text(FROZEN_PRESET)
    p = ladder_plan.load_preset(str(path))
    assert ladder_plan.runs_folder(Path("/o"), p, []).name == "runs-frozen-9751524d"  # as named before the section
    with_section = ladder_plan.replace(p, recall={"steps": 1})
    assert ladder_plan.runs_folder(Path("/o"), with_section, []).name == "runs-frozen-9751524d"
    assert ladder_plan.runs_folder(Path("/o"), with_section, [], study={"steps": 1}).name != "runs-frozen-9751524d"


def _summary(d_model: int, acc: list[float], per_token: int, fixed: int) -> dict:
    val = {f"accuracy/T{t}_P{p}": a for (t, p), a in zip([(64, 4), (256, 64)], acc)}
    return {"d_model": d_model, "n_layers": 4, "val": val, "run_dir": f"/runs/{d_model}",
            "decode_state_numbers": {"per_token": per_token, "fixed": fixed}}  # fmt: skip


def test_the_table_keeps_each_points_best_rate_and_sets_the_ladders_loss_beside_it(tmp_path):
    p = ladder_plan.load_preset("cpu")
    study = ladder_plan.replace(
        recall_preset(p), rungs=p.rungs[:2], recall={**recall_preset(p).recall, "lrs": [1e-3, 3e-3, 1e-2]}
    )
    runs = plan_recall("kda_hybrid", study, [], _arms("kda_hybrid"))
    best_rate = {("variant", 16): 1e-2, ("baseline", 16): 3e-3, ("baseline", 32): 1e-3, ("variant", 32): 3e-3}
    summaries = {}
    for r in runs:
        if (r.arm, r.rung.d_model, r.lr) == ("variant", 32, 1e-2):
            continue  # diverged: no summary
        score = 0.1 if r.lr == best_rate[(r.arm, r.rung.d_model)] else 0.0
        # the variant (fixed state) loses recall on the long segment
        long = 0.3 if r.arm == "variant" else 0.9
        per_token, fixed = (4, 900) if r.arm == "variant" else (16, 0)
        summaries[r.name] = _summary(r.rung.d_model, [0.8 + score, long + score], per_token, fixed)
    table = tmp_path / "ladder.csv"
    with open(table, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arm", "rung", "seed", "val_bpb"])
        w.writerows([["baseline", "d16x4", 0, 3.0], ["baseline", "d16x4", 1, 3.2], ["baseline", "d16x4@tpp10", 0, 9.0],
                     ["variant", "d16x4", 0, 2.9], ["variant", "d32x4", 0, "nan"]])  # fmt: skip
    bpb = ladder_bpb(table)
    assert bpb == pytest.approx({("baseline", "d16x4"): 3.1, ("variant", "d16x4"): 2.9})
    assert ladder_bpb(tmp_path / "missing.csv") == {}
    labels = {arm: arm for arm in ladder_plan.ARMS}
    header, rows, best = recall_rows("kda_hybrid", runs, summaries, labels, bpb)
    assert header[header.index("state_fixed") + 1 : header.index("ladder_val_bpb")] == [
        "accuracy/T64_P4",
        "accuracy/T256_P64",
    ]
    got = {(row[1], row[2]): dict(zip(header, row)) for row in rows}
    assert len(rows) == len(best) == 4
    for (arm, d), lr in best_rate.items():
        assert got[(arm, f"d{d}x4")]["lr"] == f"{lr:g}"
    assert [got[k]["lr_edge"] for k in sorted(got)] == ["", "low", "high", ""]  # interior best: no edge
    assert got[("variant", "d32x4")]["lrs_failed"] == "0.01" and got[("variant", "d16x4")]["lrs_failed"] == ""
    assert got[("variant", "d16x4")]["accuracy/T256_P64"] == pytest.approx(0.4)
    assert got[("baseline", "d16x4")]["ladder_val_bpb"] == pytest.approx(3.1)
    assert got[("variant", "d32x4")]["ladder_val_bpb"] == ""
    assert (got[("variant", "d16x4")]["state_per_token"], got[("variant", "d16x4")]["state_fixed"]) == (4, 900)
    # two rates give no edge: one of them is always best
    two = [r for r in runs if r.lr != 1e-2]
    _, rows2, _ = recall_rows("kda_hybrid", two, summaries, labels, bpb)
    assert {row[header.index("lr_edge")] for row in rows2} == {""}
    # a point whose every rate failed stops the table, by name
    lost = {k: v for k, v in summaries.items() if not k.startswith("k3_small-d32x4")}
    with pytest.raises(ladder_plan.LadderError, match="every rate failed for variant d32x4 seed 0"):
        recall_rows("kda_hybrid", runs, lost, labels, bpb)
