"""Every study in sweeps/ runs end to end in its smoke variant, and analysis.compare reads the sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from analysis.compare import compare
from runtime.sweep_job import read_index
from sweeps.run import commands, load_study, main, study_names

STUDIES = study_names()


def test_the_studies_exist():
    assert {"mixers", "ffn_activation", "moe_form", "balancer", "residual", "k3_decisions"} <= set(STUDIES)


# The default suite trains two points of every study end to end (and composes and validates every job of
# every point below); the slow suite trains all of them, k3_decisions included (seven k3_small variants).
SMOKE_POINTS = {
    "mixers": "gqa,k3_hybrid",
    "moe_form": "dense,stable_latent_moe",
    "balancer": "none,qb",
    "residual": "full_attnres,block2",
}


# the default suite runs one study's smoke variant end to end (the mixers: two mixers, a sweep and its
# comparison); every study's jobs still compose and validate below, and -m slow runs every smoke variant
SLOW_SMOKE = {
    "balancer",
    "default_run",
    "k3_decisions",
    "ffn_activation",
    "lr_search",
    "tokenizers",
    "moe_form",
    "residual",
    "mqar",
}


@pytest.mark.parametrize("study", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW_SMOKE else s for s in STUDIES])
def test_study_smoke_runs_end_to_end(tmp_path, study, monkeypatch):
    _smoke(tmp_path, study, SMOKE_POINTS.get(study), monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("study", STUDIES)
def test_every_point_of_every_study_trains(tmp_path, study, monkeypatch):
    _smoke(tmp_path, study, None, monkeypatch)


def test_every_job_of_every_study_composes_and_validates(tmp_path):
    from runtime.compose import compose_root
    from runtime.multirun import expand_sweep

    for study in STUDIES:
        for point, argv in commands(study, load_study(study), [], True, tmp_path):
            overrides = [a for a in argv if a != "-m" and not a.startswith("hydra") and not a.startswith("hydra/")]
            for job in expand_sweep(overrides):
                compose_root(job)  # raises ConfigError naming the key


def test_every_study_compares_its_points_at_equal_tokens_with_warmup_inside_the_budget(tmp_path):
    """Default scale: every job of a study trains the same number of tokens (a step budget, the time
    limit only a guard; studies that compare at equal time size each point's budget instead), and the
    learning-rate warmup ends well before the budget does."""
    from runtime.compose import compose
    from runtime.multirun import expand_sweep

    for study in STUDIES:
        spec = load_study(study)
        budgets = set()
        for point, argv in commands(study, spec, [], False, tmp_path):
            overrides = [a for a in argv if a != "-m" and not a.startswith("hydra")]
            for job in expand_sweep(overrides):
                cfg = compose(job)
                budgets.add(cfg.trainer.max_steps * cfg.data.batch_size * cfg.data.seq_len)
                assert cfg.optimizer.warmup_steps <= cfg.trainer.max_steps // 2, (study, point)
                assert cfg.trainer.max_time_minutes is None or cfg.trainer.max_time_minutes >= 20, (study, point)
        assert len(budgets) == 1 or spec["compare_at"] == "time", (study, budgets)
        for choice in (
            spec.get("search", {}).get("params", {}).get("optimizer.warmup_steps", "choice()")[7:-1].split(",")
        ):
            assert not choice.strip() or int(choice) <= cfg.trainer.max_steps // 2, (study, choice)


def _smoke(tmp_path: Path, study: str, points: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert (
        main(
            [study, "--smoke", "--jobs", "2", "--output-root", str(tmp_path), *(["--points", points] if points else [])]
        )
        == 0
    )
    (sweep_dir,) = list((tmp_path / "sweeps").iterdir())
    spec = load_study(study)
    chosen = points.split(",") if points else list(spec["points"])
    index = read_index(str(sweep_dir))
    n_seeds = len(spec.get("seeds") or [0])
    searched = set(spec.get("search", {}).get("params", {}))
    trials = 2 if searched else n_seeds  # the smoke variant of a search runs 2 trials
    assert {e["status"] for e in index} == {"finished"}
    assert {e["varied"]["point"] for e in index} == set(chosen)
    if n_seeds > 1:
        assert {e["varied"]["seed"] for e in index} == {str(s) for s in spec["seeds"]}
    grid = set(spec.get("grid") or {})
    assert len(index) == len(chosen) * trials * max(1, len(set(e["varied"].get(k) for e in index for k in grid)))
    assert all(
        set(e["varied"]) == {"point", *searched, *grid} | ({"seed"} if n_seeds > 1 else set()) for e in index
    )  # fixed overrides are not "varied"
    if searched:  # the Optuna sweeper's verdict, and every trial tagged with the values it tried
        assert "best_params" in (sweep_dir / "optimization_results.yaml").read_text()
        assert len({e["varied"]["optimizer.lr"] for e in index}) == 2
    result = compare([str(sweep_dir)], str(tmp_path / "cmp"))
    assert result["runs"] == len(index)
    summary = json.loads((Path(index[0]["run_dir"]) / "summary.json").read_text())
    assert summary["steps"] >= 1


def test_command_line_overrides_win_over_the_study(tmp_path):
    (_, argv), *_ = commands("mixers", load_study("mixers"), ["trainer.max_steps=7"], False, tmp_path)
    assert "trainer.max_steps=7" in argv and "trainer.max_steps=120" not in argv


def test_unknown_study_is_one_clear_error():
    with pytest.raises(SystemExit, match="study 'nope' not found; studies: "):
        main(["nope"])


def test_a_study_goes_to_slurm_with_the_launcher_override(tmp_path):
    """`python -m sweeps.run STUDY hydra/launcher=slurm trainer=slurm`: every point's multirun composes
    with the submitit launcher shaped by the trainer preset (nothing is submitted here)."""
    from omegaconf import OmegaConf

    from runtime.compose import compose

    for point, argv in commands(
        "balancer",
        load_study("balancer"),
        ["hydra/launcher=slurm", "trainer=slurm", "trainer.num_nodes=2"],
        False,
        tmp_path,
    ):
        overrides = [a for a in argv if a != "-m" and not a.startswith("hydra.sweep")]
        cfg = compose([o for o in overrides if "," not in o])
        launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
        assert launcher["_target_"].endswith("SlurmLauncher") and (launcher["nodes"], launcher["tasks_per_node"]) == (
            2,
            8,
        ), point
