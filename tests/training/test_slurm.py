"""Multi-node launching without a cluster: Lightning's view of a simulated SLURM task, the sbatch script
the submitit launcher would submit, and the run-folder agreement between the ranks of one launch."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from components.registry import ConfigError
from runtime.compose import compose
from runtime.run_folder import ExternalLaunch, agreed_run_dir, detect_external_launch, resolve_run_dir
from tests.helpers import compose_root

# task 9 of `srun` over 2 nodes x 8 tasks: the second task on the second node
SLURM_TASK_ENV = {
    "SLURM_JOB_ID": "424242",
    "SLURM_JOB_NAME": "k3-pretrain",
    "SLURM_STEP_ID": "0",
    "SLURM_NTASKS": "16",
    "SLURM_NTASKS_PER_NODE": "8",
    "SLURM_NNODES": "2",
    "SLURM_NODELIST": "gpu[017-018]",
    "SLURM_PROCID": "9",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
}
OTHER_LAUNCHERS = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_RESTART_COUNT", "K3_RUN_DIR")


@pytest.fixture
def slurm_task(monkeypatch):
    for key in OTHER_LAUNCHERS:
        monkeypatch.delenv(key, raising=False)
    for key, value in SLURM_TASK_ENV.items():
        monkeypatch.setenv(key, value)
    # Lightning writes these when it reads the cluster's address; set them so they are restored
    monkeypatch.setenv("MASTER_ADDR", "gpu017")
    monkeypatch.setenv("MASTER_PORT", "14242")


def test_lightning_takes_ranks_from_slurm_and_spawns_nothing(slurm_task, tmp_path, monkeypatch):
    from lightning.fabric.plugins.environments import SLURMEnvironment
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
    from lightning_utilities.core.rank_zero import rank_zero_only

    from runtime.training_run import build_trainer

    monkeypatch.setattr(rank_zero_only, "rank", 0)  # building a rank-9 trainer sets it process-wide
    root = compose_root("trainer=slurm", "trainer.accelerator=cpu", f"output_root={tmp_path}", "logger=csv")
    trainer = build_trainer(root, str(tmp_path), [], [])
    strategy = trainer.strategy
    assert isinstance(strategy, DDPStrategy)
    assert isinstance(strategy.cluster_environment, SLURMEnvironment)
    assert (trainer.world_size, trainer.global_rank, trainer.local_rank, trainer.node_rank, trainer.num_nodes) == (
        16,
        9,
        1,
        1,
        2,
    )
    assert strategy.cluster_environment.main_address == "gpu017"
    # DDP's launcher re-runs the script for each local rank unless the cluster started them already
    launcher = strategy.launcher
    assert isinstance(launcher, _SubprocessScriptLauncher) and launcher.cluster_environment.creates_processes_externally

    def spawn(*args):
        raise AssertionError("Lightning would start its own processes under SLURM")

    monkeypatch.setattr(launcher, "_call_children_scripts", spawn)
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # keeps launch() off the thread count
    assert launcher.launch(lambda: "this rank trains") == "this rank trains"  # also checks --ntasks-per-node == devices
    assert launcher.procs == []


def test_slurm_launcher_renders_the_job_shape_of_the_trainer(tmp_path, monkeypatch):
    import submitit
    from hydra.utils import instantiate
    from submitit.slurm.slurm import SlurmExecutor

    cfg = compose(
        [
            "hydra/launcher=slurm",
            "trainer=slurm",
            "trainer.num_nodes=4",
            "trainer.devices=8",
            "hydra.launcher.partition=gpu",
            f"output_root={tmp_path}",
        ]
    )
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert {k: params[k] for k in ("nodes", "tasks_per_node", "gpus_per_node", "timeout_min", "partition")} == {
        "nodes": 4,
        "tasks_per_node": 8,
        "gpus_per_node": 8,
        "timeout_min": 1440,
        "partition": "gpu",
    }
    sweep_dir = Path(cfg.hydra.sweep.dir)
    assert Path(params["submitit_folder"]).parent.parent == sweep_dir

    # the plugin's own launch(), up to submission: render the sbatch file instead of calling sbatch
    monkeypatch.setattr(SlurmExecutor, "affinity", classmethod(lambda cls: 2))  # no srun here
    rendered: list[str] = []

    def render_instead_of_submit(executor, fn, *job_args):
        rendered.append(
            executor._executor._make_submission_file_text("python -u -m submitit.core._submit FOLDER", "uid")
        )
        return []

    monkeypatch.setattr(submitit.AutoExecutor, "map_array", render_instead_of_submit)
    launcher = instantiate(cfg.hydra.launcher)
    launcher.config = cfg
    launcher.launch([["seed=1"]], initial_job_idx=0)
    script = rendered[0].splitlines()
    for flag in (
        "--nodes=4",
        "--ntasks-per-node=8",
        "--gpus-per-node=8",
        "--time=1440",
        "--partition=gpu",
        "--cpus-per-task=8",
        "--mem=0GB",
    ):
        assert f"#SBATCH {flag}" in script, flag
    assert any(line.startswith("srun ") for line in script)  # one task per GPU, started by srun


def test_cpu_cluster_drops_the_gpu_request():
    cfg = compose(
        ["hydra/launcher=slurm", "trainer=slurm", "trainer.accelerator=cpu", "hydra.launcher.gpus_per_node=null"]
    )
    assert cfg.hydra.launcher.gpus_per_node is None and cfg.hydra.launcher.tasks_per_node == 8


# ------------------------------------------------------------------------------------------------
# One run folder for every rank
# ------------------------------------------------------------------------------------------------
def test_detects_slurm_and_torchrun_tasks_but_not_single_processes():
    slurm = detect_external_launch(SLURM_TASK_ENV)
    assert (slurm.launcher, slurm.rank, slurm.world_size) == ("slurm", 9, 16)
    assert slurm.launch_id == "slurm-424242-0-0"
    torchrun = {
        "TORCHELASTIC_RUN_ID": "abc",
        "RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }
    inside_slurm = detect_external_launch({**SLURM_TASK_ENV, **torchrun})  # torchrun within an allocation
    assert (inside_slurm.launcher, inside_slurm.rank, inside_slurm.world_size) == ("torchrun", 1, 2)
    assert detect_external_launch({**torchrun, "TORCHELASTIC_RESTART_COUNT": "1"}).launch_id != inside_slurm.launch_id
    assert detect_external_launch({}) is None
    assert detect_external_launch({**SLURM_TASK_ENV, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None  # sbatch shell
    assert (
        detect_external_launch({**SLURM_TASK_ENV, "SLURM_JOB_NAME": "interactive"}) is None
    )  # Lightning ignores it too
    # what Lightning's own DDP children see: no launcher of ours (they get K3_RUN_DIR instead)
    assert (
        detect_external_launch(
            {"LOCAL_RANK": "1", "WORLD_SIZE": "2", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4"}
        )
        is None
    )


def _ranks(run_id: str) -> list[ExternalLaunch]:
    """Rank 0 and rank 1 of ``torchrun --nproc_per_node=2``, as each sees its environment."""
    env = {"TORCHELASTIC_RUN_ID": run_id, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    return [detect_external_launch({**env, "RANK": str(rank)}) for rank in range(2)]


def _start_rank(launch: ExternalLaunch, root, results: dict, **kwargs) -> threading.Thread:
    def rank_main():
        run_dir = agreed_run_dir(root.output_root, lambda: resolve_run_dir(root), launch, **kwargs)
        run_dir.mkdir(parents=True, exist_ok=True)  # Hydra creates the folder and the run fills it
        (run_dir / f"rank{launch.rank}.log").write_text("started")
        results[launch.rank] = run_dir

    thread = threading.Thread(target=rank_main)
    thread.start()
    return thread


@pytest.mark.parametrize("first", [0, 1])
def test_ranks_agree_on_one_folder_whichever_starts_first(tmp_path, first):
    root = compose_root("model=tiny", f"output_root={tmp_path}", "logger=csv")
    ranks = _ranks(f"order{first}")
    results: dict[int, Path] = {}
    early = _start_rank(ranks[first], root, results, poll_s=0.01)
    if first == 0:
        early.join()  # rank 0 has made and filled the folder: a late rank resolving alone would pick <name>-2
        assert resolve_run_dir(root) != results[0]
    else:
        time.sleep(0.2)  # rank 1 is waiting
        assert 1 not in results
    late = _start_rank(ranks[1 - first], root, results, poll_s=0.01)
    early.join(10)
    late.join(10)
    assert results[0] == results[1]
    run_dirs = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert run_dirs == [results[0]]
    record = json.loads(ranks[0].record_path(tmp_path).read_text())
    assert record["run_dir"] == str(results[0])


def test_waiting_rank_without_rank_0_times_out_naming_the_record(tmp_path):
    rank1 = _ranks("lonely")[1]
    with pytest.raises(
        TimeoutError, match=r"rank 1 of 2 .*torchrun-lonely.* rank 0 did not publish .*\.launches/torchrun-lonely"
    ):
        agreed_run_dir(tmp_path, lambda: tmp_path / "mine", rank1, timeout_s=0.1, poll_s=0.01)


def test_record_left_by_an_earlier_launch_with_the_same_id_is_not_used(tmp_path):
    rank1 = _ranks("none")[1]  # torchrun's run id for a static rendezvous: the same for every launch
    path = rank1.record_path(tmp_path)
    path.parent.mkdir()
    path.write_text(json.dumps({"run_dir": str(tmp_path / "old"), "written_at": time.time() - 3600}))
    with pytest.raises(TimeoutError, match=r"earlier launch with the same id"):
        agreed_run_dir(tmp_path, lambda: tmp_path / "mine", rank1, timeout_s=0.1, poll_s=0.01)


def test_a_bad_setting_fails_on_every_rank_instead_of_waiting(tmp_path):
    def resolve():
        raise ConfigError("ckpt_path", "checkpoint not found: gone.ckpt")

    with pytest.raises(ConfigError, match="gone.ckpt"):
        agreed_run_dir(tmp_path, resolve, _ranks("bad")[1], timeout_s=600)
