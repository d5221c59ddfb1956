"""Every study in sweeps/ runs end to end in its smoke variant, and analysis.compare reads the sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from analysis.compare import compare
from components.sweep_job import read_index
from sweeps.run import commands, load_study, main, study_names

STUDIES = study_names()


def test_the_studies_exist():
    assert {"mixers", "ffn_activation", "moe_form", "balancer", "residual", "k3_decisions"} <= set(STUDIES)


# k3_decisions trains seven k3_small variants (about a minute here): slow, like tests/test_k3_experiments.py's training
@pytest.mark.parametrize("study", [pytest.param(s, marks=pytest.mark.slow) if s == "k3_decisions" else s for s in STUDIES])
def test_study_smoke_runs_end_to_end(tmp_path, study):
    assert main([study, "--smoke", "--output-root", str(tmp_path)]) == 0
    (sweep_dir,) = list((tmp_path / "sweeps").iterdir())
    spec = load_study(study)
    index = read_index(str(sweep_dir))
    n_seeds = len(spec.get("seeds") or [0])
    assert len(index) == len(spec["points"]) * n_seeds and {e["status"] for e in index} == {"finished"}
    assert {e["varied"]["point"] for e in index} == set(spec["points"])
    if n_seeds > 1:
        assert {e["varied"]["seed"] for e in index} == {str(s) for s in spec["seeds"]}
    assert all(set(e["varied"]) <= {"point", "seed"} for e in index)  # fixed overrides are not "varied"
    result = compare([str(sweep_dir)], str(tmp_path / "cmp"))
    assert result["runs"] == len(index)
    summary = json.loads((Path(index[0]["run_dir"]) / "summary.json").read_text())
    assert summary["steps"] >= 1


def test_command_line_overrides_win_over_the_study():
    (_, argv), *_ = commands("mixers", load_study("mixers"), ["trainer.max_time_minutes=7"], False, Path("/tmp/x"))
    assert "trainer.max_time_minutes=7" in argv and "trainer.max_time_minutes=3" not in argv


def test_unknown_study_is_one_clear_error():
    with pytest.raises(SystemExit, match="study 'nope' not found; studies: "):
        main(["nope"])
