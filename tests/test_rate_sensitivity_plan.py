"""The studies beside the width ladder, planned without training: the depth ladder (one width at 4, 8 and
16 layers) and the learning-rate sensitivity study (sweeps/rate_sensitivity.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from sweeps import ladder, ladder_plan
from sweeps.rate_sensitivity import DEFAULT_FACTORS, plan_sensitivity, sensitivity_preset


def _arms(decision: str) -> dict[str, list[str]]:
    d = ladder_plan.load_decision(decision)
    return {arm: d[arm] for arm in ladder_plan.ARMS}


def test_the_depth_ladder_holds_the_width_and_doubles_the_depth():
    """Block AttnRes over depth: d32 at 4, 8 and 16 layers (2, 4 and 8 blocks of 2 layers), every rung at
    least 1,000 steps under the rung rule, and the local comparison at the deepest rung."""
    p = ladder_plan.load_preset("cpu_depth")
    runs = ladder_plan.plan("block_attnres", p, [], _arms("block_attnres"))
    assert {r.rung.d_model for r in runs} == {32} and [r.n_layers for r in p.rungs] == [4, 8, 16]
    assert min(r.steps for r in runs) >= p.min_steps == 1000
    stable = {(r.arm, r.rung.n_layers): r for r in runs if r.phase == "stable" and r.seed == 0}
    for depth in (4, 8, 16):
        # more layers, more parameters: the batch follows them, the arms stay the same size
        assert stable[("variant", depth)].batch_rows == stable[("baseline", depth)].batch_rows
        a, b = stable[("baseline", depth)].size.active_params, stable[("variant", depth)].size.active_params
        assert abs(a - b) < 0.02 * a
    assert stable[("baseline", 16)].size.active_params > 2.5 * stable[("baseline", 4)].size.active_params
    assert ladder_plan.local_preset(p).rungs == [ladder_plan.Rung(32, 16)]
    argv = ladder_plan.run_overrides(stable[("variant", 16)], ["experiment=k3_small"], p, [], Path("/r"))
    assert "model.n_layers=16" in argv and "model.d_model=32" in argv


def test_the_sensitivity_study_sweeps_the_same_rates_in_both_arms():
    p = ladder_plan.load_preset("cpu")
    study = sensitivity_preset(p)
    runs = plan_sensitivity("latent_norm", study, [], _arms("latent_norm"))
    spec = p.sensitivity
    assert study.rungs == [ladder_plan.Rung(*spec["rung"])] and study.branch_multiples == []
    factors = sorted(spec.get("factors", DEFAULT_FACTORS))
    assert len(runs) == 2 * len(factors) * len(study.seeds)
    rates = {arm: sorted({r.lr for r in runs if r.arm == arm}) for arm in ladder_plan.ARMS}
    assert rates["baseline"] == rates["variant"] == [p.lr_base * f for f in factors]
    assert math.log2(rates["baseline"][-1] / rates["baseline"][0]) >= 6  # a wide sweep: 64x or more
    for run in runs:
        twin = next(r for r in runs if r.arm != run.arm and r.seed == run.seed and r.lr_factor == run.lr_factor)
        assert (twin.run_seed, twin.batch_rows, twin.warmup) == (run.run_seed, run.batch_rows, run.warmup)
        assert run.steps >= p.min_steps and run.phase == "stable" and run.checkpoint_every is None
        argv = ladder_plan.run_overrides(run, ["experiment=k3_small"], study, [], Path("/r"))
        assert f"optimizer.lr={run.lr:.6g}" in argv
    assert len({r.name for r in runs}) == len(runs)
    assert ladder_plan.runs_folder(Path("/o"), study, []) != ladder_plan.runs_folder(Path("/o"), p, [])


def test_a_bad_sensitivity_section_is_refused_by_name(tmp_path):
    bad = ladder_plan.replace(ladder_plan.load_preset("cpu"), sensitivity={"rungs": [32, 4]})
    with pytest.raises(ladder_plan.LadderError, match="sensitivity: unknown keys rungs"):
        sensitivity_preset(bad)
    few = ladder_plan.replace(ladder_plan.load_preset("cpu"), sensitivity={"factors": [1, 2]})
    with pytest.raises(ladder_plan.LadderError, match="at least 3 rates"):
        sensitivity_preset(few)


def test_the_sensitivity_dry_run_lists_its_runs(capsys):
    assert ladder.main(["latent_norm", "--rate-sensitivity", "--dry-run", "--measure-steps", "0"]) == 0
    out = capsys.readouterr().out
    assert "preset cpu-sensitivity" in out and "-lrx16 " in out and "-lrx0.125 " in out
    assert ladder.main(["latent_norm", "--rate-sensitivity", "--local", "--dry-run"]) == 2


def test_rung_moves_a_study_to_another_rung_with_folders_of_its_own(capsys):
    """--rung: the local comparison of the depth preset at 8 layers instead of 16, under its own name (its
    runs folder and its comparison folder stand apart from the 16-layer one); a plain ladder refuses it."""
    p = ladder_plan.load_preset("cpu_depth")
    at8 = ladder.at_rung(p, ladder.parse_rung("32x8"), "--local")
    assert ladder_plan.local_preset(at8).rungs == [ladder_plan.Rung(32, 8)]
    assert ladder_plan.local_preset(at8).name == "cpu_depth-d32x8-local"
    folders = {ladder_plan.runs_folder(Path("/o"), ladder_plan.local_preset(q), []) for q in (p, at8)}
    assert len(folders) == 2
    runs = ladder_plan.plan_local("block_attnres", ladder_plan.local_preset(at8), [], _arms("block_attnres"))
    assert {r.rung for r in runs} == {ladder_plan.Rung(32, 8)}
    assert sensitivity_preset(ladder.at_rung(p, ladder.parse_rung("d32x8"), "--rate-sensitivity")).rungs == [
        ladder_plan.Rung(32, 8)
    ]
    assert ladder.main(["block_attnres", "--preset", "cpu_depth", "--rung", "32x8", "--dry-run"]) == 2
    assert "--rung goes with --local" in capsys.readouterr().err
    assert ladder.main(["block_attnres", "--local", "--rung", "33x8", "--dry-run"]) == 2
    assert "multiple of 16" in capsys.readouterr().err
