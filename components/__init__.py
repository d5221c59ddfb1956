"""K3 sandbox components: registries of interchangeable mixers, FFNs, balancers, residual schemes
and datasets, plus the decoder that assembles them from a config."""

from __future__ import annotations


def register_all() -> None:
    """Import every registered component and store all config schemas in Hydra's ConfigStore."""
    from components.config import register_root_schemas
    from components.registry import discover_all

    register_root_schemas()
    discover_all()
