"""The scaling ladder's plan (sweeps/ladder_plan.py, sweeps/ladder_rungs.py) and its executor's bookkeeping
(sweeps/ladder.py): the size rule, budgets, branch points, learning-rate choice, finished-run detection and
refusals, without training."""

from __future__ import annotations

import copy
import functools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from analysis.model_report import report
from components.optim.schedules.wsd import decay_start
from runtime.rate_probe import Rate
from sweeps import ladder, ladder_plan, run_state
from sweeps.ladder_rungs import Rung


def test_the_rule_at_k3_smalls_size_is_k3_small():
    k3_small = report(["experiment=k3_small"])
    rebuilt = report(["experiment=k3_small", *Rung(256, 8).overrides()])
    for key in ("total_params", "active_params", "params_by_kind", "schedule", "attnres", "compute"):
        assert rebuilt[key] == k3_small[key], key


# the GPU preset's rungs compose the same way at larger sizes (about 25 s of composing): with -m slow
@pytest.mark.parametrize("preset", ["cpu", pytest.param("gpu", marks=pytest.mark.slow)])
def test_every_rung_composes_in_both_arms_and_spans_8x(preset):
    p = ladder_plan.load_preset(preset)
    for decision in ladder_plan.decision_names():
        d = ladder_plan.load_decision(decision)
        sizes = {
            arm: [ladder_plan.account(ladder_plan.arm_overrides(d[arm], r, p, [], True)) for r in p.rungs]
            for arm in ladder_plan.ARMS
        }
        non_embedding = [s.non_embedding_params for s in sizes["baseline"]]
        assert non_embedding == sorted(non_embedding) and non_embedding[-1] >= 8 * non_embedding[0]
        # an arm flips one decision: the same rung is (nearly) the same size in both (block AttnRes adds
        # its per-sublayer queries and norms, 1.4% of the smallest CPU rung); a mixer decision changes the
        # mixer's own parameters (KDA against MLA: 9% at the smallest), which the ladder's compute axis counts
        tolerance = 0.1 if decision == "kda_hybrid" else 0.02
        for a, b in zip(sizes["baseline"], sizes["variant"]):
            assert abs(a.active_params - b.active_params) < tolerance * a.active_params


def test_budgets_branch_points_and_checkpoints():
    p = ladder_plan.load_preset("cpu")
    d = ladder_plan.load_decision("block_attnres")
    runs = ladder_plan.plan("block_attnres", p, [], {arm: d[arm] for arm in ladder_plan.ARMS})
    by_name = {r.name: r for r in runs}
    stable = [r for r in runs if r.phase == "stable"]
    assert len(stable) == 2 * len(p.rungs) * len(p.seeds)
    for run in stable:
        assert run.steps == math.ceil(p.tokens_per_param * run.size.active_params / run.size.tokens_per_step)
        assert run.tokens >= p.tokens_per_param * run.size.active_params
    for run in (r for r in runs if r.phase == "branch"):
        parent = by_name[run.branch_of]
        own_decay = decay_start(run.steps, run.warmup, p.decay_fraction)
        # from the last checkpoint at or before its own decay: it retrains at most an interval of its peak
        assert own_decay - parent.checkpoint_every < run.init_step <= own_decay
        assert run.init_step % parent.checkpoint_every == 0  # the stable run saves that step
        assert run.init_step < decay_start(parent.steps, parent.warmup, p.decay_fraction)  # still at the peak
        assert run.warmup == parent.warmup and run.batch_rows == parent.batch_rows
    lr_runs = [r for r in runs if r.phase == "lr"]
    assert {r.rung for r in lr_runs} == set(p.rungs[: p.lr_sweep_rungs])
    swept = 2 if p.lr_rule == "per_arm" else 1  # the baseline rule sweeps the baseline only
    assert len(lr_runs) == swept * p.lr_sweep_rungs * len(p.lr_factors)
    checks = [r for r in runs if r.phase == "lr_check"]
    assert len(checks) == 2 * len(p.lr_check_factors) and {r.rung for r in checks} == {p.rungs[-1]}
    branch = next(r for r in runs if r.phase == "branch")
    argv = ladder_plan.run_overrides(branch, d[branch.arm], p, [], Path("/runs"))
    assert f"init_step={branch.init_step}" in argv and "ckpt_path=last" in argv
    assert "logger.job_type=ladder-rung" in argv  # W&B tells a ladder's runs from a study's
    assert f"init_from=/runs/{branch.branch_of}" in argv


def _fake_lr_summaries(runs, best_factor, preset):
    out = {}
    for run in runs:
        if run.phase == "lr":
            # a bowl in log lr around best_factor * base, deeper for larger models
            gap = math.log(run.lr_factor / best_factor[run.rung.name]) ** 2
            out[run.name] = {"val": {"loss": 2.0 - 0.01 * math.log(run.size.active_params) + gap}}
    return out


def test_learning_rates_are_fitted_against_size_and_edges_flagged():
    p = replace(ladder_plan.load_preset("cpu"), lr_rule="per_arm", lr_sweep_rungs=2)
    d = ladder_plan.load_decision("block_attnres")
    runs = ladder_plan.plan("block_attnres", p, [], {arm: d[arm] for arm in ladder_plan.ARMS})
    swept = p.rungs[: p.lr_sweep_rungs]
    best = {swept[0].name: 1.0, swept[1].name: 0.5}
    chosen = ladder_plan.choose_learning_rates(runs, _fake_lr_summaries(runs, best, p), p)
    for arm in ladder_plan.ARMS:
        rates, edges = chosen[arm]
        assert rates[swept[0].name] == pytest.approx(p.lr_base * 1.0)
        assert rates[swept[1].name] == pytest.approx(p.lr_base * 0.5)
        assert edges == {swept[0].name: "", swept[1].name: "low"}
        # the power law continues to the larger rungs: lower rates for larger models
        ordered = [rates[r.name] for r in p.rungs]
        assert ordered == sorted(ordered, reverse=True)


def test_finished_means_every_planned_step(tmp_path):
    run = tmp_path / "variant-d32x4-s0"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"steps": 40, "planned_steps": 100}))
    assert run_state.finished_summary(tmp_path, "variant-d32x4-s0") is None
    again = tmp_path / "variant-d32x4-s0-2"
    again.mkdir()
    (again / "summary.json").write_text(json.dumps({"steps": 100, "planned_steps": 100, "val": {"loss": 1.0}}))
    assert run_state.finished_summary(tmp_path, "variant-d32x4-s0")["steps"] == 100
    assert run_state.finished_summary(tmp_path, "variant-d32x4-s1") is None


def test_gpu_dry_run_prints_runs_flops_and_gpu_hours(capsys):
    assert ladder.main(["block_attnres", "--preset", "gpu", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "k3_small-d1536x20-s1-tpp10" in out and "GPU-hours:" in out and "training FLOPs in all" in out


@pytest.mark.parametrize(
    "argv,named",
    [
        (["nosuch", "--dry-run"], "decision 'nosuch' not found"),
        (["block_attnres", "--preset", "nosuch", "--dry-run"], "preset 'nosuch' not found"),
        (["block_attnres", "--jobs", "0", "--dry-run"], "--jobs"),
        (["block_attnres", "--dry-run", "--measure-steps", "0", "model.d_modle=3"], "model.d_modle"),
    ],
)
def test_bad_input_is_refused_by_name(argv, named, capsys, tmp_path):
    assert ladder.main([*argv, "--output-root", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0]
    assert not any(tmp_path.iterdir())


def test_bad_preset_files_are_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rungs: [[32, 3]]\ntokens_per_param: 20\nseeds: [0]\nlr: {base: 1e-3}\noverrides: []\n")
    with pytest.raises(ladder_plan.LadderError, match="multiple of 4"):
        ladder_plan.load_preset(str(bad))
    bad.write_text(
        "rungs: [[32, 4], [48, 4]]\ntokens_per_param: 20\nseeds: [0]\nlr: {base: 1e-3}\noverrides: []\nx: 1\n"
    )
    with pytest.raises(ladder_plan.LadderError, match="unknown keys x"):
        ladder_plan.load_preset(str(bad))


def test_stability_columns_come_from_the_runs_metrics(tmp_path):
    lines = [{"step": s, "train/grad_norm": 1.0 + 0.01 * (s % 3)} for s in range(0, 100, 2)]
    lines[30]["train/grad_norm"] = 5.0  # one spike after the first tenth
    lines[1]["train/grad_norm"] = 50.0  # early, during warmup: not counted
    lines += [{"step": 90, ladder.MAXVIO_KEY: 0.4}, {"step": 98, ladder.MAXVIO_KEY: 0.25}]
    lines += [{"step": 50, "act/glu_max": 80.0}, {"step": 99, "act/glu_max": 61.5}, '{"step": 99, "train/gr']
    (tmp_path / "metrics.jsonl").write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines))
    assert ladder.stability_metrics(str(tmp_path)) == {"maxvio": 0.25, "grad_norm_spikes": 1, "max_activation": 61.5}
    missing = {"maxvio": "", "grad_norm_spikes": "", "max_activation": ""}
    assert ladder.stability_metrics(str(tmp_path / "missing")) == missing


def test_decisions_sharing_an_arm_share_its_runs(tmp_path):
    p = ladder_plan.load_preset("cpu")
    plans = {}
    for name in ("block_attnres", "latent_norm"):
        d = ladder_plan.load_decision(name)
        plans[name] = ladder_plan.plan(name, p, [], {arm: d[arm] for arm in ladder_plan.ARMS})
    variant = [{r.name for r in plans[n] if r.arm == "variant"} for n in plans]
    baseline = [{r.name for r in plans[n] if r.arm == "baseline"} for n in plans]
    assert variant[0] == variant[1]  # both decisions' variant is k3_small: the same runs
    assert not baseline[0] & baseline[1]  # their baselines differ, and so do their names
    assert all(n.startswith("k3_small-") for n in variant[0])
    # one folder per preset and command line: another override never reuses a run trained without it
    here = ladder_plan.runs_folder(tmp_path, p, [])
    assert here == ladder_plan.runs_folder(tmp_path, ladder_plan.load_preset("cpu"), [])
    assert here != ladder_plan.runs_folder(tmp_path, p, ["data.seq_len=128"])
    assert here != ladder_plan.runs_folder(tmp_path, replace(p, tokens_per_param=10.0), [])


def test_an_a_a_ladder_keeps_its_two_arms_apart():
    p = ladder_plan.load_preset("cpu")
    runs = ladder_plan.plan("aa", p, [], {"baseline": ["experiment=k3_small"], "variant": ["experiment=k3_small"]})
    names = [r.name for r in runs]
    assert len(names) == len(set(names))


def test_one_ladder_at_a_time_per_runs_folder(tmp_path):
    held = run_state.hold_runs_folder(tmp_path)
    with pytest.raises(ladder_plan.LadderError, match="another ladder is training in"):
        run_state.hold_runs_folder(tmp_path)
    held.close()
    run_state.hold_runs_folder(tmp_path).close()  # free again once the first ladder is done


def test_the_time_estimate_schedules_phases_one_after_another():
    p = ladder_plan.load_preset("cpu")
    d = ladder_plan.load_decision("block_attnres")
    runs = ladder_plan.plan("block_attnres", p, [], {arm: d[arm] for arm in ladder_plan.ARMS})
    rates = {r.name: Rate(tokens_per_s=1e4, overhead_s=10.0) for r in p.rungs}
    serial = sum(rates[r.rung.name].seconds((r.steps - (r.init_step or 0)) * r.size.tokens_per_step) for r in runs)
    assert ladder_plan.scheduled_seconds(runs, rates, 1) == pytest.approx(serial)
    two = ladder_plan.scheduled_seconds(runs, rates, 2)
    assert serial / 2 <= two < serial  # two slots, but a phase's longest run still bounds it


def test_concurrent_jobs_split_the_cores_this_process_may_use(monkeypatch):
    from runtime import cpu_threads
    from runtime.cpu_threads import threads_per_job

    assert threads_per_job(1, {}) == {}
    assert threads_per_job(2, {"OMP_NUM_THREADS": "3"}) == {}  # the caller's choice stands
    monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: {0, 1, 2, 3, 4, 5})  # a 6-CPU mask on any machine
    assert threads_per_job(2, {}) == {"OMP_NUM_THREADS": "3"}
    monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: {3})  # taskset -c 3: one core, however many exist
    assert threads_per_job(2, {}) == {"OMP_NUM_THREADS": "1"}


def test_wide_rungs_add_heads_of_k3s_width_instead_of_widening_them():
    """Up to d 512 a rung has 4 heads of d/4 (k3_small's shape); wider ones have heads of K3's 128 (RoPE
    64), so KDA stays within fla's head-width limit, with heads x width = d and the same parameters."""
    assert (Rung(256, 8).n_heads, Rung(256, 8).head_dim) == (4, 64)
    assert (Rung(512, 8).n_heads, Rung(512, 8).head_dim) == (4, 128)
    wide = dict(o.split("=", 1) for o in Rung(1536, 20).overrides())
    assert (wide["mixer.n_heads"], wide["mixer.head_dim"]) == ("12", "128")
    assert (wide["mixers.mla.n_heads"], wide["mixers.mla.qk_rope_head_dim"], wide["mixers.mla.v_head_dim"]) == (
        "12",
        "64",
        "128",
    )
    for rung in ladder_plan.load_preset("gpu").rungs:
        assert rung.n_heads * rung.head_dim == rung.d_model and rung.head_dim <= 128
    with pytest.raises(ValueError, match="multiple of 128"):
        Rung(1040, 8).check()


def test_the_best_rate_lies_between_sweep_points_where_the_losses_bend():
    """A sweep 2x apart: the parabola through the best trial and its neighbours finds an optimum between
    them (exact for losses quadratic in log lr), not the nearest sweep point; edges keep the edge."""
    factors = [0.5, 1.0, 2.0, 4.0, 8.0]
    for best in (1.5, 2.0, 2.9):
        trials = [(math.log(f), 2.0 + math.log(f / best) ** 2) for f in factors]
        assert ladder_plan.best_log_lr(trials) == pytest.approx(math.log(best))
    rising = [(math.log(f), 2.0 + f) for f in factors]
    assert ladder_plan.best_log_lr(rising) == math.log(0.5)  # the low edge stays the low edge
    diverged = [(math.log(f), loss) for f, loss in zip(factors, [3.0, 2.5, 2.4, float("nan"), float("nan")])]
    assert ladder_plan.best_log_lr(diverged) == math.log(2.0)  # no finite neighbour above: the trial itself
    assert ladder_plan.best_log_lr(list(reversed(trials))) == ladder_plan.best_log_lr(trials)  # order does not matter


def test_two_rungs_whose_optima_differ_by_less_than_a_sweep_step_still_give_a_slope():
    p = replace(ladder_plan.load_preset("cpu"), lr_rule="per_arm", lr_sweep_rungs=2)
    d = ladder_plan.load_decision("block_attnres")
    runs = ladder_plan.plan("block_attnres", p, [], {arm: d[arm] for arm in ladder_plan.ARMS})
    swept = p.rungs[: p.lr_sweep_rungs]
    best = {swept[0].name: 2.8, swept[1].name: 1.6}  # both nearest to the factor 2 sweep point
    chosen = ladder_plan.choose_learning_rates(runs, _fake_lr_summaries(runs, best, p), p)
    rates, _ = chosen["variant"]
    assert rates[swept[0].name] == pytest.approx(p.lr_base * 2.8)
    assert rates[swept[1].name] == pytest.approx(p.lr_base * 1.6)


def test_runs_trained_at_another_rate_are_set_aside_not_reused(tmp_path, capsys):
    """A stable run finished at a rate the ladder no longer chooses (and a resumable copy of it) is
    renamed aside, so it is trained again; a run at the chosen rate stays."""
    p = ladder_plan.load_preset("cpu")
    d = ladder_plan.load_decision("block_attnres")
    planned = ladder_plan.plan("block_attnres", p, [], {arm: d[arm] for arm in ladder_plan.ARMS})
    runs = [r for r in planned if r.phase != "lr"]
    for run in runs:
        run.lr = 0.0123456789
    kept, stale = runs[0], runs[1]
    for name, lr in [(kept.name, 0.0123457), (stale.name, 0.024), (f"{stale.name}-2", 0.024)]:
        (tmp_path / name / ".hydra").mkdir(parents=True)
        (tmp_path / name / ".hydra" / "config.yaml").write_text(f"optimizer:\n  lr: {lr}\n")
        (tmp_path / name / "summary.json").write_text(json.dumps({"steps": 5, "planned_steps": 5}))
    moved = ladder.set_aside_stale_runs(runs, tmp_path)
    assert sorted(m.name for m in moved) == [f"{stale.name}-2-lr0.024", f"{stale.name}-lr0.024"]
    assert all(m.parent == tmp_path / "stale" for m in moved)
    assert (tmp_path / kept.name).is_dir() and not (tmp_path / stale.name).exists()
    assert run_state.finished_summary(tmp_path, stale.name) is None and run_state.finished_summary(tmp_path, kept.name)
    assert "the ladder now chooses 0.0123457" in capsys.readouterr().out
    assert ladder.set_aside_stale_runs(runs, tmp_path) == []  # idempotent


def test_a_shared_arm_trained_under_another_decisions_settings_is_set_aside_then_restored(tmp_path, capsys):
    """Two decisions share the variant: under the baseline rule each gives it its own rate, and the warmup
    follows the smaller arm. A run trained with another warmup is never reused; a stale folder whose
    settings are the plan's comes back instead of training again."""
    p = ladder_plan.load_preset("cpu")
    d = ladder_plan.load_decision("block_attnres")
    run = next(
        r for r in ladder_plan.plan("block_attnres", p, [], {a: d[a] for a in ladder_plan.ARMS}) if r.phase == "stable"
    )
    run.lr = 0.02

    def write(folder, lr, warmup):
        (folder / ".hydra").mkdir(parents=True)
        config = f"optimizer:\n  lr: {lr}\n  warmup_steps: {warmup}\ndata:\n  batch_size: {run.batch_rows}\n"
        (folder / ".hydra" / "config.yaml").write_text(config)
        (folder / "summary.json").write_text(json.dumps({"steps": 5, "planned_steps": 5, "lr": lr}))

    write(tmp_path / run.name, 0.02, run.warmup + 3)  # the same rate, another warmup: another run
    moved = ladder.set_aside_stale_runs([run], tmp_path)
    assert [m.name for m in moved] == [f"{run.name}-lr0.02"]
    assert f"warmup steps, the plan has {run.warmup}" in capsys.readouterr().out
    assert run_state.finished_summary(tmp_path, run.name) is None
    write(tmp_path / "stale" / f"{run.name}-lr0.03", 0.03, run.warmup)  # another rate: stays aside
    write(tmp_path / "stale" / f"{run.name}-lr0.02-2", 0.02, run.warmup)  # the plan's settings: comes back
    assert ladder.set_aside_stale_runs([run], tmp_path) == []
    assert "restored from" in capsys.readouterr().out
    assert run_state.finished_summary(tmp_path, run.name)["lr"] == 0.02
    assert (tmp_path / "stale" / f"{run.name}-lr0.03").is_dir() and (tmp_path / "stale" / f"{run.name}-lr0.02").is_dir()
    run.lr = 0.03  # the other decision's turn: this folder goes aside, the one at its rate comes back
    assert [m.name for m in ladder.set_aside_stale_runs([run], tmp_path)] == [f"{run.name}-lr0.02-2"]
    assert run_state.finished_summary(tmp_path, run.name)["lr"] == 0.03


# -- rungs without confounds -----------------------------------------------------------------------------------
@functools.cache
def _planned_cpu_ladder():
    p = ladder_plan.load_preset("cpu")
    d = ladder_plan.load_decision("block_attnres")
    return p, d, ladder_plan.plan("block_attnres", p, [], {arm: d[arm] for arm in ladder_plan.ARMS})


def _cpu_plan():
    """The CPU preset's block AttnRes plan (composed once: each test gets its own copy)."""
    return copy.deepcopy(_planned_cpu_ladder())


def test_the_rung_rule_gives_every_cpu_rung_at_least_its_stated_steps():
    """Every run of every CPU rung, the smallest budget's included, trains at least batch.min_steps (1,000)
    optimizer steps, with a batch of a power of two rows that is the largest to do so (twice the rows would
    fall short): the batch grows with the rung, the steps stay within 2x of each other."""
    p, _, runs = _cpu_plan()
    assert p.min_steps == 1000
    for run in runs:
        assert run.steps >= p.min_steps, run.name
        rows = run.batch_rows
        assert rows & (rows - 1) == 0 and run.size.tokens_per_step == rows * run.size.seq_len
    smallest = p.branch_multiples[0]
    for rung in p.rungs:
        at = [r for r in runs if r.rung == rung]
        assert len({(r.batch_rows, r.warmup, r.size.tokens_per_step) for r in at}) == 1, rung  # both arms alike
        fewest = min(r.size.active_params for r in at)
        assert smallest * fewest / (2 * at[0].size.tokens_per_step) < p.min_steps  # twice the batch: too few
    rows = [next(r.batch_rows for r in runs if r.rung == rung) for rung in p.rungs]
    assert rows == sorted(rows) and rows[-1] >= 8 * rows[0]
    steps = [next(r.steps for r in runs if r.rung == rung and r.phase == "stable") for rung in p.rungs]
    assert max(steps) < 2 * min(steps)


def test_warmup_and_cooldown_are_shares_of_tokens():
    p, _, runs = _cpu_plan()
    for run in runs:
        smallest_tokens = p.branch_multiples[0] * min(
            r.size.active_params for r in runs if r.rung == run.rung
        )  # the rung's smallest budget
        assert run.warmup == max(1, round(p.warmup_fraction * smallest_tokens / run.size.tokens_per_step))
        argv = ladder_plan.run_overrides(run, ["experiment=k3_small"], p, [], Path("/runs"))
        assert f"schedule.decay_fraction={p.decay_fraction}" in argv and f"trainer.max_steps={run.steps}" in argv
    assert ladder_plan.batch_rows(420_000, 128, 1000) == 2 and ladder_plan.batch_rows(420_000, 128, 1000, 1) == 1
    with pytest.raises(ladder_plan.LadderError, match="fewer than 1000 steps even at one row"):
        ladder_plan.batch_rows(100_000, 128, 1000)


def test_two_rungs_of_one_seed_do_not_share_a_batch_order():
    """The run seed is a function of (seed, rung): the same in both arms of a rung (paired), different at
    every other rung, so the first training batches of one seed differ from rung to rung. With the seed
    alone they would not: a smaller batch drawn from the same generator is the larger one's first rows."""
    from components.registry import DATASETS
    from runtime.compose import compose, strip_hydra
    from runtime.validation import validate

    p, d, runs = _cpu_plan()
    first_rows = {}
    for run in runs:
        if run.phase == "stable" and run.seed == 0 and run.rung in p.rungs[:2]:
            argv = ladder_plan.run_overrides(run, d[run.arm], p, [], Path("/runs"))
            root = validate(strip_hydra(compose([a for a in argv if not a.startswith(("name=", "ckpt_path="))])))
            assert root.seed == run.run_seed and root.data.batch_size == run.batch_rows
            dataset = DATASETS.build(root.data, root.seed)
            first_rows[(run.arm, run.rung.name)] = [dataset.train_batch(i)[0][0] for i in range(3)]
    small, large = (r.name for r in p.rungs[:2])
    for arm in ladder_plan.ARMS:
        assert all(not torch.equal(a, b) for a, b in zip(first_rows[(arm, small)], first_rows[(arm, large)]))
    for i in range(3):  # paired: both arms of a rung see the same batches
        assert torch.equal(first_rows[("baseline", small)][i], first_rows[("variant", small)][i])
    seeds = {(r.seed, r.rung.name): r.run_seed for r in runs}
    assert len(set(seeds.values())) == len(seeds)  # no two (seed, rung) share a run seed
    # the defect this removes: seeded by the replicate alone, the two rungs' first rows are the same windows
    alone = {}
    for rung in p.rungs[:2]:
        run = next(r for r in runs if r.rung == rung and r.phase == "stable" and r.seed == 0)
        argv = ladder_plan.run_overrides(replace(run, run_seed=run.seed), d[run.arm], p, [], Path("/runs"))
        root = validate(strip_hydra(compose([a for a in argv if not a.startswith(("name=", "ckpt_path="))])))
        alone[rung.name] = DATASETS.build(root.data, root.seed).train_batch(0)[0][0]
    assert torch.equal(alone[small], alone[large])


def test_one_learning_rate_rule_for_both_arms_and_the_same_check():
    """The CPU preset's rule is the baseline's: only the baseline is swept, its fit serves both arms (each at
    its own active parameters), and both arms get the same three-rate check at the largest rung."""
    p, _, runs = _cpu_plan()
    assert p.lr_rule == "baseline" and {r.arm for r in runs if r.phase == "lr"} == {"baseline"}
    best = {r.name: 1.0 + 0.3 * i for i, r in enumerate(p.rungs)}
    chosen = ladder_plan.choose_learning_rates(runs, _fake_lr_summaries(runs, best, p), p)
    (base, base_edges), (variant, variant_edges) = chosen["baseline"], chosen["variant"]
    assert base.keys() == variant.keys() and variant_edges == {} and set(base_edges) == {r.name for r in p.rungs}
    for rung in p.rungs:
        n = {r.arm: r.size.active_params for r in runs if r.rung == rung and r.phase == "stable"}
        # one power law of N: the arms' rates differ only by their (slightly different) sizes
        slope = math.log(base[p.rungs[-1].name] / base[p.rungs[0].name]) / math.log(
            next(r.size.active_params for r in runs if r.rung == p.rungs[-1] and r.arm == "baseline")
            / next(r.size.active_params for r in runs if r.rung == p.rungs[0] and r.arm == "baseline")
        )
        assert variant[rung.name] / base[rung.name] == pytest.approx((n["variant"] / n["baseline"]) ** slope)
    checks = [r for r in runs if r.phase == "lr_check"]
    summaries = {r.name: {"val": {"loss": {0.5: 2.0, 1.0: 1.9, 2.0: 2.1}[r.lr_factor]}} for r in checks}
    summaries[next(r.name for r in checks if r.arm == "variant" and r.lr_factor == 2.0)]["val"]["loss"] = 1.8
    result = ladder_plan.check_learning_rates(runs, summaries)
    assert result["baseline"]["flag"] == "" and result["variant"]["flag"] == "high"
    assert "of the baseline, for both arms" in ladder_plan.lr_rule_text(p)


def test_a_local_comparison_brackets_the_variant_by_1_3x_in_compute():
    p, d, _ = _cpu_plan()
    local = ladder_plan.local_preset(p)
    runs = ladder_plan.plan_local("block_attnres", local, [], {arm: d[arm] for arm in ladder_plan.ARMS})
    points = [r for r in runs if r.phase in ("stable", "branch")]
    assert {r.rung for r in runs} == {p.local_rung} and {r.seed for r in points} == set(p.local_seeds) == {0, 1, 2, 3}
    for seed in p.local_seeds:
        base = sorted((r for r in points if r.arm == "baseline" and r.seed == seed), key=lambda r: r.flops)
        (variant,) = [r for r in points if r.arm == "variant" and r.seed == seed]
        assert [r.phase for r in base] == ["branch", "branch", "stable"]  # one lineage per seed
        ratios = [base[1].flops / base[0].flops, base[2].flops / base[1].flops]
        assert ratios == [pytest.approx(1.3, rel=0.01)] * 2
        assert base[0].flops < variant.flops < base[2].flops
        assert variant.flops == pytest.approx(base[1].flops, rel=0.02)  # the same budget, its own size
        assert variant.branch_of is None and variant.init_step is None
        assert {(r.batch_rows, r.warmup, r.run_seed) for r in [*base, variant]} == {
            (variant.batch_rows, variant.warmup, variant.run_seed)
        }
    assert min(r.steps for r in runs) >= p.min_steps
    assert ladder_plan.runs_folder(Path("/o"), local, []) != ladder_plan.runs_folder(Path("/o"), p, [])


def test_the_local_dry_run_lists_its_runs(capsys):
    assert ladder.main(["block_attnres", "--local", "--dry-run", "--measure-steps", "0"]) == 0
    out = capsys.readouterr().out
    assert "preset cpu-local" in out and "k3_small-d64x4-s3-tpp20 " in out and "-tpp15.3846" in out
