"""The ``hf`` extra (transformers, accelerate, compressed-tensors) is part of ``dev``, so CI installs what
the transformers tests need, and what is installed satisfies it."""

from __future__ import annotations

import importlib.metadata

import pytest
from packaging.requirements import Requirement

from tests.helpers import REPO


def _extras() -> dict[str, list[Requirement]]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    return {k: [Requirement(r) for r in v] for k, v in data["project"]["optional-dependencies"].items()}


def test_the_hf_extra_is_part_of_dev():
    extras = _extras()
    assert {r.name for r in extras["hf"]} == {"transformers", "accelerate", "compressed-tensors"}
    assert any(r.name == "k3-sandbox" and "hf" in r.extras for r in extras["dev"])
    assert not any(r.name == "torch" for r in extras["hf"])  # the project's torch pin alone decides torch


def test_the_installed_packages_satisfy_the_hf_extra():
    for req in _extras()["hf"]:
        version = importlib.metadata.version(req.name)
        assert req.specifier.contains(version, prereleases=True), f"{req.name} {version} is not {req.specifier}"
