"""What TorchDynamo captures of a model on the kernel paths a GPU run takes (``backend=auto``): CUDA faked
where the back-ends are resolved, each kernel replaced by its torch reference at its launch
(tests/kernel_fakes.py). A compile-friendly model compiles as one graph (``model`` mode) or one graph per
decoder layer (``layers`` mode) without a break; a model with eager islands breaks at its islands only,
exactly where its torch paths break. A kernel call that broke a graph (a back-end decision traced into an
import, a pointer read) shows here as extra graphs and breaks, on a CPU."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import build_model
from tests.kernel_fakes import count_compiled, fake_cuda, torch_kernels

BLOCK_ATTNRES = ("residual=block_attnres", "residual.backend=auto", "model.n_layers=4")
# experiment=k3_small's decisions (KDA then MLA, dense then Stable LatentMoE, QB, block AttnRes, an MTP
# depth) at a size that traces in seconds; residual.backend=auto as the GPU check runs it
K3_SMALL = (
    "experiment=k3_small",
    "model.n_layers=2",
    "model.d_model=64",
    "mixer.n_heads=2",
    "mixer.head_dim=32",
    "residual.backend=auto",
)


@pytest.fixture
def kernel_paths(monkeypatch):
    fake_cuda(monkeypatch)
    return torch_kernels(monkeypatch)


def _compiled(overrides, mode):
    torch.manual_seed(0)
    model = build_model(*overrides).train()
    ids = torch.randint(0, model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    return model, count_compiled(model, mode, ids)


@pytest.mark.parametrize(
    "overrides, kernels",
    [((), {"situ_glu"}), (BLOCK_ATTNRES, {"situ_glu", "attnres"})],
    ids=["default", "block_attnres"],
)
@pytest.mark.parametrize("mode", ["model", "layers"])
def test_compile_friendly_models_compile_whole_on_the_kernel_paths(kernel_paths, overrides, kernels, mode):
    model, compiled = _compiled(overrides, mode)
    assert not model.compile_unfriendly()
    assert set(kernel_paths) == kernels  # the kernels ran (inside the compiled graphs)
    assert compiled.breaks == []
    # layers: one graph per layer, and one for the residual scheme's final read with the output norm
    assert compiled.graphs == (1 if mode == "model" else len(model.layers) + 1)


def test_k3_small_breaks_only_at_its_eager_islands_as_on_the_torch_paths(kernel_paths, monkeypatch):
    model, kernel = _compiled(K3_SMALL, "layers")
    assert model.compile_unfriendly()
    assert set(kernel_paths) == {"situ_glu", "attnres", "kda"}
    assert kernel.unintended_breaks == []
    monkeypatch.undo()  # the torch paths: on a CPU, backend=auto is torch everywhere
    launches = dict(kernel_paths)
    _, reference = _compiled(K3_SMALL, "layers")
    assert dict(kernel_paths) == launches  # no kernel ran
    assert (kernel.graphs, len(kernel.breaks)) == (reference.graphs, len(reference.breaks))
