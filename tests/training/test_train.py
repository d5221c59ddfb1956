"""End-to-end training runs: outputs, W&B offline readback, MQAR, and exact resume after SIGKILL."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import FAST, kill_after_microbatch, only_run_dir, start_train
from tests.helpers import losses_by_step as _losses


def test_short_run_writes_metrics_checkpoints_and_summary(train_run, tmp_path):
    result = train_run(
        *FAST,
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "trainer.checkpoint_every_n_steps=3",
        "logger=csv",
    )
    run_dir = only_run_dir(tmp_path)
    assert run_dir == result.run_dir
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary == json.loads(json.dumps(result.summary, default=str))
    assert summary["steps"] == 6
    assert {"loss", "bpb"} <= set(summary["val"]) and set(summary["baselines"]) == {"gzip-9", "xz-9e"}
    records = result.metrics
    keys = set().union(*records)
    for key in ("train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/mfu", "val/loss", "val/bpb"):
        assert key in keys, key
    # the largest activations at each validation (the ladder's max_activation), once per validation
    act = [r["act/glu_max"] for r in records if "act/glu_max" in r]
    assert len(act) == sum("val/loss" in r for r in records) >= 2 and all(v > 0 for v in act), act
    assert (run_dir / "checkpoints" / "last.ckpt").exists() and (run_dir / "checkpoints" / "step=6.ckpt").exists()
    assert "xz-9e" in result.stdout and "bpb" in result.stdout
    # the precision trainer.precision=auto resolved to on this machine, in the summary and the log
    from runtime.precision import resolve_precision

    assert summary["precision"] == resolve_precision("auto", "cpu")
    assert f"precision {summary['precision']})" in result.stdout and "precision: " in result.stdout


def test_keep_last_checkpoints_keeps_the_newest_periodic_ones(train_run):
    result = train_run(
        *FAST,
        "trainer.max_steps=8",
        "trainer.checkpoint_every_n_steps=2",
        "trainer.keep_last_checkpoints=2",
        "trainer.val_check_interval=100",
        "logger=csv",
    )
    names = sorted(p.name for p in (result.run_dir / "checkpoints").iterdir())
    assert names == ["last.ckpt", "step=6.ckpt", "step=8.ckpt"], names


@pytest.mark.slow  # 20 steps of the default-size model; the tiny-model runs here cover the same path
def test_named_ablation_from_the_readme(train_run):
    """`mixer=mqa ffn.activation=swiglu trainer.max_steps=20` trains the default-size model."""
    result = train_run(
        "mixer=mqa",
        "ffn.activation=swiglu",
        "trainer.max_steps=20",
        "trainer.compile=false",
        "trainer.max_time_minutes=null",
        "data.val_tokens=8192",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "logger=csv",
    )
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["steps"] == 20
    losses = [r["train/loss"] for r in result.metrics if "train/loss" in r]
    assert losses[-1] < losses[0] - 1.0  # it learns


def test_mqar_reports_accuracy(train_run):
    result = train_run(
        "data=mqar",
        "model=tiny",
        "trainer.max_steps=5",
        "trainer.compile=false",
        "trainer.max_time_minutes=null",
        "trainer.enable_progress_bar=false",
        "data.num_val_examples=128",
        "logger=csv",
    )
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert 0.0 <= summary["val"]["accuracy"] <= 1.0
    assert "accuracy" in result.stdout


def test_offline_wandb_run_is_readable_back(train_run, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    result = train_run(
        *FAST, "trainer.max_steps=4", "trainer.val_check_interval=2", "logger=wandb", "logger.tags=[smoke]"
    )
    run_dir = result.run_dir
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    wandb_cli = str(Path(sys.executable).with_name("wandb"))
    summary = subprocess.run(
        [wandb_cli, "leet", "inspect", "--summary", "--json", str(runs[0])], capture_output=True, text=True, timeout=120
    )
    assert summary.returncode == 0, summary.stderr
    info = json.loads(summary.stdout)
    assert info["state"] == "finished" and info["exit_code"] == 0  # finished cleanly
    assert info["config"]["mixer"]["name"] == "gqa" and info["config"]["model"]["d_model"] == 64
    assert {"mixer:gqa", "ffn:dense", "act:situ_glu", "residual:plain", "balancer:none", "smoke"} <= set(info["tags"])
    local = json.loads((run_dir / "summary.json").read_text())
    # the last value and the best (define_metric's summary)
    assert info["summary"]["val/bpb"]["last"] == pytest.approx(local["val"]["bpb"], rel=1e-6)
    assert info["summary"]["val/bpb"]["min"] <= info["summary"]["val/bpb"]["last"]

    records = subprocess.run(
        [wandb_cli, "leet", "inspect", "--json", str(runs[0])], capture_output=True, text=True, timeout=120
    )
    history = [
        json.loads(line)["history"]["item"] for line in records.stdout.splitlines() if '"type":"history"' in line
    ]
    wandb_losses = [h["train/loss"] for h in history if "train/loss" in h]
    jsonl_losses = [r["train/loss"] for r in result.metrics if "train/loss" in r]
    assert len(wandb_losses) == 4 and wandb_losses == pytest.approx(jsonl_losses, rel=1e-6)


THREADS_1 = {"OMP_NUM_THREADS": "1"}
MOE_QB = ["ffn=stable_latent_moe", "ffn.num_experts=8", "ffn.top_k=2", "ffn.expert_hidden_dim=32", "balancer=qb"]


@pytest.mark.parametrize(
    "model, accumulate, truncate_last",
    [
        pytest.param([], 1, False, id="dense", marks=pytest.mark.slow),
        # the default suite keeps the MoE case, which also kills mid-accumulation and truncates last.ckpt
        pytest.param([], 2, False, id="dense-kill-mid-accumulation", marks=pytest.mark.slow),
        pytest.param(MOE_QB, 2, True, id="moe-qb-kill-mid-accumulation-truncated-last"),
        pytest.param(MOE_QB, 1, False, id="moe-qb", marks=pytest.mark.slow),
    ],
)
def test_resume_after_sigkill_matches_uninterrupted_run(train_run, tmp_path, model, accumulate, truncate_last):
    """SIGKILL at a chosen micro-batch (train.py in a process of its own), then the same command with
    ckpt_path=last: every later loss and the final validation loss equal the uninterrupted run's, bit for bit.
    The uninterrupted and the resumed run train in this process, on the killed process's one thread."""
    common = [
        *FAST,
        *model,
        "trainer.max_steps=12",
        "trainer.checkpoint_every_n_steps=4",
        "trainer.val_check_interval=100",
        f"trainer.accumulate_grad_batches={accumulate}",
        "logger=csv",
    ]
    kill_after = 9 * accumulate  # first micro-batch of step 10: mid-step when accumulating; last checkpoint: step 8
    # CPU kernels split their sums by thread: every run here on one
    killing = start_train(*common, f"output_root={tmp_path / 'b'}", kill_after_microbatch(kill_after), env=THREADS_1)
    train_run(*common, f"output_root={tmp_path / 'a'}", threads=1)
    killed = killing.wait(timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    reference_dir = only_run_dir(tmp_path / "a")
    reference = _losses(reference_dir)

    run_dir = only_run_dir(tmp_path / "b")
    assert max(_losses(run_dir)) == 8  # it died during the 10th step (logged steps count from 0), before logging it
    last = run_dir / "checkpoints" / "last.ckpt"
    if truncate_last:
        data = last.read_bytes()
        last.write_bytes(data[: len(data) // 2])

    resumed = train_run(*common, f"output_root={tmp_path / 'b'}", "ckpt_path=last", threads=1)
    assert only_run_dir(tmp_path / "b") == run_dir  # continued in the same folder
    if truncate_last:
        assert f"refusing checkpoint {last} is unreadable (truncated or corrupt)" in resumed.stdout
        assert f"resuming from {run_dir / 'checkpoints' / 'step=8.ckpt'}" in resumed.stdout
    else:
        assert f"resuming from {last}" in resumed.stdout
    losses = _losses(run_dir)
    assert max(losses) == max(reference) == 11
    for step in range(8, 12):  # steps 9..12 were trained after the resume
        assert losses[step] == reference[step], (step, losses[step], reference[step])
    resumed_summary = json.loads((run_dir / "summary.json").read_text())
    reference_summary = json.loads((reference_dir / "summary.json").read_text())
    assert resumed_summary["val"]["loss"] == reference_summary["val"]["loss"]
    # the resumed run's tokens and compute count its steps from 0, not only those after the resume
    assert resumed_summary["train_tokens"] == reference_summary["train_tokens"]
    assert resumed_summary["compute"] == reference_summary["compute"]


@pytest.mark.parametrize("mixer", ["kda", "mla"])
# the default suite trains them on MQAR; -m slow adds the byte corpus
@pytest.mark.parametrize("data", [pytest.param("corpus", marks=pytest.mark.slow), "mqar"])
def test_linear_and_latent_attention_train(train_run, mixer, data):
    extra = (
        ["data.seq_len=64", "data.batch_size=8", "data.val_tokens=2048"]
        if data == "corpus"
        else ["data.num_val_examples=64"]
    )
    result = train_run(
        f"mixer={mixer}",
        f"data={data}",
        "model=tiny",
        "trainer.max_steps=4",
        "trainer.compile=false",
        "trainer.max_time_minutes=null",
        "trainer.enable_progress_bar=false",
        "logger=csv",
        *extra,
    )
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["val"]["loss"] < 20


def test_keep_last_checkpoints_must_keep_one():
    from components.registry import ConfigError
    from tests.helpers import compose_root

    with pytest.raises(ConfigError, match="trainer.keep_last_checkpoints: must be at least 1"):
        compose_root("trainer.keep_last_checkpoints=0")
    # how many checkpoints a run keeps does not make it another run (ckpt_path=last still finds it)
    from runtime.run_folder import config_fingerprint

    assert config_fingerprint(compose_root("trainer.keep_last_checkpoints=3")) == config_fingerprint(compose_root())
