"""End-to-end runs of train.py: outputs, W&B offline readback, MQAR, and exact resume after SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from components.training.jsonl_logger import read_metrics
from tests.conftest import REPO, run_train

FAST = [
    "model=tiny", "data.seq_len=64", "data.batch_size=8", "data.val_tokens=2048",
    "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1", "trainer.compile=false",
    "trainer.max_time_minutes=null",
]


def only_run_dir(root: Path) -> Path:
    dirs = [p for p in root.iterdir() if p.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def test_short_run_writes_metrics_checkpoints_and_summary(tmp_path):
    result = run_train(*FAST, "trainer.max_steps=6", "trainer.val_check_interval=3",
                       "trainer.checkpoint_every_n_steps=3", f"output_root={tmp_path}", "logger=csv")
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = only_run_dir(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6
    assert {"loss", "bpb"} <= set(summary["val"]) and set(summary["baselines"]) == {"gzip-9", "xz-9e"}
    records = read_metrics(str(run_dir / "metrics.jsonl"))
    keys = set().union(*records)
    for key in ("train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/mfu", "val/loss", "val/bpb"):
        assert key in keys, key
    assert (run_dir / "checkpoints" / "last.ckpt").exists() and (run_dir / "checkpoints" / "step=6.ckpt").exists()
    assert "xz-9e" in result.stdout and "bpb" in result.stdout


def test_named_ablation_from_the_readme(tmp_path):
    """`mixer=mqa ffn.activation=swiglu trainer.max_steps=20` trains the default-size model."""
    result = run_train("mixer=mqa", "ffn.activation=swiglu", "trainer.max_steps=20", "trainer.compile=false", "trainer.max_time_minutes=null", "data.val_tokens=8192", "trainer.log_every_n_steps=1",
                       "trainer.enable_progress_bar=false", f"output_root={tmp_path}", "logger=csv")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((only_run_dir(tmp_path) / "summary.json").read_text())
    assert summary["steps"] == 20
    records = read_metrics(str(only_run_dir(tmp_path) / "metrics.jsonl"))
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert losses[-1] < losses[0] - 1.0  # it learns


def test_mqar_reports_accuracy(tmp_path):
    result = run_train("data=mqar", "model=tiny", "trainer.max_steps=5", "trainer.compile=false", "trainer.max_time_minutes=null", "trainer.enable_progress_bar=false",
                       "data.num_val_examples=128", f"output_root={tmp_path}", "logger=csv")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((only_run_dir(tmp_path) / "summary.json").read_text())
    assert 0.0 <= summary["val"]["accuracy"] <= 1.0
    assert "accuracy" in result.stdout


def test_offline_wandb_run_is_readable_back(tmp_path):
    result = run_train(*FAST, "trainer.max_steps=4", "trainer.val_check_interval=2", f"output_root={tmp_path}",
                       "logger=wandb", "logger.tags=[smoke]", env={"WANDB_MODE": "offline"})
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = only_run_dir(tmp_path)
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    wandb_cli = str(Path(sys.executable).with_name("wandb"))
    summary = subprocess.run([wandb_cli, "leet", "inspect", "--summary", "--json", str(runs[0])], capture_output=True, text=True, timeout=120)
    assert summary.returncode == 0, summary.stderr
    info = json.loads(summary.stdout)
    assert info["state"] == "finished" and info["exit_code"] == 0  # finished cleanly
    assert info["config"]["mixer"]["name"] == "gqa" and info["config"]["model"]["d_model"] == 64
    assert {"mixer:gqa", "ffn:dense", "act:situ_glu", "residual:plain", "balancer:none", "smoke"} <= set(info["tags"])
    local = json.loads((run_dir / "summary.json").read_text())
    assert info["summary"]["val/bpb"] == pytest.approx(local["val"]["bpb"], rel=1e-6)

    records = subprocess.run([wandb_cli, "leet", "inspect", "--json", str(runs[0])], capture_output=True, text=True, timeout=120)
    history = [json.loads(line)["history"]["item"] for line in records.stdout.splitlines() if '"type":"history"' in line]
    wandb_losses = [h["train/loss"] for h in history if "train/loss" in h]
    jsonl_losses = [r["train/loss"] for r in read_metrics(str(run_dir / "metrics.jsonl")) if "train/loss" in r]
    assert len(wandb_losses) == 4 and wandb_losses == pytest.approx(jsonl_losses, rel=1e-6)


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_metrics(str(run_dir / "metrics.jsonl")) if "train/loss" in r}


@pytest.mark.parametrize("accumulate", [1, 2])
def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path, accumulate):
    common = [*FAST, "trainer.max_steps=24", "trainer.checkpoint_every_n_steps=6", "trainer.val_check_interval=100",
              f"trainer.accumulate_grad_batches={accumulate}", "logger=csv"]
    straight = run_train(*common, f"output_root={tmp_path / 'a'}")
    assert straight.returncode == 0, straight.stderr[-3000:]
    reference = _losses(only_run_dir(tmp_path / "a"))

    out = tmp_path / "b"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), *common, f"output_root={out}"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if list(out.glob("*/checkpoints/step=6.ckpt")):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run_dir = only_run_dir(out)
    killed_at = max(_losses(run_dir))
    assert killed_at < 24

    resumed = run_train(*common, f"output_root={out}", "ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert only_run_dir(out) == run_dir  # continued in the same folder
    losses = _losses(run_dir)
    assert max(losses) == max(reference)
    for step in range(max(reference) - 5, max(reference) + 1):
        assert losses[step] == reference[step], (step, losses[step], reference[step])


@pytest.mark.parametrize("mixer", ["kda", "mla"])
@pytest.mark.parametrize("data", ["corpus", "mqar"])
def test_linear_and_latent_attention_train(tmp_path, mixer, data):
    extra = ["data.seq_len=64", "data.batch_size=8", "data.val_tokens=2048"] if data == "corpus" else ["data.num_val_examples=64"]
    result = run_train(f"mixer={mixer}", f"data={data}", "model=tiny", "trainer.max_steps=4", "trainer.compile=false",
                       "trainer.max_time_minutes=null", "trainer.enable_progress_bar=false", f"output_root={tmp_path}", "logger=csv", *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((only_run_dir(tmp_path) / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["val"]["loss"] < 20
