"""``trainer.expert_parallel`` is refused by key, before training, wherever it cannot work."""

from __future__ import annotations

import pytest

from components.registry import ConfigError
from tests.helpers import compose_root

EP = ["experiment=k3_tiny", "trainer=fsdp2", "trainer.accelerator=cpu", "data.batch_size=8"]


def test_expert_parallel_accepted_where_it_works():
    root = compose_root(*EP, "trainer.devices=4", "trainer.expert_parallel=2")
    assert root.trainer.expert_parallel == 2
    assert compose_root("experiment=k3_tiny").trainer.expert_parallel == 1  # off by default


@pytest.mark.parametrize(
    "overrides, key, words",
    [
        (["trainer.devices=4", "trainer.expert_parallel=3"], "trainer.expert_parallel", "must divide"),
        (["trainer.devices=4", "trainer.expert_parallel=0"], "trainer.expert_parallel", "positive"),
        (["trainer.devices=4", "trainer.expert_parallel=4", "ffn.num_experts=6"], "ffn.num_experts", "split"),
        (["trainer.devices=2", "trainer.expert_parallel=2", "ffn.capacity_factor=1.25"], "ffn.capacity_factor", "drop"),
        (["trainer=ddp", "trainer.devices=2", "trainer.expert_parallel=2"], "trainer.expert_parallel", "fsdp2"),
    ],
)
def test_expert_parallel_refused_by_key(overrides, key, words):
    with pytest.raises(ConfigError) as err:
        compose_root(*EP, *overrides)
    assert err.value.key == key and words in str(err.value), str(err.value)


def test_expert_parallel_refused_without_routed_experts():
    with pytest.raises(ConfigError) as err:
        compose_root("model=tiny", *EP[1:], "trainer.devices=2", "trainer.expert_parallel=2")
    assert err.value.key == "trainer.expert_parallel" and "no routed experts" in str(err.value)
