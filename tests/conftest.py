"""Shared test setup: offline W&B, a GPU marker that skips without CUDA, small helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_DISABLE_GIT", "true")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_train(*overrides: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python train.py overrides...`` in a subprocess from the repository root."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, str(REPO / "train.py"), *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env,
    )


@pytest.fixture
def train_cmd():
    return run_train
