"""The folder a run writes into, and one folder for every process of a run.

A fresh run gets ``<output_root>/<name>-<config hash>`` (``-2``, ``-3``, ... when that already holds
results), so the same command with ``ckpt_path=last`` finds the run to resume; a ``ckpt_path`` file
continues in the run folder it belongs to.

Every process of one run must write into the same folder. The ranks Lightning starts itself
(``trainer.devices=N``) re-run ``train.py`` with ``hydra.run.dir`` set to it. ``torchrun
--nproc_per_node=N train.py ...`` and ``srun python train.py ...`` start every rank as a separate process:
each would pick the folder on its own, and a rank that starts after rank 0 has created ``<name>`` would see
it taken and choose ``<name>-2``. So rank 0 resolves the folder and publishes it in
``<output_root>/.launches/<launch id>``; the other ranks wait for that record and use it. Detection follows
Lightning's own order (torchrun first, since it can run inside a SLURM allocation; SLURM only when Lightning
would treat the tasks as ranks), so the processes that agree on a folder are exactly those Lightning joins
into one run.
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

from components.registry import ConfigError
from runtime.checkpoints import layout
from runtime.config import RootConfig, to_container

RECORDS_FOLDER = ".launches"
WAIT_TIMEOUT_S = 600.0
POLL_S = 0.2
# a record written this long before this process started belongs to an earlier launch with the same
# id (torchrun's static rendezvous reuses run id "none" and a fixed port); the margin absorbs clock
# differences between nodes
CLOCK_SKEW_S = 60.0
SLURM_INTERACTIVE_JOB_NAMES = ("bash", "interactive")  # Lightning leaves these to other launchers

_IMPORTED_AT = time.time()


def default_run_name(root: RootConfig) -> str:
    """The run's name when ``name`` is unset: data, mixers, FFNs, residual scheme and size."""
    plan = root.decoder_config().layers
    mixers = "+".join(sorted({s.mixer.name for s in plan}))
    ffns = "+".join(sorted({s.ffn.name for s in plan}))
    return f"{root.data.name}-{mixers}-{ffns}-{root.residual.name}-d{root.model.d_model}x{root.model.n_layers}"


def config_fingerprint(root: RootConfig) -> str:
    """Six hex digits that tell two configurations apart: everything that changes what a run trains."""
    data = to_container(root)
    data.pop("ckpt_path", None)
    data.pop("callbacks", None)  # extra callbacks observe or interrupt a run; they do not make it another run
    # how a run is observed, fits in memory or keeps its checkpoints, not what it trains
    for key in ("profiler", "activation_checkpointing", "keep_last_checkpoints"):
        data["trainer"].pop(key, None)
    return hashlib.sha1(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:6]


def resolve_run_dir(root: RootConfig) -> Path:
    """Where a single run writes. Fresh runs never reuse a folder that holds results."""
    base = Path(root.output_root) / (root.name or f"{default_run_name(root)}-{config_fingerprint(root)}")
    # the run's folders so far: base, base-2, base-3, ... (consecutive)
    existing = list(
        itertools.takewhile(
            Path.exists, (base.with_name(f"{base.name}-{i}") if i > 1 else base for i in itertools.count(1))
        )
    )
    if root.ckpt_path == "last":
        resumable = [p for p in existing if layout.has_checkpoint(str(p))]
        if resumable:
            return resumable[-1].resolve()
    elif root.ckpt_path is not None:
        ckpt = Path(root.ckpt_path)
        if not (ckpt.is_file() or layout.is_sharded(str(ckpt))):
            raise ConfigError(
                "ckpt_path",
                f"checkpoint not found: {root.ckpt_path} (use a .ckpt file or sharded .ckpt folder, 'last' or null)",
            )
        if ckpt.resolve().parent.name == layout.FOLDER:
            return ckpt.resolve().parent.parent  # continue in the run folder the checkpoint belongs to
    empty = [p for p in existing if not any(p.iterdir())]
    if empty:
        return empty[0].resolve()
    n = len(existing) + 1
    return (base if n == 1 else base.with_name(f"{base.name}-{n}")).resolve()


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
