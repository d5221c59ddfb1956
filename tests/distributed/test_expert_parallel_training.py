"""``trainer.expert_parallel`` trains k3_tiny (MTP, Stable LatentMoE, QB, Muon) as one process does.

Runs of 20 steps, all through ``tests.distributed.sharded_train`` (train.py with the gradient norm of
runtime/grad_norm.py, and the routers' final biases written out): one process; DDP on 4 ranks, whose distance
from one process is the floor (the rounding of splitting the batch four ways and adding partial gradients);
FSDP2 with expert parallelism at (devices, expert_parallel) = (4, 2), (2, 2) and (4, 4). Each must sit
within the floor in its losses, MTP loss, gradient norm, MaxVio and final QB biases; each planted defect
(FSDP's default division of the expert gradients, router statistics summed over the expert-parallel group
only) must leave it. Gradient clipping is off: Lightning's clipping of sharded gradients cannot take two
meshes (runtime/grad_norm.py clips them, where the training step calls it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.jsonl_logger import read_metrics
from tests.distributed.sharded_train import DEFECTS
from tests.helpers import start_python

K3_TINY = [
    "experiment=k3_tiny",
    "data=corpus",
    "data.seq_len=32",
    "data.batch_size=8",
    "data.val_tokens=1024",
    "trainer.accelerator=cpu",
    "trainer.precision=32-true",
    "trainer.compile=false",
    "trainer.gradient_clip_val=null",
    "trainer.max_steps=20",
    "trainer.max_time_minutes=null",
    "trainer.val_check_interval=1000",
    "trainer.checkpoint_every_n_steps=1000",
    "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1",
    "logger=csv",
]
COMPARED = ("train/loss", "train/mtp_loss", "train/grad_norm", "balance/maxvio/mean", "balance/maxvio/max")
MESHES = {"ep4x2": (4, 2), "ep2x2": (2, 2), "ep4x4": (4, 4)}


def _ep(devices: int, ep: int) -> list[str]:
    return ["trainer=fsdp2", f"trainer.devices={devices}", f"trainer.expert_parallel={ep}"]


def _run_all(tmp_path: Path, runs: dict[str, tuple[list[str], str]]) -> dict[str, dict]:
    procs = {}
    for name, (overrides, defect) in runs.items():
        out = tmp_path / name
        biases = f"+callbacks.biases={{_target_:tests.distributed.sharded_train.SaveRouterBiases,path:{out}.biases}}"
        procs[name] = start_python(
            "-m",
            "tests.distributed.sharded_train",
            *K3_TINY,
            *overrides,
            f"output_root={out}",
            biases,
            env={"OMP_NUM_THREADS": "1", "PLANTED_DEFECT": defect},
        )
    results = {}
    for name, proc in procs.items():
        done = proc.wait(timeout=1800)
        assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"
        (run_dir,) = [p for p in (tmp_path / name).iterdir() if p.is_dir()]
        records = read_metrics(str(run_dir / "metrics.jsonl"))
        series = {key: {r["step"]: r[key] for r in records if key in r} for key in COMPARED}
        series["biases"] = torch.load(f"{tmp_path / name}.biases")
        results[name] = series
    return results


def _gaps(a: dict, b: dict) -> dict[str, float]:
    """Largest relative difference per compared series, and the largest bias difference."""
    gaps = {}
    for key in COMPARED:
        assert len(a[key]) == 20 and sorted(a[key]) == sorted(b[key]), key
        gaps[key] = max(abs(a[key][s] - b[key][s]) / abs(a[key][s]) for s in a[key])
    gaps["biases"] = max(float((x - y).abs().max()) for x, y in zip(a["biases"], b["biases"]))
    return gaps


def _within(gap: dict[str, float], floor: dict[str, float]) -> dict[str, bool]:
    return {key: gap[key] <= 3 * floor[key] + 1e-6 for key in gap}


@pytest.mark.slow
def test_expert_parallel_trains_like_one_process_and_planted_defects_are_caught(tmp_path):
    runs = {"one": ([], ""), "ddp4": (["trainer=ddp", "trainer.devices=4"], "")}
    runs.update({name: (_ep(*mesh), "") for name, mesh in MESHES.items()})
    runs.update({defect: (_ep(4, 2), defect) for defect in DEFECTS})
    results = _run_all(tmp_path, runs)
    one = results["one"]
    floor = _gaps(one, results["ddp4"])
    print("floor (ddp, 4 ranks):", floor)
    for name in MESHES:
        gap = _gaps(one, results[name])
        print(name, gap)
        assert all(_within(gap, floor).values()), (name, gap, floor)
    for defect in DEFECTS:
        gap = _gaps(one, results[defect])
        print(defect, gap)
        assert not all(_within(gap, floor).values()), (defect, gap, floor)
