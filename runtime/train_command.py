"""``python train.py [flags] [overrides]``: one path from the command line to ``runtime.training_run.train``.

    --help, --cfg job|hydra|all   printed from the same composition a run uses (runtime/config_preview.py)
    --info, --hydra-help, ...     Hydra's own answers
    one run                       composed and validated once, checked to fit, its folder chosen
                                  (runtime/run_folder.py); then Hydra's ``run_job`` writes ``.hydra/`` and
                                  calls ``train()`` with the validated config
    -m (multirun)                 every job composed and validated up front; then Hydra's sweeper and
                                  launcher run the jobs. Hydra composes each job again from its overrides
                                  (its launchers only pass overrides): that is the one second composition, and
                                  a job takes the config validated here instead of validating again (a job
                                  that runs in another process -- a SLURM node, an Optuna trial's sampled
                                  values -- validates once where it runs)

Nothing is written before the config is valid. Exit status: 2 for a config error (one line naming the key),
3 when training stopped on a non-finite loss or gradient, 4 when a checkpoint could not be written.

The ranks of one run: Lightning starts the other ranks of ``trainer.devices=N`` by re-running this
command with ``hydra.run.dir`` set to the run's folder (its Hydra integration), so a run given
``hydra.run.dir`` writes there; ``torchrun`` and ``srun`` ranks agree on a folder through
``runtime/run_folder.py``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import hydra
from hydra._internal.callbacks import Callbacks  # what Hydra's own run and launchers pass to run_job
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import run_job
from hydra.types import HydraContext, RunMode
from omegaconf import DictConfig, open_dict, read_write

from components.registry import ConfigError
from runtime import config_preview
from runtime.checkpoints.branching import with_folder_composition
from runtime.compose import CONFIG_NAME, JOB_NAME, compose, conf_dir, strip_hydra
from runtime.config import RootConfig, register_all
from runtime.memory_check import check_fits
from runtime.multirun import check_launcher, expand_sweep, swept_keys, varied_keys
from runtime.run_folder import agreed_run_dir, resolve_run_dir
from runtime.sweep_job import current_job, publish_varied_keys, split_override
from runtime.validation import validate

EXIT_CONFIG_ERROR = 2
EXIT_NONFINITE = 3
EXIT_CHECKPOINT_WRITE = 4
# information flags Hydra answers itself
HYDRA_INFO_FLAGS = {"--hydra-help", "--info", "-i", "--shell-completion", "-sc", "--version"}
MULTIRUN_FLAGS = ("-m", "--multirun")


@dataclass
class SingleRun:
    cfg: DictConfig  # the composed config, Hydra's node included (hydra.run.dir: the run folder)
    root: RootConfig  # the same config, validated and typed
    run_dir: str


def main(argv: list[str]) -> int:
    """Run ``train.py``'s command line; returns the exit status."""
    if config_preview.answers(argv):
        try:
            (config_preview.print_help if config_preview.asks_help(argv) else config_preview.print_config)(argv)
        except (ConfigError, config_preview.PreviewFlagError) as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_CONFIG_ERROR
        return 0
    if any(a.split("=")[0] in HYDRA_INFO_FLAGS for a in argv):
        _hydra_main(argv, lambda cfg: None)
        return 0
    multirun = any(a in MULTIRUN_FLAGS for a in argv)
    try:
        argv = _with_init_folder_composition(argv)
        overrides = [a for a in argv if not a.startswith("-")]
        if multirun:
            _validate_jobs(overrides)
        else:
            run = prepare_single_run(overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    # Lightning and the training module load only once a run starts (--help, --cfg and a refused config stay quick)
    from runtime.checkpoints.write import CheckpointWriteError  # start-up time: lightning, only once a run starts
    from runtime.lit_module import NonFiniteTrainingError  # start-up time: lightning, only once a run starts

    try:
        if multirun:
            _hydra_main([*argv, f"hydra.job.name={JOB_NAME}"], _multirun_job)
        else:
            run_single(run)
    except NonFiniteTrainingError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_NONFINITE
    except CheckpointWriteError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CHECKPOINT_WRITE
    return 0


# ------------------------------------------------------------------------------------------------
# One run
# ------------------------------------------------------------------------------------------------
def prepare_single_run(overrides: list[str]) -> SingleRun:
    """Compose and validate the run once, check that it fits, choose its folder; ConfigError otherwise."""
    cfg = compose(overrides)
    root = validate(strip_hydra(cfg))
    check_fits(root)
    if "hydra.run.dir" in {split_override(o)[0] for o in overrides}:
        run_dir = str(cfg.hydra.run.dir)  # a rank Lightning started, or a folder the user named
    else:  # one process, or every rank of a torchrun / srun launch: rank 0's choice
        run_dir = str(agreed_run_dir(root.output_root, lambda: resolve_run_dir(root)))
    with read_write(cfg.hydra), open_dict(cfg.hydra):
        cfg.hydra.run.dir = run_dir
        cfg.hydra.mode = RunMode.RUN
    return SingleRun(cfg, root, run_dir)


def run_single(run: SingleRun) -> dict[str, Any]:
    """Train ``run`` as Hydra's job (``.hydra/`` written, Hydra's config and callbacks in place); the summary."""
    from runtime.training_run import train  # start-up time: lightning, only once a run starts

    callbacks = Callbacks(run.cfg)
    callbacks.on_run_start(config=run.cfg, config_name=CONFIG_NAME)
    result = run_job(
        task_function=lambda _task_cfg: train(run.root, run.run_dir),
        config=run.cfg,
        job_dir_key="hydra.run.dir",
        job_subdir_key=None,
        hydra_context=HydraContext(config_loader=None, callbacks=callbacks),
    )
    callbacks.on_run_end(config=run.cfg, config_name=CONFIG_NAME, job_return=result)
    return result.return_value  # raises what the run raised


def _with_init_folder_composition(argv: list[str]) -> list[str]:
    """``argv`` preceded by the composition of an ``init_from`` folder transformers saved
    (``runtime.checkpoints.branching.with_folder_composition``)."""
    given = [a for a in argv if not a.startswith("-")]
    merged, note = with_folder_composition(given)
    if note is None:
        return argv
    print(note, file=sys.stderr)
    return [*(o for o in merged if o not in given), *argv]


# ------------------------------------------------------------------------------------------------
# Multirun
# ------------------------------------------------------------------------------------------------
# the jobs validated before Hydra started them, by their overrides (``_job_key``)
_VALIDATED_JOBS: dict[tuple[tuple[str, str], ...], RootConfig] = {}


def _job_key(overrides: list[str]) -> tuple[tuple[str, str], ...]:
    """One job's overrides as Hydra's sweeper normalises them: each key's last value, in key order."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    return tuple(sorted({o.get_key_element(): o.get_value_element_as_str() for o in parsed}.items()))


def _validate_jobs(overrides: list[str]) -> None:
    """Compose, validate and fit-check every job of the sweep; ConfigError for the first bad one."""
    first = compose([o for o in overrides if "," not in o])
    check_launcher(first)
    jobs = expand_sweep(overrides, first)
    for job in jobs:
        root = validate(strip_hydra(compose(job)))
        check_fits(root)
        _VALIDATED_JOBS[_job_key(job)] = root
    varied = varied_keys(jobs)
    varied += [k for k in swept_keys(overrides) if k not in varied]  # searched (Optuna) keys too
    publish_varied_keys(varied)


def _multirun_job(cfg: DictConfig) -> Optional[float]:
    """One job of a multirun, as Hydra's launcher calls it; its validation loss (the Optuna objective)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only  # start-up time: lightning, only once a run starts

    from runtime.training_run import train  # start-up time: lightning, only once a run starts

    hydra_cfg = HydraConfig.get()
    overrides = list(hydra_cfg.overrides.task)
    root = _VALIDATED_JOBS.pop(_job_key(overrides), None)
    if root is None:  # validated up front in another process, or sampled by the sweeper
        try:
            root = validate(cfg)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(EXIT_CONFIG_ERROR)
    # under SLURM every rank runs this job; one records it
    job = current_job() if getattr(rank_zero_only, "rank", 0) == 0 else None
    run_dir = hydra_cfg.runtime.output_dir
    _spawned_ranks_run_this_job(overrides, run_dir)
    if job is not None:
        root.logger.group = root.logger.group or job.group
        root.logger.tags = list(dict.fromkeys([*root.logger.tags, *job.tags()]))
    try:
        # the sweep's point and varied options as config fields too: W&B's parallel coordinates and
        # group-by read config, not tags
        summary = train(root, run_dir, {"sweep": {"group": job.group, **job.varied}} if job is not None else None)
    except BaseException:
        if job is not None:
            job.record(run_dir, "failed", None)
        # a failed job (an exception, not an exit) lets the sweeper go on with the others: the basic sweeper
        # reports it at the end, the Optuna sweeper counts it as a failed trial
        raise
    if job is not None:
        job.record(run_dir, "finished", summary)
    return summary["val"].get("loss")


def _spawned_ranks_run_this_job(overrides: list[str], run_dir: str) -> None:
    """Lightning starts the other ranks of a multi-device run by re-running ``sys.argv`` with Hydra's
    ``hydra.run.dir`` appended; in a multirun job both describe the whole sweep, so they are set to this
    job's overrides and folder (the ranks then run it as one run in that folder)."""
    sys.argv = [sys.argv[0], *overrides]
    hydra_node = HydraConfig.instance().cfg.hydra
    with read_write(hydra_node), open_dict(hydra_node):
        hydra_node.run.dir = run_dir


def _hydra_main(argv: list[str], task: Callable[[DictConfig], Any]) -> None:
    """Hydra's own command line (a multirun, or an information flag) over ``argv``, ``task`` as the job."""
    register_all()
    sys.argv = [sys.argv[0], *argv]  # Hydra reads its command line from sys.argv
    hydra.main(config_path=conf_dir(), config_name=CONFIG_NAME, version_base=None)(task)()
