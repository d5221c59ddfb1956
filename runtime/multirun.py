"""A multirun's jobs (``python train.py -m ...``), expanded and validated before Hydra starts any.

Hydra's basic sweeper runs the grid of every comma list and range; each job's override list is expanded
here the same way, so that every job's config is composed and validated up front and a bad value in the
fifth job stops the sweep before the first one has written anything. Continuous search spaces (the Optuna
sweeper's intervals) cannot be enumerated: their lower end is checked, and each sampled job is validated
when it runs.
"""

from __future__ import annotations

import itertools
from typing import Optional

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from components.registry import ConfigError
from runtime.sweep_job import split_override

MAX_VALIDATED_JOBS = 512


def expand_sweep(overrides: list[str], cfg_with_hydra: Optional[DictConfig] = None) -> list[list[str]]:
    """Override lists of every job of a basic-sweeper multirun (grid over comma lists and ranges), with the
    sweeper's own ``hydra.sweeper.params`` when ``cfg_with_hydra`` is given."""
    parser = OverridesParser.create()
    extra: list[str] = []
    if cfg_with_hydra is not None:
        params = OmegaConf.select(cfg_with_hydra, "hydra.sweeper.params", default=None)
        if params:
            given = {parser.parse_override(o).key_or_group for o in overrides}
            extra = [f"{k}={v}" for k, v in params.items() if k not in given]
    try:
        parsed = parser.parse_overrides(overrides + extra)
    except Exception as err:
        raise ConfigError("", str(err).strip().splitlines()[0]) from None
    axes: list[list[str]] = []
    for o in parsed:
        if o.is_sweep_override():
            if o.is_interval_sweep():
                # continuous search spaces (Optuna) cannot be enumerated; check the interval's lower end
                axes.append([f"{o.get_key_element()}={o.value().start}"])
            else:
                axes.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()])
        else:
            axes.append([o.input_line])
    jobs = [list(combo) for combo in itertools.product(*axes)]
    return jobs[:MAX_VALIDATED_JOBS]


def check_launcher(cfg_with_hydra: DictConfig) -> None:
    """Resolve the launcher's settings now (the SLURM preset reads trainer.devices / num_nodes), so a
    bad value fails before any job is submitted, naming the key."""
    launcher = OmegaConf.select(cfg_with_hydra, "hydra.launcher", default=None)
    if launcher is None:
        return
    try:
        values = OmegaConf.to_container(launcher, resolve=True)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", "") or "hydra.launcher"
        raise ConfigError(key, str(getattr(err, "msg", err)).strip().splitlines()[0]) from None
    for key in ("nodes", "tasks_per_node"):
        if key in values and not (isinstance(values[key], int) and values[key] >= 1):
            raise ConfigError(
                f"hydra.launcher.{key}",
                f"must be a positive number, got {values[key]!r} (the SLURM launcher takes it from trainer.num_nodes "
                "/ trainer.devices: give trainer.devices as a number)",
            )


def swept_keys(overrides: list[str]) -> list[str]:
    """Keys given a sweep (comma list, range, choice, interval) on the command line."""
    parser = OverridesParser.create()
    return [o.get_key_element().lstrip("+~") for o in parser.parse_overrides(overrides) if o.is_sweep_override()]


def varied_keys(jobs: list[list[str]]) -> list[str]:
    """Keys whose value differs between the jobs of a sweep, in override order."""
    seen: dict[str, set[str]] = {}
    for job in jobs:
        final = dict(split_override(o) for o in job)  # a key given twice: the last value counts, as in Hydra
        for key, value in final.items():
            seen.setdefault(key, set()).add(value)
    return [k for k, values in seen.items() if len(values) > 1]
