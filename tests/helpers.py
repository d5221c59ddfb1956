"""Config composition shortcuts for tests."""

from __future__ import annotations

from pathlib import Path

from components.config import validate
from components.launch import compose, strip_hydra

CONF = Path(__file__).resolve().parent.parent / "conf"


def compose_root(*overrides: str):
    """Typed, validated RootConfig for the given overrides."""
    return validate(strip_hydra(compose(list(overrides))))


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))
