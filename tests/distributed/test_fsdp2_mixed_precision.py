"""FSDP2 under ``bf16-mixed``: the parameters each unit gathers for its forward are bf16, the sharded
parameters and their reduced gradients stay fp32 (runtime/strategies.py::mixed_precision_policy)."""

from __future__ import annotations

import torch

from tests.distributed.gloo_ranks import run_ranks


def _dtypes_seen(rank: int, world: int, precisions: tuple[str, ...]) -> dict[str, dict[str, set]]:
    return {precision: _dtypes_under(rank, world, precision) for precision in precisions}


def _dtypes_under(rank: int, world: int, precision: str) -> dict[str, set]:
    from torch.distributed.device_mesh import init_device_mesh

    from runtime.strategies import mixed_precision_policy, shard_fsdp2
    from tests.helpers import build_model

    torch.manual_seed(0)
    model = build_model("model=tiny", "model.mtp_depth=1", "model.tie_embeddings=false")
    shard_fsdp2(model, init_device_mesh("cpu", (world,)), mixed_precision_policy(precision))
    seen: dict[str, set] = {"forward": set(), "sharded": set(), "grad": set()}

    def record(module: torch.nn.Module, args: object) -> None:
        # FSDP's own pre-forward hook ran first (registered at fully_shard): the unsharded parameters
        seen["forward"].update(str(p.dtype) for p in module.parameters(recurse=False))

    for module in model.modules():
        module.register_forward_pre_hook(record)
    ids = torch.randint(0, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank))
    hidden = model.hidden_states(ids)
    loss = model.lm_head(hidden).float().logsumexp(-1).mean()
    loss = loss + sum(s for s, _ in model.mtp_losses(hidden, ids, ids))
    loss.backward()
    seen["sharded"].update(str(p.dtype) for p in model.parameters())
    seen["grad"].update(str(p.grad.dtype) for p in model.parameters() if p.grad is not None)
    return seen


def test_bf16_mixed_gathers_bf16_parameters_and_keeps_fp32_shards_and_gradients(tmp_path):
    compute = {"bf16-mixed": "torch.bfloat16", "32-true": "torch.float32"}  # 32-true: the control
    for seen in run_ranks(_dtypes_seen, 2, tmp_path, tuple(compute)):
        for precision, dtype in compute.items():
            assert seen[precision]["forward"] == {dtype}, precision
            assert seen[precision]["sharded"] == {"torch.float32"} and seen[precision]["grad"] == {"torch.float32"}
