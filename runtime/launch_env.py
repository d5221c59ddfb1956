"""Which external launch this process belongs to, and one run folder for all of its ranks.

``torchrun --nproc_per_node=N train.py ...`` and ``srun python train.py ...`` start every rank of one
run as a separate ``train.py`` process. Each would pick the run folder on its own, and a rank that
starts after rank 0 has created ``<name>`` would see it taken and choose ``<name>-2``. So rank 0
resolves the folder and publishes it in ``<output_root>/.launches/<launch id>``; the other ranks wait
for that record and use it. Detection follows Lightning's own order (torchrun first, since it can run
inside a SLURM allocation; SLURM only when Lightning would treat the tasks as ranks), so the processes
that agree on a folder are exactly those Lightning joins into one run.

Processes that Lightning itself spawns for ``trainer.devices=N`` are not external launches: they get
the folder from their parent (``runtime.handoff.pinned_run_dir``), which ``runtime/launch.py`` checks first.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

RECORDS_FOLDER = ".launches"
WAIT_TIMEOUT_S = 600.0
POLL_S = 0.2
# a record written this long before this process started belongs to an earlier launch with the same
# id (torchrun's static rendezvous reuses run id "none" and a fixed port); the margin absorbs clock
# differences between nodes
CLOCK_SKEW_S = 60.0
SLURM_INTERACTIVE_JOB_NAMES = ("bash", "interactive")  # Lightning leaves these to other launchers

_IMPORTED_AT = time.time()


@dataclass(frozen=True)
class ExternalLaunch:
    launcher: str  # "torchrun" or "slurm"
    launch_id: str  # the same on every rank of one launch, different for the next launch
    rank: int
    world_size: int
    started_at: float  # when this process started (wall clock)

    def record_path(self, output_root: str | Path) -> Path:
        return Path(output_root) / RECORDS_FOLDER / self.launch_id


def _process_started_at() -> float:
    """Wall-clock start of this process (Linux /proc); elsewhere, when this module was imported."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ticks_after_boot = int(fields[19])  # field 22 of stat(5), counted from field 3 here
        boot = next(
            float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime ")
        )
        return boot + ticks_after_boot / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)


def detect_external_launch(env: Mapping[str, str] = os.environ) -> Optional[ExternalLaunch]:
    """The multi-process launch this process is one rank of; None for a single process."""
    if env.get("TORCHELASTIC_RUN_ID") is not None:
        launcher = "torchrun"
        rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
        # the restart count separates torchrun's restarts of the same launch
        parts = [
            env["TORCHELASTIC_RUN_ID"],
            env.get("MASTER_ADDR", ""),
            env.get("MASTER_PORT", ""),
            env.get("TORCHELASTIC_RESTART_COUNT", "0"),
        ]
    elif "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in SLURM_INTERACTIVE_JOB_NAMES:
        launcher = "slurm"
        rank, world = int(env.get("SLURM_PROCID", "0")), int(env["SLURM_NTASKS"])
        # one srun step of one job; a requeued job keeps its id and counts steps from 0 again
        parts = [env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID", "batch"), env.get("SLURM_RESTART_COUNT", "0")]
    else:
        return None
    if world <= 1:
        return None  # e.g. a plain sbatch script or an salloc shell running one process
    return ExternalLaunch(launcher, _safe(f"{launcher}-{'-'.join(parts)}"), rank, world, _process_started_at())


def publish(path: Path, run_dir: Path, launch: ExternalLaunch) -> None:
    """Write the record atomically (readers never see half a file); rank 0 removes it at exit."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(
        json.dumps(
            {
                "run_dir": str(run_dir),
                "launch_id": launch.launch_id,
                "world_size": launch.world_size,
                "written_at": time.time(),
            }
        )
    )
    os.replace(tmp, path)
    # every other rank has read it once training runs (collectives need all ranks), so a later launch
    # that reuses the id cannot find it
    atexit.register(lambda: path.unlink(missing_ok=True))


def _read_record(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def wait_for_record(
    path: Path, launch: ExternalLaunch, timeout_s: float = WAIT_TIMEOUT_S, poll_s: float = POLL_S
) -> Path:
    """The run folder rank 0 published for this launch; TimeoutError naming the record if none comes."""
    deadline = time.monotonic() + timeout_s
    stale: Optional[dict] = None
    while True:
        record = _read_record(path)
        if record is not None:
            if record.get("written_at", 0.0) >= launch.started_at - CLOCK_SKEW_S:
                return Path(record["run_dir"])
            stale = record
        if time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    where = f"rank {launch.rank} of {launch.world_size} ({launch.launcher} launch {launch.launch_id})"
    if stale is not None:
        age = launch.started_at - stale.get("written_at", 0.0)
        detail = (
            f"{path} holds a record written {age:.0f} s before this process started (run folder "
            f"{stale.get('run_dir')}), "
            "left by an earlier launch with the same id; delete it, or give the launch a unique id (torchrun "
            "--rdzv-id)"
        )
    else:
        detail = (
            f"rank 0 did not publish {path}; check that rank 0 is running the same command "
            f"and that output_root is on a filesystem every node shares"
        )
    raise TimeoutError(f"{where} waited {timeout_s:.0f} s for the run folder: {detail}")


def agreed_run_dir(
    output_root: str | Path,
    resolve: Callable[[], Path],
    launch: Optional[ExternalLaunch] = None,
    timeout_s: float = WAIT_TIMEOUT_S,
    poll_s: float = POLL_S,
) -> Path:
    """``resolve()`` for a single process; for a multi-process launch, rank 0's answer on every rank.

    Every rank calls ``resolve()`` so that a bad setting (a missing ``ckpt_path``) fails on each rank
    with the same message instead of leaving the others waiting.
    """
    launch = launch if launch is not None else detect_external_launch()
    run_dir = resolve()
    if launch is None:
        return run_dir
    path = launch.record_path(output_root)
    if launch.rank == 0:
        publish(path, run_dir, launch)
        return run_dir
    return wait_for_record(path, launch, timeout_s, poll_s)
