"""One source of truth for defaults: a component composed on the command line (``group=name``) equals
its config dataclass built with no arguments, apart from the deviations its YAML file declares.

A YAML file under ``conf/<group>/`` names its schema in ``defaults`` and sets only the fields it
deliberately changes, each with a comment saying why; a field that repeats the dataclass default, or a
dataclass default that the YAML silently changes, fails here. A preset of a schema group may instead
name another preset of its group first (``trainer=ddp`` builds on ``trainer=gpu``): it then declares
only its deviations from that preset.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml
from omegaconf import OmegaConf

from components.config import ModelConfig
from runtime.compose import compose
from runtime.config import REGISTRIES, LoggerConfig, TrainerConfig
from tests.helpers import CONF

MEMBERS = [(group, entry.name) for group, registry in REGISTRIES.items() for entry in registry]
# config groups that are not registries but whose options are built from one schema each
SCHEMA_GROUPS = {"model": ModelConfig, "trainer": TrainerConfig, "logger": LoggerConfig}
PRESETS = [(group, path.stem) for group in sorted(SCHEMA_GROUPS) for path in sorted((CONF / group).glob("*.yaml"))]


def declared_deviations(group: str, name: str) -> dict[str, object]:
    """The fields a YAML file sets (everything but its ``defaults`` list)."""
    data = yaml.safe_load((CONF / group / f"{name}.yaml").read_text()) or {}
    return {k: v for k, v in data.items() if k != "defaults"}


def undocumented_fields(group: str, name: str) -> list[str]:
    """Fields set in the YAML without a reason: a comment at the end of the line or on the line above."""
    lines = (CONF / group / f"{name}.yaml").read_text().splitlines()
    missing = []
    for i, line in enumerate(lines):
        m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*):", line)
        if not m or m.group(1) == "defaults":
            continue
        above = lines[i - 1].strip() if i else ""
        if "#" not in line and not above.startswith("#"):
            missing.append(m.group(1))
    return missing


def composed_node(group: str, name: str):
    key = "optimizer" if group == "optimizer" else group
    cfg = compose([f"{group}={name}"])
    return OmegaConf.to_container(cfg[key], resolve=False)


def differing_fields(composed: dict, default: dict) -> set[str]:
    return {k for k in set(composed) | set(default) if composed.get(k) != default.get(k)}


@pytest.mark.parametrize("group,name", MEMBERS, ids=[f"{g}={n}" for g, n in MEMBERS])
def test_command_line_member_equals_its_dataclass_defaults(group, name):
    config_cls = REGISTRIES[group].get(name).config_cls
    default = OmegaConf.to_container(OmegaConf.structured(config_cls), resolve=False)
    composed = composed_node(group, name)
    declared = declared_deviations(group, name)
    assert differing_fields(composed, default) == set(declared), (
        f"conf/{group}/{name}.yaml: the composed config differs from {config_cls.__name__}() in "
        f"{sorted(differing_fields(composed, default))}, but the YAML declares {sorted(declared)}"
    )
    assert not undocumented_fields(group, name), f"conf/{group}/{name}.yaml: give each deviation a reason"
    schema = yaml.safe_load((CONF / group / f"{name}.yaml").read_text())["defaults"][0]
    assert schema == f"{name}_schema", f"conf/{group}/{name}.yaml must name its schema first in defaults"


def parent_of(group: str, name: str) -> tuple[str, dict]:
    """What a preset builds on, by name, and its values: the schema's defaults, or the preset named first."""
    first = yaml.safe_load((CONF / group / f"{name}.yaml").read_text())["defaults"][0]
    if first == f"{group}_schema":
        return first, OmegaConf.to_container(OmegaConf.structured(SCHEMA_GROUPS[group]), resolve=False)
    assert (CONF / group / f"{first}.yaml").exists(), f"conf/{group}/{name}.yaml: defaults name no schema or preset"
    return f"{group}={first}", composed_node(group, first)


@pytest.mark.parametrize("group,name", PRESETS, ids=[f"{g}={n}" for g, n in PRESETS])
def test_schema_group_options_declare_their_deviations(group, name):
    parent, inherited = parent_of(group, name)
    composed = composed_node(group, name)
    declared = declared_deviations(group, name)
    assert differing_fields(composed, inherited) == set(declared), (
        f"conf/{group}/{name}.yaml: the composed config differs from {parent} in "
        f"{sorted(differing_fields(composed, inherited))}, but the YAML declares {sorted(declared)}"
    )
    assert not undocumented_fields(group, name), f"conf/{group}/{name}.yaml: give each deviation a reason"


def test_the_check_sees_a_silent_change():
    """A YAML value that differs from the dataclass without being declared is caught: the comparison
    itself, on a config class whose default disagrees with what composition produced."""
    config_cls = REGISTRIES["mixer"].get("gqa").config_cls
    changed = dataclasses.replace(config_cls(), n_heads=config_cls().n_heads + 1)
    composed = composed_node("mixer", "gqa")
    assert differing_fields(composed, dataclasses.asdict(changed)) == {"n_heads"}
