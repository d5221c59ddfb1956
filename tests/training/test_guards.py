"""Guarded training: non-finite steps stop (or are skipped) naming the step with the last checkpoint
intact; W&B failures never end a run."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from runtime.checkpoints.read import load_checkpoint_file
from runtime.jsonl_logger import read_metrics
from runtime.lit_module import NonFiniteTrainingError
from tests.helpers import FAST, kill_after_microbatch, only_run_dir, run_train

EXPLODING = [
    *FAST,
    "trainer.max_steps=30",
    "optimizer.lr=1e6",
    "optimizer.warmup_steps=0",
    "trainer.checkpoint_every_n_steps=1",
    "trainer.val_check_interval=1000",
    "logger=csv",
]


def _all_finite(state: dict) -> bool:
    return all(torch.isfinite(t).all() for t in state.values() if torch.is_tensor(t) and t.is_floating_point())


def test_planted_nan_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    # train.py in a process of its own: exit status 3 and the one error line are the contract here
    result = run_train(*EXPLODING, f"output_root={tmp_path}")
    assert result.returncode == 3, result.stderr[-3000:]
    match = re.search(
        r"error: non-finite (loss|gradient norm) at optimizer step (\d+): training stopped before the update",
        result.stderr,
    )
    assert match, result.stderr[-3000:]
    bad_step = int(match.group(2))
    run_dir = only_run_dir(tmp_path)
    last = load_checkpoint_file(str(run_dir / "checkpoints" / "last.ckpt"))
    assert last["global_step"] == bad_step - 1  # the update of the bad step was never applied or saved
    assert _all_finite(last["state_dict"])
    assert json.loads((run_dir / "run.json").read_text())["status"] == "failed"


def test_skip_mode_leaves_weights_untouched_then_gives_up(tmp_path, train_run):
    with pytest.raises(NonFiniteTrainingError) as err:  # train.py's exit status 3
        train_run(*EXPLODING, "trainer.on_nonfinite=skip", "trainer.max_skipped_steps=3")
    assert "(3 steps skipped in a row, trainer.max_skipped_steps=3)" in str(err.value)
    run_dir = only_run_dir(tmp_path)
    skipped = [
        r["train/skipped_steps"] for r in read_metrics(str(run_dir / "metrics.jsonl")) if "train/skipped_steps" in r
    ]
    assert skipped == [1.0, 2.0, 3.0]
    checkpoints = sorted(run_dir.glob("checkpoints/step=*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
    last_three = [load_checkpoint_file(str(p))["state_dict"] for p in checkpoints[-3:]]
    for later in last_three[1:]:  # skipped steps changed no weight
        assert all(torch.equal(later[k], last_three[0][k]) for k in later)


def test_unreachable_wandb_server_falls_back_to_offline(tmp_path, train_run, monkeypatch):
    for name, value in {"WANDB_API_KEY": "0" * 40, "WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_MODE": ""}.items():
        monkeypatch.setenv(name, value)
    result = train_run(*FAST, "trainer.max_steps=2", "logger=wandb", "logger.mode=online", "logger.init_timeout_s=5")
    assert "warning: W&B online run could not start" in result.stdout
    run_dir = only_run_dir(tmp_path)
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1
    assert json.loads((run_dir / "run.json").read_text())["wandb_id"] in offline[0].name
    assert not math.isnan(json.loads((run_dir / "summary.json").read_text())["val"]["loss"])


def test_wandb_logging_failure_mid_run_switches_wandb_off(monkeypatch, capsys):
    from runtime.safe_wandb import SafeWandbLogger

    calls = []

    def broken(self, metrics, step):
        calls.append(step)
        raise ConnectionError("server went away")

    monkeypatch.setattr(SafeWandbLogger, "write_row", broken)
    logger = SafeWandbLogger(offline=True, mode="offline")
    logger.log_metrics({"train/loss": 1.0}, step=1)
    logger.log_metrics({"train/loss": 0.9}, step=2)  # no second attempt, no exception
    assert calls == [1] and logger.broken
    assert "W&B logging failed (ConnectionError: server went away)" in capsys.readouterr().out


@pytest.mark.slow
def test_resume_continues_the_same_wandb_run(tmp_path, train_run, monkeypatch):
    """A killed run resumed with ckpt_path=last logs into the same W&B run id (offline: a second
    directory of the same run, which `wandb sync` uploads as one run)."""
    import signal

    common = [
        *FAST,
        "trainer.max_steps=4",
        "trainer.checkpoint_every_n_steps=2",
        "trainer.val_check_interval=100",
        "logger=wandb",
        f"output_root={tmp_path}",
    ]
    killed = run_train(*common, kill_after_microbatch(2), env={"WANDB_MODE": "offline"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    run_dir = only_run_dir(tmp_path)
    first_id = json.loads((run_dir / "run.json").read_text())["wandb_id"]
    monkeypatch.setenv("WANDB_MODE", "offline")
    train_run(*common, "ckpt_path=last")
    assert json.loads((run_dir / "run.json").read_text())["wandb_id"] == first_id
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(p.name.endswith(f"-{first_id}") for p in runs)
