"""Registries: listing, lookup errors, and that every member is selectable from a YAML file."""

from __future__ import annotations

import dataclasses

import pytest

from components.registry import BALANCERS, FAMILIES, FFNS, MIXERS, RESIDUALS, ConfigError, Registry
from tests.helpers import group_options


def test_foundation_members_are_registered():
    assert {"mha", "gqa", "mqa"} <= set(MIXERS.names())
    assert "dense" in FFNS.names()
    assert "plain" in RESIDUALS.names()
    assert "none" in BALANCERS.names()


def test_unknown_name_lists_members_and_closest_match():
    with pytest.raises(ConfigError) as err:
        MIXERS.get("mhaa", key="mixer")
    msg = str(err.value)
    assert err.value.key == "mixer"
    assert "gqa" in msg and "mqa" in msg and "Did you mean 'mha'" in msg


def test_unknown_name_without_close_match_has_no_guess():
    with pytest.raises(ConfigError) as err:
        MIXERS.get("zzzzzz")
    assert "Did you mean" not in str(err.value)


@pytest.mark.parametrize("group", sorted(FAMILIES))
def test_every_member_has_a_yaml_and_every_yaml_a_member(group):
    registry = FAMILIES[group]
    assert set(registry.names()) == set(group_options(group))


@pytest.mark.parametrize("group", sorted(FAMILIES))
def test_member_configs_are_dataclasses_with_their_name(group):
    for entry in FAMILIES[group]:
        cfg = entry.config_cls()
        assert dataclasses.is_dataclass(cfg)
        assert cfg.name == entry.name, f"{entry.config_cls.__name__}.name defaults to {cfg.name!r}, not {entry.name!r}"


def test_register_rejects_non_dataclass_non_contract_and_duplicates():
    from components.config import ComponentConfig
    from components.mixers.base import Mixer

    reg = Registry("thing", "thing_group_for_tests", "components.mixers")

    with pytest.raises(TypeError):
        reg.register("x", dict)

    @dataclasses.dataclass
    class Plain:
        name: str = "x"

    with pytest.raises(TypeError, match="ComponentConfig"):
        reg.register("x", Plain)

    @dataclasses.dataclass
    class Cfg(ComponentConfig):
        name: str = "x"

    @reg.register("x", Cfg)
    class A:
        pass

    with pytest.raises(KeyError):

        @reg.register("x", Cfg)
        class B:
            pass

    # a family with a written contract refuses a class that does not subclass it
    mixers = Registry("mixer", "mixer_group_for_tests", "components.mixers", "components.mixers.base:Mixer")
    with pytest.raises(TypeError, match="Mixer"):

        @mixers.register("y", Cfg)
        class NotAMixer:
            pass

    @mixers.register("y", Cfg)
    class AMixer(Mixer):
        pass
