"""Runs trained in the test process (tests/helpers.py ``train_in_process``, the ``train_run`` fixture) are the
runs ``train.py`` trains in a process of its own, and leave the test process as they found it."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import sys
import warnings

import numpy as np
import torch

from tests.helpers import FAST, isolated_process_state, losses_by_step, only_run_dir, run_train

RUN = [*FAST, "trainer.max_steps=3", "trainer.val_check_interval=2", "logger=csv"]


def _process_state() -> dict:
    """What a training run could leave changed in its process, as comparable values."""
    import wandb
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    loggers = {name: lg for name, lg in logging.Logger.manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    return {
        "environment": dict(os.environ),
        "torch rng": torch.get_rng_state().tolist(),
        "python rng": random.getstate(),
        "numpy rng": np.random.get_state()[1].tolist(),
        "threads": torch.get_num_threads(),
        "deterministic": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        "default dtype": torch.get_default_dtype(),
        "matmul precision": torch.get_float32_matmul_precision(),
        "warning filters": list(warnings.filters),
        "logger levels": {name: (lg.level, len(lg.handlers), lg.propagate) for name, lg in loggers.items()},
        "root logger": (logging.getLogger().level, list(logging.getLogger().handlers)),
        "signal handlers": [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)],
        "lightning rank": getattr(rank_zero_only, "rank", None),
        "argv": list(sys.argv),
        "cwd": os.getcwd(),
        "wandb run": wandb.run,
        "hydra": (GlobalHydra.instance().is_initialized(), HydraConfig.initialized()),
    }


def _changed(before: dict, after: dict) -> list[str]:
    # loggers first made during the run are new, not changed
    after = {
        **after,
        "logger levels": {k: v for k, v in after["logger levels"].items() if k in before["logger levels"]},
    }
    return [key for key in before if before[key] != after[key]]


def test_a_run_in_this_process_equals_the_same_command_in_its_own_process(tmp_path, train_run):
    # CPU kernels split their sums by thread: both on one
    command = run_train(*RUN, f"output_root={tmp_path / 'command'}", env={"OMP_NUM_THREADS": "1"})
    assert command.returncode == 0, command.stderr[-3000:]
    in_process = train_run(*RUN, f"output_root={tmp_path / 'in_process'}", threads=1)
    command_dir = only_run_dir(tmp_path / "command")
    assert in_process.run_dir == only_run_dir(tmp_path / "in_process")
    assert in_process.losses == losses_by_step(command_dir) and len(in_process.losses) == 3
    summary = json.loads((command_dir / "summary.json").read_text())
    assert in_process.summary["val"] == summary["val"] and in_process.summary["steps"] == summary["steps"] == 3
    assert sorted(p.name for p in (in_process.run_dir / "checkpoints").iterdir()) == sorted(
        p.name for p in (command_dir / "checkpoints").iterdir()
    )
    assert "validation loss" in in_process.stdout and "validation loss" in command.stdout


def test_a_run_in_this_process_leaves_the_process_as_it_found_it(tmp_path):
    """A run changes the random generators, deterministic-algorithm flags, environment (W&B's service and
    mode, Lightning's seed), warning filters and a Lightning logger's level; all of it is put back, and a
    second run from there trains the same losses."""
    from runtime.train_command import prepare_single_run
    from runtime.training_run import train

    def train_here(folder: str) -> dict[int, float]:
        run = prepare_single_run([*RUN, "logger=wandb", f"output_root={tmp_path / folder}"])
        train(run.root, run.run_dir)
        return losses_by_step(run.run_dir)

    before = _process_state()
    with isolated_process_state():
        first = train_here("first")
        during = _process_state()
    after = _process_state()
    # what the run changed: without the reset, these would leak into every later test
    assert {"environment", "torch rng", "numpy rng", "deterministic", "warning filters", "logger levels"} <= set(
        _changed(before, during)
    ), _changed(before, during)
    assert _changed(before, after) == []
    with isolated_process_state():
        assert train_here("second") == first
    assert _changed(before, _process_state()) == []
