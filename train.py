"""Train a decoder composed from the registries: ``python train.py [hydra overrides]``.

Examples: ``python train.py mixer=mqa ffn.activation=swiglu trainer.max_steps=20``,
``python train.py data=mqar model=tiny``, ``python train.py -m mixer=mha,gqa,mqa``.
The config is validated before anything is written (components/launch.py).
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

    from components.config import validate
    from components.registry import ConfigError
    from components.sweep_job import current_job
    from components.training.run import train

    try:
        root = validate(cfg)
    except ConfigError as err:  # jobs of a sweep are validated up front; this guards other launchers
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    job = current_job()  # None unless this is one job of a multirun
    if job is not None:
        root.logger.group = root.logger.group or job.group
        root.logger.tags = list(dict.fromkeys([*root.logger.tags, *job.tags()]))
    run_dir = HydraConfig.get().runtime.output_dir
    try:
        summary = train(root, run_dir)
    except BaseException:
        if job is not None:
            job.record(run_dir, "failed", None)
        raise
    if job is not None:
        job.record(run_dir, "finished", summary)
    return summary["val"].get("loss")


if __name__ == "__main__":
    from components.launch import run

    run(task)
