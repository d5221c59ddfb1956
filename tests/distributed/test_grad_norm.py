"""The gradient norm and clipping over gradients sharded on several meshes equal the one-process ones."""

from __future__ import annotations

import torch

from tests.distributed.gloo_ranks import run_ranks

# full gradients and how each is laid out on 4 ranks: (mesh shape, placements); None: a plain tensor
LAYOUTS = {
    "dense": ((4,), ("S0",)),  # FSDP over every rank
    "expert": ((2, 2), ("S0", "S0")),  # experts: the (efsdp, ep) mesh, both dimensions splitting the experts
    "ffn": ((2, 2), ("S1", "R")),  # split over one dimension of a 2-D mesh, copies over the other
    "bias": ((4,), ("R",)),  # replicated DTensor
    "plain": None,  # a plain tensor (the same on every rank)
}


def _full_grads() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"dense": (8, 6), "expert": (8, 3, 5), "ffn": (6, 8), "bias": (7,), "plain": (5, 3)}
    return {name: torch.randn(*shape, generator=g) * (i + 1) for i, (name, shape) in enumerate(shapes.items())}


def _norm_and_clip(rank: int, world: int, max_norm: float) -> tuple[float, dict[str, torch.Tensor], float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import runtime.grad_norm as grad_norm
    from runtime.grad_norm import clip_grads_with_norm_, total_grad_norm

    meshes = {(4,): init_device_mesh("cpu", (4,)), (2, 2): init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))}
    params = []
    for name, full in _full_grads().items():
        p = torch.nn.Parameter(torch.zeros_like(full))
        if LAYOUTS[name] is None:
            p.grad = full.clone()
        else:
            shape, placements = LAYOUTS[name]
            placed = [Replicate() if s == "R" else Shard(int(s[1])) for s in placements]
            p.grad = distribute_tensor(full, meshes[shape], placed)
        params.append(p)
    # planted defect: every mesh dimension reduced over, replicated ones included (copies added up)
    sharded_dims = grad_norm._sharded_dims
    grad_norm._sharded_dims = lambda g: (g.device_mesh, tuple(range(g.device_mesh.ndim)))
    defective = float(total_grad_norm(params))
    grad_norm._sharded_dims = sharded_dims
    norm = total_grad_norm(params)
    clip_grads_with_norm_(params, max_norm, norm)
    clipped = {}
    for name, p in zip(_full_grads(), params):
        full = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        clipped[name] = full
    return float(norm), clipped, defective


def test_norm_and_clipping_over_two_meshes_equal_one_process(tmp_path):
    grads = _full_grads()
    params = []
    for full in grads.values():
        p = torch.nn.Parameter(torch.zeros_like(full))
        p.grad = full.clone()
        params.append(p)
    reference = torch.nn.utils.get_total_norm([p.grad for p in params])
    torch.nn.utils.clip_grads_with_norm_(params, 1.0, reference)
    for norm, clipped, defective in run_ranks(_norm_and_clip, 4, tmp_path, 1.0):
        assert abs(norm - float(reference)) <= 1e-6 * float(reference)
        assert abs(defective - float(reference)) > 1e-2 * float(reference)
        for name, p in zip(grads, params):
            torch.testing.assert_close(clipped[name], p.grad, rtol=1e-6, atol=0)
