"""The learning-rate sensitivity report (analysis/rate_sensitivity_report.py) on synthetic loss-against-rate
curves whose basins are known."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest

from analysis.rate_sensitivity_report import analyse, basin, main, sensitivity

RATES = [1e-3 * 2.0**e for e in range(9)]  # 8 octaves


def _bowl(curvature: float, best: float = 1e-3 * 2**4, floor: float = 1.8):
    """Loss quadratic in log2 rate: within ``tol`` of the best over 2 sqrt(tol / curvature) octaves."""
    return [floor + curvature * math.log2(r / best) ** 2 for r in RATES]


def test_the_basin_of_a_quadratic_bowl_has_its_known_width():
    for curvature in (0.005, 0.02, 0.08):
        b = basin(np.log2(RATES), np.array(_bowl(curvature)), 0.02)
        exact = 2 * math.sqrt(0.02 / curvature)
        # the chord between sweep points a factor of 2 apart lies above a convex bowl: it crosses the
        # tolerance inside the true ends, understating the width by at most half an octave here
        assert exact - 0.5 <= b["basin_octaves"] <= exact + 1e-9, (curvature, b)
        assert b["best_lr"] == pytest.approx(1e-3 * 2**4) and not (b["open_low"] or b["open_high"])


def test_diverged_rates_end_the_basin_and_cost_the_cap():
    losses = np.array(_bowl(0.001))
    losses[7:] = np.inf  # the two highest rates diverged
    b = basin(np.log2(RATES), losses, 0.02)
    assert b["high"] == pytest.approx(RATES[6]) and not b["open_high"]  # it ends at the last finite rate
    assert b["open_low"]  # the low end reaches the sweep's edge: the width is a lower bound
    assert sensitivity(losses, cap=3.0) == pytest.approx(
        np.mean(np.minimum(np.where(np.isinf(losses), 3, losses), 3)) - 1.8
    )
    assert basin(np.log2(RATES), np.full(len(RATES), np.inf), 0.02)["reason"] == "every rate diverged"


def test_the_wider_basin_is_the_variants_and_the_report_says_so(tmp_path, capsys):
    """The variant's bowl is four times shallower: twice the basin width, and a lower sensitivity. A rate
    where one seed diverged counts as diverged for the arm."""
    rows = []
    for arm, curvature in (("baseline", 0.02), ("variant", 0.005)):
        for seed, shift in ((0, 0.003), (1, -0.003)):
            for rate, loss in zip(RATES, _bowl(curvature)):
                diverged = arm == "baseline" and seed == 1 and rate == RATES[-1]
                rows.append({"decision": "latent_norm", "arm": arm, "seed": seed, "lr": rate,
                             "val_bpb": "" if diverged else loss + shift})  # fmt: skip
    result = analyse([{**r, "loss": float(r["val_bpb"]) if r["val_bpb"] != "" else math.nan} for r in rows], 0.02)
    b, v = result["arms"]["baseline"], result["arms"]["variant"]
    assert b["mean_loss"][-1] is None and v["mean_loss"][-1] is not None
    assert v["basin_octaves"] == pytest.approx(2 * b["basin_octaves"], rel=0.25)
    assert result["basin_difference_octaves"] > 1.0 and v["sensitivity"] < b["sensitivity"]
    with open(tmp_path / "sensitivity.csv", "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    assert main([str(tmp_path)]) == 0
    assert "Basin width, variant minus baseline: +" in capsys.readouterr().out
    saved = json.loads((tmp_path / "sensitivity.json").read_text())
    assert saved["arms"]["variant"]["basin_octaves"] == pytest.approx(v["basin_octaves"])
    assert (tmp_path / "loss_vs_rate.png").stat().st_size > 0 and "| variant |" in (
        tmp_path / "sensitivity.md"
    ).read_text()
    (tmp_path / "bad.csv").write_text("decision,arm,seed,lr,val_bpb\nx,treatment,0,1e-3,2.0\n")
    assert main([str(tmp_path / "bad.csv")]) == 2
    assert "arm 'treatment' is neither baseline nor variant" in capsys.readouterr().err
