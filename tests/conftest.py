"""Shared test setup: offline W&B, a GPU marker that skips without CUDA, and one share of the cores per
pytest-xdist worker (helpers: tests/helpers.py)."""

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
def train_cmd():
    from tests.helpers import run_train  # imported after the setup above (its fork server keeps that environment)

    return run_train
