"""The kernel back-end resolver: one vocabulary for every op with a kernel, and what each choice does."""

from __future__ import annotations

import pytest
import torch

from components.ops import backend

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("op", sorted(backend.KERNELS))
def test_each_op_allows_torch_its_kernel_and_auto(op):
    allowed = backend.allowed_backends(op)
    assert allowed == ("torch", backend.KERNELS[op], "auto") and set(allowed) <= set(backend.BACKENDS)
    other = next(k for k in ("fla", "triton") if k != backend.KERNELS[op])
    with pytest.raises(ValueError, match=op):
        backend.resolve(op, other, CPU)


def test_torch_is_torch_everywhere_and_auto_is_torch_off_cuda(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for op in backend.KERNELS:
        assert backend.resolve(op, "torch", CUDA) == "torch"
        assert backend.resolve(op, "auto", CPU, applies=lambda: pytest.fail("applies evaluated off CUDA")) == "torch"


def test_auto_on_cuda_takes_the_kernel_only_where_it_applies_and_imports(monkeypatch):
    monkeypatch.setattr(backend, "available", lambda kernel: True)
    assert backend.resolve("kda", "auto", CUDA) == "fla"
    assert backend.resolve("attnres", "auto", CUDA, applies=False) == "torch"
    monkeypatch.setattr(backend, "available", lambda kernel: False)
    assert backend.resolve("situ_glu", "auto", CUDA) == "torch"


def test_an_explicit_kernel_never_falls_back(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(backend, "available", lambda kernel: True)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        backend.resolve("kda", "fla", CPU)
    with pytest.raises(RuntimeError, match="does not support"):
        backend.resolve("attnres", "fla", CUDA, applies=False)
    monkeypatch.setattr(backend, "available", lambda kernel: False)
    with pytest.raises(RuntimeError, match="not importable"):
        backend.resolve("situ_glu", "triton", CUDA)


def test_triton_runs_on_the_cpu_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(backend, "available", lambda kernel: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend.resolve("situ_glu", "triton", CPU) == "triton"
    with pytest.raises(RuntimeError, match="needs CUDA"):  # fla's kernels refuse CPU tensors regardless
        backend.resolve("kda", "fla", CPU)


def test_a_cuda_only_choice_on_a_cpu_run_is_refused_before_training():
    from components.registry import ConfigError
    from tests.helpers import compose_root

    for overrides, key in (
        (["mixer=kda", "mixer.backend=fla"], "mixer.backend"),
        (["ffn.activation_backend=triton"], "ffn.activation_backend"),
        (["residual=block_attnres", "residual.backend=fla"], "residual.backend"),
    ):
        with pytest.raises(ConfigError) as err:
            compose_root("model=tiny", *overrides)
        assert err.value.key == key and "CPU" in str(err.value)
