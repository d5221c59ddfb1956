"""The GLU activation registry: an FFN config gets its activation, settings, kernel choice and tags from
the registered entry, so a new activation is one ``register_glu_activation`` call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from components.base import ConfigError
from components.ffn.dense import DenseFFNConfig
from components.ffn.glu_activation import GLU_ACTIVATIONS, register_glu_activation
from components.ffn.moe import MoEFFNConfig
from components.ops.activations import situ_glu_exp_form, situ_glu_reference


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return F.gelu(gate.float(), approximate=approximate).to(gate.dtype) * up


@pytest.fixture
def registered_geglu():
    # the settings map reads a config field that every GLU config has, so no config class changes
    register_glu_activation("geglu", geglu)
    yield GLU_ACTIVATIONS["geglu"]
    del GLU_ACTIVATIONS["geglu"]


def test_situ_glu_is_bound_with_the_config_caps():
    cfg = DenseFFNConfig(activation="situ_glu", situ_beta=2.0, situ_linear_beta=None, activation_backend="torch")
    a, b = torch.randn(5, 7) * 6, torch.randn(5, 7) * 60
    torch.testing.assert_close(cfg.activation_fn()(a, b), situ_glu_exp_form(a, b, 2.0, None), rtol=0, atol=0)
    torch.testing.assert_close(cfg.activation_fn()(a, b), situ_glu_reference(a, b, 2.0, None))
    assert cfg.kernel_backends() == {"activation_backend": "torch"}
    assert DenseFFNConfig(activation="swiglu").kernel_backends() == {}


def test_a_registered_activation_is_usable_by_every_glu_ffn(registered_geglu):
    for cfg in (DenseFFNConfig(activation="geglu"), MoEFFNConfig(activation="geglu")):
        cfg.validate_activation("ffn")
        a, b = torch.randn(3, 4), torch.randn(3, 4)
        torch.testing.assert_close(cfg.activation_fn()(a, b), geglu(a, b))
        assert cfg.tags() == ["act:geglu"]
        assert cfg.kernel_backends() == {}


def test_unknown_activation_names_the_key_and_the_registered_ones():
    with pytest.raises(ConfigError) as err:
        DenseFFNConfig(activation="gegl").validate_activation("ffns.dense")
    assert err.value.key == "ffns.dense.activation"
    assert all(name in err.value.message for name in GLU_ACTIVATIONS)


def test_kernel_backend_choice_is_checked_against_the_activations_op():
    with pytest.raises(ConfigError) as err:
        DenseFFNConfig(activation="situ_glu", activation_backend="fla").validate_activation("ffn")
    assert err.value.key == "ffn.activation_backend" and "triton" in err.value.message


def test_registering_a_different_function_under_a_taken_name_is_refused():
    with pytest.raises(KeyError, match="swiglu"):
        register_glu_activation("swiglu", geglu)
