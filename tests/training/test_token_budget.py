"""How long a run trains: a token budget (trainer.max_tokens) becomes whole optimizer steps, the
learning-rate schedule spans exactly those steps, the result does not depend on wall time, and the
progress bar counts steps against the plan."""

from __future__ import annotations

import json
import math

import pytest

from components.registry import ConfigError
from runtime.token_budget import describe_length, time_guard_minutes, training_steps
from tests.helpers import FAST, compose_root, lr_multiplier

# the tests below set the progress bar and the time guard themselves (later overrides win)
SHORT = [*FAST, "logger=csv", "trainer.val_check_interval=1000", "trainer.checkpoint_every_n_steps=1000"]


def test_token_budget_becomes_whole_steps():
    root = compose_root(
        "trainer.max_steps=null",
        "trainer.max_tokens=10000",
        "data.batch_size=4",
        "data.seq_len=100",
        "trainer.accumulate_grad_batches=2",
    )
    assert training_steps(root) == 13  # 800 tokens a step: 12.5 rounded up
    assert "13 steps x 800 tokens" in describe_length(root) and "trainer.max_tokens=10,000" in describe_length(root)


def test_max_steps_wins_and_says_so():
    root = compose_root("trainer.max_steps=7", "trainer.max_tokens=10000")
    assert training_steps(root) == 7
    assert "max_tokens=10,000 is not used" in describe_length(root)


def test_the_time_guard_grows_with_the_budget():
    budget = ["trainer.max_steps=null", "data.batch_size=8", "data.seq_len=250"]  # 2,000 tokens a step
    small = compose_root(
        *budget, "trainer.max_tokens=100000", "trainer.max_time_minutes=30", "trainer.min_tokens_per_s=500"
    )
    assert time_guard_minutes(small) == 30  # 100K tokens at 500/s: 3.3 min, under the floor
    large = compose_root(
        *budget, "trainer.max_tokens=3000000", "trainer.max_time_minutes=30", "trainer.min_tokens_per_s=500"
    )
    assert time_guard_minutes(large) == pytest.approx(3_000_000 / 500 / 60)  # 100 min
    assert "time guard 100 min: the tokens at 500 tokens/s" in describe_length(large)
    fixed = compose_root(
        *budget, "trainer.max_tokens=3000000", "trainer.max_time_minutes=30", "trainer.min_tokens_per_s=null"
    )
    assert time_guard_minutes(fixed) == 30
    assert time_guard_minutes(compose_root("trainer.max_time_minutes=null", "trainer.min_tokens_per_s=500")) is None


def test_the_default_runs_guard_outlasts_an_eightfold_slowdown():
    # the README's run: its budget fits at an eighth of its slowest measured rate (fp32 on a 2-core AVX2 CPU)
    root = compose_root()
    tokens = training_steps(root) * root.data.batch_size * root.data.seq_len
    assert time_guard_minutes(root) * 60 > tokens / (7000 / 8)


def test_a_run_the_guard_ends_says_so_and_resumes_to_its_budget(tmp_path, train_run):
    """A guard far shorter than the run ends it early: the summary names the time guard and prints the
    plain warning; the same command with ckpt_path=last gets a whole new guard and trains to the plan."""
    common = [
        *SHORT,
        "trainer.max_steps=120",
        "trainer.checkpoint_every_n_steps=60",
        f"output_root={tmp_path}",
        "name=g",
    ]
    cut = train_run(*common, "trainer.max_time_minutes=0.002", "trainer.min_tokens_per_s=null")
    summary = json.loads((tmp_path / "g" / "summary.json").read_text())
    assert summary["ended_by"] == "time_guard" and summary["steps"] < 120
    assert "NOT THE BUDGETED RESULT: the time guard ended training" in cut.stdout
    assert "stopped early by the time guard" in cut.stdout
    done = train_run(*common, "trainer.max_time_minutes=30", "ckpt_path=last")
    summary = json.loads((tmp_path / "g" / "summary.json").read_text())
    assert summary["ended_by"] == "budget" and summary["steps"] == 120
    assert "NOT THE BUDGETED RESULT" not in done.stdout


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["trainer.max_steps=null", "trainer.max_tokens=null"], "trainer.max_steps"),
        (["trainer.max_steps=null", "trainer.max_tokens=0"], "trainer.max_tokens"),
        (["trainer.max_steps=-3"], "trainer.max_steps"),
        (["trainer.max_time_minutes=0"], "trainer.max_time_minutes"),
        (["trainer.min_tokens_per_s=-1"], "trainer.min_tokens_per_s"),
    ],
)
def test_bad_lengths_are_refused(overrides, key):
    with pytest.raises(ConfigError) as err:
        compose_root(*overrides)
    assert err.value.key == key


def test_schedule_is_a_function_of_the_step_alone():
    total, warmup = 50, 5
    values = [lr_multiplier(s, warmup, total, "cosine", 0.1) for s in range(total + 1)]
    assert values[0] == pytest.approx(1 / warmup) and values[warmup - 1] == pytest.approx(1.0)
    assert values[warmup] == pytest.approx(1.0) and values[total] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[warmup:], values[warmup + 1 :]))
    assert lr_multiplier(total + 10, warmup, total, "cosine", 0.1) == pytest.approx(0.1)  # stays at the floor
    assert lr_multiplier(30, warmup, total, "linear", 0.0) == pytest.approx(1 - 25 / 45)
    assert lr_multiplier(30, warmup, total, "constant", 0.0) == 1.0
    assert math.isclose(
        lr_multiplier(warmup + 45 // 2, warmup, total, "cosine", 0.0), 0.5 * (1 + math.cos(math.pi * 22 / 45))
    )


def test_token_budget_run_is_reproducible_and_shows_steps_in_its_bar(tmp_path, train_run):
    """Two runs of the same 5-step token budget and seed, in the precision this machine trains in
    (bf16-mixed where bf16 products are native, fp32 where they would be emulated, many times slower), log
    bit-identical losses; the bar counts optimizer steps against the planned 5 (not batches of an endless
    epoch)."""
    budget = ["trainer.max_steps=null", f"trainer.max_tokens={8 * 64 * 5 - 100}"]
    first = train_run(*SHORT, *budget, "trainer.enable_progress_bar=true", f"output_root={tmp_path / 'a'}")
    assert "training: 5 steps x 512 tokens = 2,560 tokens (trainer.max_tokens=2,460" in first.stdout
    assert "step 5/5" in first.stdout and "Epoch" not in first.stdout  # Lightning's bars write to stdout
    (run_dir,) = [p for p in (tmp_path / "a").iterdir() if p.is_dir()]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == summary["planned_steps"] == 5 and summary["train_tokens"] == 5 * 512

    second = train_run(*SHORT, *budget, "trainer.enable_progress_bar=false", f"output_root={tmp_path / 'b'}")
    assert list(first.losses.values()) == list(second.losses.values()) and len(first.losses) == 5
