"""Muon on sharded parameters (components/optim/muon.py) equals Muon on one process, without redundant work.

Stacked expert weights split on the expert dimension are orthogonalised where they lie (no collective,
counted by a hook on every collective); every other matrix is orthogonalised once, by an owner rank, and
its rows scattered back, so each rank runs 1 / world of the Newton-Schulz matrices (counted), Per-Head
blocks included.
"""

from __future__ import annotations

import pytest
import torch

from components.nn.matrix_layout import MatrixLayout
from tests.distributed.gloo_ranks import run_ranks

# name: (shape, layout)
PARAMS = {
    "experts": ((8, 6, 4), MatrixLayout(stacked=True)),
    "dense": ((10, 6), MatrixLayout()),
    "uneven": ((7, 12), MatrixLayout()),  # 7 rows: shards of different sizes
    "heads": ((8, 6), MatrixLayout(heads=2, axis=0, qkv=True)),  # Per-Head blocks along rows
    "head_columns": ((6, 8), MatrixLayout(heads=2, axis=1, qkv=True)),
    "experts_2": ((4, 6, 4), MatrixLayout(stacked=True)),
}
COLLECTIVES = ("gather", "scatter", "all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "all_to_all")


def _values(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {name: torch.randn(*shape, generator=g) for name, (shape, _) in PARAMS.items()}


def _optimizer(params: list[torch.nn.Parameter], names: list[str]):
    from components.optim.muon import Muon

    layouts = [PARAMS[n][1] for n in names]
    return Muon([{"params": params, "use_muon": True, "layouts": layouts}], lr=0.05, weight_decay=0.1, ns_dtype="fp32")


class _Counts:
    """Newton-Schulz matrices and collectives issued while active (module attributes patched, then restored)."""

    def __init__(self) -> None:
        self.matrices = 0
        self.collectives = 0

    def __enter__(self) -> _Counts:
        import torch.distributed as dist
        from torch.distributed.tensor.debug import CommDebugMode

        import components.optim.muon as muon

        self._saved = [(muon, "newton_schulz", muon.newton_schulz)]
        self._saved += [(dist, name, getattr(dist, name)) for name in COLLECTIVES]
        ns = muon.newton_schulz

        def counted_ns(update, *args, **kwargs):
            self.matrices += update.reshape(-1, *update.shape[-2:]).shape[0]
            return ns(update, *args, **kwargs)

        muon.newton_schulz = counted_ns
        for module, name, fn in self._saved[1:]:
            setattr(module, name, self._counted(fn))
        self._comm = CommDebugMode()  # DTensor's own collectives (full_tensor, redistribute)
        self._comm.__enter__()
        return self

    def _counted(self, fn):
        def run(*args, **kwargs):
            self.collectives += 1
            return fn(*args, **kwargs)

        return run

    def __exit__(self, *exc) -> None:
        self._comm.__exit__(*exc)
        self.collectives += self._comm.get_total_counts()
        for module, name, fn in self._saved:
            setattr(module, name, fn)


def _sharded_rank(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import components.optim.muon as muon

    mesh = init_device_mesh("cpu", (world,))
    names = list(PARAMS)
    params = [torch.nn.Parameter(distribute_tensor(v, mesh, [Shard(0)])) for v in _values(0).values()]
    opt = _optimizer(params, names)
    counts = []
    for step in (1, 2):
        for p, g in zip(params, _values(step).values()):
            p.grad = distribute_tensor(g, mesh, [Shard(0)])
        with _Counts() as c:
            opt.step()
        counts.append(c.matrices)
    result = {"params": {n: p.full_tensor() for n, p in zip(names, params)}, "matrices": counts}
    # the experts alone: orthogonalised where they lie, not one collective
    experts = [p for n, p in zip(names, params) if PARAMS[n][1].stacked]
    with _Counts() as c:
        _optimizer(experts, [n for n in names if PARAMS[n][1].stacked]).step()
    result["expert_collectives"] = c.collectives
    # the control: the gathering reference path does communicate, so the hook sees collectives
    with _Counts() as c:
        muon.orthogonalized_update_any(experts[0].grad, PARAMS["experts"][1], 5, torch.float32)
    result["reference_collectives"] = c.collectives
    return result


def _one_process() -> tuple[dict[str, torch.Tensor], int]:
    names = list(PARAMS)
    params = [torch.nn.Parameter(v) for v in _values(0).values()]
    opt = _optimizer(params, names)
    for step in (1, 2):
        for p, g in zip(params, _values(step).values()):
            p.grad = g
        with _Counts() as c:
            opt.step()
    return {n: p.detach() for n, p in zip(names, params)}, c.matrices


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_sharded_muon_equals_one_process_with_each_matrix_orthogonalised_once(tmp_path, world):
    reference, total = _one_process()
    assert total == 8 + 1 + 1 + 2 + 2 + 4  # every matrix and every head block of one step
    ranks = run_ranks(_sharded_rank, world, tmp_path)
    for r in ranks:
        for name, value in reference.items():
            torch.testing.assert_close(r["params"][name], value, rtol=0, atol=1e-6, msg=name)
        assert r["expert_collectives"] == 0 and r["reference_collectives"] > 0
    per_rank = [r["matrices"][-1] for r in ranks]
    assert sum(per_rank) == total  # each matrix orthogonalised once, on one rank
    assert max(per_rank) <= -(-total // world) + 2  # and the work falls by the world size (round-robin owners)
