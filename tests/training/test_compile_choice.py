"""trainer.compile: auto compiles a model as one graph, or layer by layer around the eager islands of
KDA and routed FFNs; explicit choices win."""

from __future__ import annotations

import pytest

from components.model import Decoder
from runtime.compile import compile_mode, has_cpp_compiler
from tests.helpers import compose_root


@pytest.mark.parametrize(
    "overrides,unfriendly",
    [
        ([], []),
        (["mixer=kda"], ["KimiDeltaAttention"]),
        (["ffn=moe"], ["MoEFFN"]),
        (["experiment=k3_tiny"], ["KimiDeltaAttention", "StableLatentMoEFFN"]),
    ],
)
def test_compile_mode_follows_components(overrides, unfriendly):
    root = compose_root("model=tiny", *overrides, "trainer.compile=auto")
    model = Decoder(root.decoder_config())
    assert model.compile_unfriendly() == unfriendly
    has_compiler = has_cpp_compiler()
    compiled = "layers" if unfriendly else "model"
    assert compile_mode(root.trainer, model) == (compiled if has_compiler else "off")
    assert compile_mode(compose_root("model=tiny", *overrides, "trainer.compile=true").trainer, model) == compiled
    assert compile_mode(compose_root("model=tiny", *overrides, "trainer.compile=false").trainer, model) == "off"
