"""The runtime: turns a composed run config into a trained, logged, checkpointed run.

Run configuration and its validation (``config``), the command-line launch and the hand-off to jobs
and ranks (``launch``, ``handoff``, ``launch_env``, ``sweep_job``), the Lightning module, data module,
trainer, strategies, loggers, callbacks and checkpoint I/O. It imports the model side (``components``);
the model side never imports it.
"""

from __future__ import annotations


def register_all() -> None:
    """Import every registered component and store all config schemas in Hydra's ConfigStore."""
    from components.registry import discover_all
    from runtime.config import REGISTRIES, register_root_schemas

    register_root_schemas()
    discover_all()
    for registry in REGISTRIES.values():  # the families, and the schedules beside them
        registry.discover()
