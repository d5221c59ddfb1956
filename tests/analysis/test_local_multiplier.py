"""The local multiplier (analysis/local_multiplier.py): the variant at one size read off the baseline's
three bracketing points, with a paired bootstrap interval -- recovered on synthetic data with a known
multiplier, covering at about its nominal rate, covering 1 on an A/A comparison, and refusing what is not
a local comparison."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest

from analysis.local_multiplier import local_multiplier, main
from analysis.scaling_fit import NO_DIFFERENCE, VARIANT_BETTER, Ladder, Run
from tests.analysis.synthetic_ladder import ladder_of, synthetic_local


def test_a_noiseless_multiplier_is_read_off_the_bracket():
    """On a straight line in log-log the interpolation is exact; on the saturating test law it is within
    the chord's small bias (the bracket spans only 1.7x)."""
    c = np.array([1e15 / 1.3, 1e15, 1.3e15])
    runs = [Run("baseline", f"b{j}", s, cj, 3.0 * (cj / 1e13) ** -0.2) for j, cj in enumerate(c) for s in (0, 1)]
    runs += [Run("variant", "b1", s, 1e15, 3.0 * (1.2 * 1e15 / 1e13) ** -0.2) for s in (0, 1)]
    assert local_multiplier(Ladder(runs), n_boot=100).estimate == pytest.approx(1.2, rel=1e-9)
    exact = local_multiplier(ladder_of(synthetic_local(k=1.15, noise=0.0)), n_boot=100)
    assert exact.estimate == pytest.approx(1.15, rel=0.003) and exact.verdict == VARIANT_BETTER


def test_a_known_multiplier_is_recovered_inside_its_interval():
    r = local_multiplier(ladder_of(synthetic_local(k=1.15, seeds=4, rng_seed=3)), 0.9, 2000)
    assert r.lower <= 1.15 <= r.upper and r.verdict == VARIANT_BETTER, r
    assert r.t_widening == pytest.approx(2.353 / 1.645, rel=1e-3)  # t with 3 degrees of freedom over z


def _coverage(k: float, draws: int = 200, seeds: int = 4) -> float:
    covered = 0
    for d in range(draws):
        r = local_multiplier(ladder_of(synthetic_local(k=k, seeds=seeds, rng_seed=5000 + d)), 0.9, 1000, seed=d)
        assert r.lower is not None, r.reason
        covered += r.lower <= k <= r.upper
    return covered / draws


def test_coverage_is_near_nominal_over_many_draws():
    """200 draws, 4 paired seeds, 90% intervals: the binomial standard error near 0.9 is 0.021, the
    tolerance three of them. Measured: 0.88 on these draws at k = 1.1 and at 1.0; 0.93-0.94 on 300 others
    (0.87-0.89 with 3 seeds)."""
    assert 0.84 <= _coverage(1.1) <= 0.96


def test_an_aa_local_comparison_covers_1():
    """Both arms from the same law: the interval covers 1 at about the nominal rate, and one draw's
    verdict is no detectable difference."""
    assert 0.84 <= _coverage(1.0) <= 0.96
    r = local_multiplier(ladder_of(synthetic_local(k=1.0, rng_seed=11)), 0.9, 2000)
    assert r.lower <= 1.0 <= r.upper and r.verdict == NO_DIFFERENCE


def test_outside_the_bracket_there_is_only_a_bound():
    r = local_multiplier(ladder_of(synthetic_local(k=2.0, noise=0.001)), 0.9, 1000)
    assert r.estimate is None and r.extra["at_least"] == pytest.approx(1.3) and r.verdict == VARIANT_BETTER
    assert r.upper == math.inf and "below the baseline's lowest" in r.reason


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda rows: [r for r in rows if r["rung"] != "b2"], "the baseline at 3 compute points"),
        (lambda rows: [r for r in rows if (r["arm"], r["seed"]) != ("variant", 3)], "the same seeds"),
        (lambda rows: [{**r, "train_flops": 1e16} if r["arm"] == "variant" else r for r in rows], "bracket"),
    ],
)
def test_what_is_not_a_local_comparison_is_refused(edit, message):
    with pytest.raises(ValueError, match=message):
        local_multiplier(ladder_of(edit(synthetic_local())), 0.9, 1000)
    with pytest.raises(ValueError, match="at least 1000 bootstrap replicates"):
        local_multiplier(ladder_of(synthetic_local()), 0.99, 999)


def test_the_command_writes_its_report_and_refuses_too_few_replicates(tmp_path, capsys):
    from tests.analysis.synthetic_ladder import write_ladder_csv

    write_ladder_csv(tmp_path / "local.csv", synthetic_local(k=1.15, rng_seed=3), stability=False)
    with open(tmp_path / "local.csv") as f:  # the ladder writes each point's token multiple: three of them
        rows = [{**r, "tokens_per_param": {"b0": 15.4, "b1": 20, "b2": 26}[r["rung"]]} for r in csv.DictReader(f)]
    with open(tmp_path / "local.csv", "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    assert main([str(tmp_path), "--confidence", "0.99", "--bootstrap", "100"]) == 2
    assert "--bootstrap 100 is too few for a 99% interval" in capsys.readouterr().err
    assert main([str(tmp_path), "--bootstrap", "1000"]) == 0
    fits = json.loads((tmp_path / "local.json").read_text())
    assert fits["verdict"] == VARIANT_BETTER and fits["interval"][0] <= 1.15 <= fits["interval"][1]
    assert "Multiplier" in (tmp_path / "local.md").read_text()
    with open(tmp_path / "local.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["rung"] != "b2"]
    with open(tmp_path / "two.csv", "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    assert main([str(tmp_path / "two.csv")]) == 2
    assert "the baseline has 2 rung(s) (b0, b1); this table needs at least 3" in capsys.readouterr().err
