"""Layer plans: patterns expand to the per-layer schedule, including K3's."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from components.layer_plan import describe_plan, expand_pattern
from components.registry import ConfigError
from tests.helpers import compose_root


@dataclass
class Pattern:
    repeat: list = field(default_factory=list)
    at: dict = field(default_factory=dict)


def test_k3_mixer_schedule():
    names = expand_pattern(
        Pattern(["mixer", "mixer", "mixer", "mla"], {-1: "mla"}), 93, {"mixer": 0, "mla": 0}, "model.mixer_plan"
    )
    mla = [i for i, n in enumerate(names) if n == "mla"]
    assert mla == list(range(3, 92, 4)) + [92]
    assert len(mla) == 24 and names.count("mixer") == 69


def test_k3_ffn_schedule():
    names = expand_pattern(Pattern(["ffn"], {0: "dense"}), 93, {"ffn": 0, "dense": 0}, "model.ffn_plan")
    assert names[0] == "dense" and set(names[1:]) == {"ffn"}


def test_unknown_slot_names_the_key():
    with pytest.raises(ConfigError) as err:
        expand_pattern(Pattern(["mixer", "mlaa"]), 4, {"mixer": 0}, "model.mixer_plan")
    assert err.value.key == "model.mixer_plan.repeat[1]"


def test_out_of_range_layer_is_refused():
    with pytest.raises(ConfigError) as err:
        expand_pattern(Pattern(["mixer"], {7: "mixer"}), 4, {"mixer": 0}, "model.mixer_plan")
    assert err.value.key == "model.mixer_plan.at"


def test_hybrid_plan_from_the_command_line():
    root = compose_root(
        "model=tiny",
        "model.n_layers=5",
        "+mixer@mixers.global=mha",
        "model.mixer_plan.repeat=[mixer,global]",
        "+model.mixer_plan.at={-1:global}",
    )
    plan = root.decoder_config().layers
    assert [s.mixer.name for s in plan] == ["gqa", "mha", "gqa", "mha", "mha"]
    assert describe_plan(plan) == "0: gqa/dense | 1: mha/dense | 2: gqa/dense | 3-4: mha/dense"
