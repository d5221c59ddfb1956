"""FSDP2 on two CPU processes: trains like one process, writes sharded checkpoints that load on one
process, survives SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from runtime.load_run import load_run
from tests.helpers import FAST, REPO, kill_after_microbatch, only_run_dir, run_train
from tests.helpers import losses_by_step as _losses

FSDP2 = [
    *FAST,
    "trainer=fsdp2",
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "trainer.precision=32-true",
    "trainer.max_steps=6",
    "trainer.checkpoint_every_n_steps=3",
    "trainer.val_check_interval=100",
    "logger=csv",
]


@pytest.mark.slow
def test_fsdp2_trains_resumes_from_its_sharded_checkpoint_and_refuses_a_truncated_shard(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    straight = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *FSDP2, f"output_root={tmp_path / 'a'}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    # killed during the 5th step: the newest checkpoint holds step 3
    killed = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *FSDP2, f"output_root={tmp_path / 'b'}", kill_after_microbatch(4)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    _, err = straight.communicate(timeout=600)
    assert straight.returncode == 0, err[-3000:]
    reference_dir = only_run_dir(tmp_path / "a")
    reference = _losses(reference_dir)

    one_process = run_train(
        *FAST,
        "trainer.precision=32-true",
        "trainer.max_steps=6",
        "trainer.checkpoint_every_n_steps=3",
        "logger=csv",
        f"output_root={tmp_path / 'c'}",
    )
    assert one_process.returncode == 0, one_process.stderr[-3000:]
    single = _losses(only_run_dir(tmp_path / "c"))
    assert all(reference[s] == pytest.approx(single[s], abs=1e-5) for s in single)  # same global batch, same model

    # a sharded checkpoint folder loads on one process, every rank's shard in place
    _, sharded = load_run(str(reference_dir / "checkpoints" / "step=3.ckpt"))
    _, whole = load_run(str(only_run_dir(tmp_path / "c") / "checkpoints" / "step=3.ckpt"))
    # the two runs agree to round-off in their losses; Adam's normalised steps spread that over the weights,
    # so the models are compared by their outputs (a model left at its initialisation is far off)
    ids = torch.randint(0, sharded.embed.weight.shape[0], (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (sharded(ids) - whole(ids)).abs().max() < 1e-3

    run_dir = only_run_dir(tmp_path / "b")
    last = run_dir / "checkpoints" / "last.ckpt"
    assert last.is_dir() and {p.name for p in last.glob("*.distcp")} == {
        "__0_0.distcp",
        "__1_0.distcp",
    }  # one shard per rank
    shard = last / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])

    # the same thread count as the runs above: CPU kernels split their sums by thread
    resumed = run_train(*FSDP2, f"output_root={tmp_path / 'b'}", "ckpt_path=last", env={"OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"refusing checkpoint {last} is unreadable: shard __1_0.distcp is truncated" in resumed.stdout
    assert f"resuming from {run_dir / 'checkpoints' / 'step=3.ckpt'}" in resumed.stdout
    losses = _losses(run_dir)
    for step in (3, 4, 5):  # trained after the resume
        assert losses[step] == reference[step], (step, losses[step], reference[step])
    final = json.loads((run_dir / "summary.json").read_text())["val"]["loss"]
    assert final == json.loads((reference_dir / "summary.json").read_text())["val"]["loss"]
