"""Shared test setup: offline W&B, a GPU marker that skips without CUDA, one share of the cores per
pytest-xdist worker, and training runs in the test's own process (``train_run``, ``trained_run``; the
functions behind them are in tests/helpers.py)."""

from __future__ import annotations

import os

import pytest
import torch

from runtime.cpu_threads import threads_per_job

# under pytest-xdist each worker is one of N concurrent test processes: the cores are split between them,
# for this process and for the training runs it starts (spinning OpenMP threads on oversubscribed cores
# slow everything down several-fold)
_THREADS = threads_per_job(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), dict(os.environ))
if _THREADS:
    os.environ.update(_THREADS)
    torch.set_num_threads(int(_THREADS["OMP_NUM_THREADS"]))

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_DISABLE_GIT", "true")


@pytest.fixture(autouse=True)
def _runs_start_their_own_wandb_service(monkeypatch):
    """A test that used W&B in this process leaves its service's address in the environment; training
    runs started as subprocesses would attach to that service and find a killed run's id still "in use"."""
    monkeypatch.delenv("WANDB_SERVICE", raising=False)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def train_run(tmp_path):
    """``train_run(*overrides)``: ``python train.py overrides...`` trained in this process into ``tmp_path``
    (unless the overrides name ``output_root``); a ``tests.helpers.TrainedRun`` (run folder, summary, console
    output, metrics rows, losses)."""
    from tests.helpers import train_in_process

    def train(*overrides: str, threads: int | None = None):
        if not any(o.startswith("output_root=") for o in overrides):
            overrides = (f"output_root={tmp_path}", *overrides)
        return train_in_process(*overrides, threads=threads)

    return train


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """``trained_run(*overrides)``: like ``train_run``, trained once per module for the same overrides, in a
    folder of its own, for the tests of a module that read one run."""
    from tests.helpers import train_in_process

    runs = {}

    def train(*overrides: str, threads: int | None = None):
        if (overrides, threads) not in runs:
            output_root = f"output_root={tmp_path_factory.mktemp('run')}"
            runs[overrides, threads] = train_in_process(output_root, *overrides, threads=threads)
        return runs[overrides, threads]

    return train
