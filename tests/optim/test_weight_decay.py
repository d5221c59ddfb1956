"""Weight decay is declared by name (``no_weight_decay()``): for every registered mixer, FFN and residual
scheme, the decayed parameters are the matrices (2-D and up) not declared, as before the declaration moved
off the Parameter objects; and the grouping is the same after FSDP2 sharding on two CPU ranks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from components.nn.build_context import BuildContext
from components.optim.param_groups import adamw_param_groups, declared_no_decay, unique_trainable
from components.registry import FFNS, MIXERS, RESIDUALS

N_LAYERS = 2
# what each member keeps out of weight decay (all other members: nothing)
DECLARED = {
    "kda": {"A_log", "dt_bias"},
    **{
        scheme: {f"{g}.{i}" for g in ("self_attention_res_proj", "mlp_res_proj") for i in range(N_LAYERS)}
        | {"output_attn_res_proj"}
        for scheme in ("block_attnres", "full_attnres")
    },
}
MEMBERS = [(reg, entry.name) for reg in (MIXERS, FFNS, RESIDUALS) for entry in reg]


def grouping(model: torch.nn.Module) -> tuple[set[str], set[str]]:
    """(decayed, not decayed) parameter names of ``model``'s AdamW groups."""
    params = unique_trainable(model)
    names = {id(p): n for n, p in params}
    decayed: set[str] = set()
    for group in adamw_param_groups(model, params, 0.1):
        if group["weight_decay"] > 0:
            decayed |= {names[id(p)] for p in group["params"]}
    return decayed, set(names.values()) - decayed


@pytest.mark.parametrize("registry,name", MEMBERS, ids=[f"{r.group}={n}" for r, n in MEMBERS])
def test_every_member_decays_its_undeclared_matrices(registry, name):
    entry = registry.get(name)
    with torch.device("meta"):
        module = entry.cls(entry.config_cls(), BuildContext(64, n_layers=N_LAYERS))
    assert declared_no_decay(module) == DECLARED.get(name, set())
    decayed, kept = grouping(module)
    matrices = {n for n, p in module.named_parameters() if p.ndim >= 2}
    assert decayed == matrices - DECLARED.get(name, set())
    assert kept == {n for n, _ in module.named_parameters()} - decayed


def _sharded_grouping(rank: int, world: int, init_file: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.helpers import build_model

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = build_model("model=tiny", "mixer=kda", "residual=block_attnres")
        before = grouping(model)
        mesh = init_device_mesh("cpu", (world,))
        # as runtime/lit_module.py::configure_model: each decoder layer, then the root
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        after = grouping(model)
        torch.save({"before": before, "after": after}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_fsdp2_sharding_keeps_the_grouping(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = str(tmp_path / "grouping")
    mp.spawn(_sharded_grouping, args=(2, str(tmp_path / "init"), out), nprocs=2, join=True)
    for rank in range(2):
        result = torch.load(f"{out}.{rank}", weights_only=False)
        decayed, kept = result["before"]
        assert result["after"] == (decayed, kept)
        assert any(n.endswith("A_log") for n in kept) and "residual.output_attn_res_proj" in kept
        assert decayed and all(not n.endswith(("A_log", "dt_bias")) for n in decayed)
