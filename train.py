"""Train a decoder composed from the registries: ``python train.py [hydra overrides]``.

Examples: ``python train.py mixer=mqa ffn.activation=swiglu trainer.max_steps=20``,
``python train.py data=mqar model=tiny``, ``python train.py -m mixer=mha,gqa,mqa``.
The config is validated before anything is written (runtime/launch.py).
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig


def task(cfg: DictConfig) -> float | None:
    import logging
    import warnings

    from hydra.core.hydra_config import HydraConfig

    # keep the console to the progress bar and the summary
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*LeafSpec.*is deprecated.*")
    warnings.filterwarnings("ignore", message=".*IterableDataset.*has `__len__` defined.*")
    # validation metrics are summed over ranks before logging (lit_module.on_validation_epoch_end)
    warnings.filterwarnings("ignore", message=".*when logging on epoch level in distributed setting.*")
    warnings.filterwarnings("ignore", message=".*Checkpoint directory .* exists and is not empty.*")  # resuming

    from components.registry import ConfigError
    from runtime import handoff
    from runtime.checkpoint_io import CheckpointWriteError
    from runtime.lit_module import NonFiniteTrainingError
    from runtime.run import train
    from runtime.sweep_job import current_job
    from runtime.validation import validate

    try:
        root = validate(cfg)
    except ConfigError as err:  # jobs of a sweep are validated up front; this guards other launchers
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    # None unless this is one job of a multirun; under SLURM every rank runs this task, one records it
    job = current_job() if getattr(rank_zero_only, "rank", 0) == 0 else None
    if job is not None:
        root.logger.group = root.logger.group or job.group
        root.logger.tags = list(dict.fromkeys([*root.logger.tags, *job.tags()]))
    run_dir = HydraConfig.get().runtime.output_dir
    if job is not None:
        # ranks Lightning spawns re-run this script with sys.argv: give them this job, not the whole sweep
        handoff.set_script_args(list(HydraConfig.get().overrides.task))
    try:
        # the sweep's point and varied options as config fields too: W&B's parallel coordinates and
        # group-by read config, not tags
        summary = train(root, run_dir, {"sweep": {"group": job.group, **job.varied}} if job is not None else None)
    except BaseException as err:
        if job is not None:
            job.record(run_dir, "failed", None)
        if isinstance(err, (NonFiniteTrainingError, CheckpointWriteError)):
            print(f"error: {err}", file=sys.stderr)
            if job is None:
                sys.exit(3 if isinstance(err, NonFiniteTrainingError) else 4)
            # in a sweep, a failed job (an exception, not an exit) lets the sweeper go on with the others:
            # the basic sweeper reports it at the end, the Optuna sweeper counts it as a failed trial
        raise
    if job is not None:
        job.record(run_dir, "finished", summary)
    return summary["val"].get("loss")


if __name__ == "__main__":
    from runtime.launch import run

    run(task)
