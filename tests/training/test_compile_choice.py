"""trainer.compile=auto stays eager for models with compile-unfriendly components; explicit choices win."""

from __future__ import annotations

import shutil

import pytest

from components.model import Decoder
from runtime.lit_module import should_compile
from tests.helpers import compose_root


@pytest.mark.parametrize("overrides,unfriendly", [
    ([], []),
    (["mixer=kda"], ["KimiDeltaAttention"]),
    (["ffn=moe"], ["MoEFFN"]),
    (["experiment=k3_tiny"], ["KimiDeltaAttention", "StableLatentMoEFFN"]),
])
def test_auto_compile_respects_components(overrides, unfriendly):
    root = compose_root("model=tiny", *overrides, "trainer.compile=auto")
    model = Decoder(root.decoder_config())
    assert model.compile_unfriendly() == unfriendly
    has_compiler = any(shutil.which(cc) for cc in ("c++", "g++", "clang++"))
    assert should_compile(root.trainer, model) == (has_compiler and not unfriendly)
    assert should_compile(compose_root("model=tiny", *overrides, "trainer.compile=true").trainer, model) is True
    assert should_compile(compose_root("model=tiny", *overrides, "trainer.compile=false").trainer, model) is False
