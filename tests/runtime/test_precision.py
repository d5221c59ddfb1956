"""``trainer.precision=auto``: bf16-mixed only where bf16 products are native, resolved when validated."""

from __future__ import annotations

import pytest
import torch

import runtime.precision as precision
from runtime.precision import describe_precision, resolve_precision
from tests.helpers import compose_root


@pytest.fixture
def native(monkeypatch):
    """Pretend this CPU has (True) or lacks (False) native bf16 products; the GPU is never visible."""

    def set_native(value: bool) -> None:
        monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: value)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    return set_native


@pytest.mark.parametrize("has_bf16,expected", [(True, "bf16-mixed"), (False, "32-true")])
def test_auto_follows_the_cpu(native, has_bf16, expected):
    native(has_bf16)
    assert resolve_precision("auto", "cpu") == expected
    assert resolve_precision("auto", "auto") == expected  # no GPU visible: the CPU decides


def test_auto_is_bf16_on_a_gpu_and_explicit_choices_stay(native):
    native(False)
    assert resolve_precision("auto", "gpu") == "bf16-mixed"
    assert resolve_precision("auto", "cuda") == "bf16-mixed"
    for chosen in ("bf16-mixed", "32-true", "64-true", "16-mixed"):
        assert resolve_precision(chosen, "cpu") == chosen  # a researcher's explicit choice is kept


@pytest.mark.parametrize("has_bf16", [True, False])
def test_the_cpu_trainer_resolves_auto_when_validated(native, has_bf16):
    native(has_bf16)
    root = compose_root("model=tiny", "trainer=cpu")
    # the validated config (what W&B records and the summary reports) names a concrete precision
    assert root.trainer.precision == ("bf16-mixed" if has_bf16 else "32-true")


def test_explicit_bf16_on_a_cpu_without_it_warns(native):
    native(False)
    assert "warning" in describe_precision("bf16-mixed", "cpu")
    assert "no native bf16" in describe_precision("32-true", "cpu")
    native(True)
    assert describe_precision("bf16-mixed", "cpu") == "bf16-mixed"
