"""A distributed checkpoint (DCP) of an expert-parallel model reshards: written at (efsdp, ep) = (2, 2), it
loads at (1, 4), at (4, 1) and on one process with identical parameters, Muon momentum and router biases.

The experts are DTensors with the global names and shapes of one process (components/ffn/expert_parallel.py),
so DCP maps every rank's slice of a weight to the slices another mesh asks for."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.gloo_ranks import run_ranks

MODEL = ["experiment=k3_tiny", "data.batch_size=8"]


def _build(seed: int):
    """k3_tiny (MTP, Stable LatentMoE, QB, Muon) from ``seed``, and a function building its optimizer."""
    from components.model import Decoder
    from components.registry import OPTIMIZERS
    from tests.helpers import compose_root

    root = compose_root(*MODEL)
    torch.manual_seed(seed)
    model = Decoder(root.decoder_config())
    return model, lambda: OPTIMIZERS.build(root.optimizer, model, key="optimizer")


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _snapshot(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from components.balancers.load_stats import find_routers

    osd = get_optimizer_state_dict(model, optimizer)
    momentum = {k: _full(v["momentum_buffer"]) for k, v in osd["state"].items() if "momentum_buffer" in v}
    return {
        "params": {n: _full(p) for n, p in model.named_parameters()},
        "momentum": momentum,
        "biases": {str(i): _full(r.e_score_correction_bias) for i, r in enumerate(find_routers(model))},
    }


def _state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def _shard(model, world: int, ep: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from runtime.strategies import shard_fsdp2

    shard_fsdp2(model, init_device_mesh("cpu", (world,)), None, ep)


def _save_rank(rank: int, world: int, ep: int, folder: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from components.balancers.load_stats import find_routers

    model, make_optimizer = _build(seed=0)
    _shard(model, world, ep)
    optimizer = make_optimizer()
    ids = torch.randint(0, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank))
    hidden = model.hidden_states(ids)
    loss = model.lm_head(hidden).logsumexp(-1).mean() + sum(s for s, _ in model.mtp_losses(hidden, ids, ids))
    loss.backward()
    optimizer.step()  # Muon momentum and AdamW moments now hold a step's state
    with torch.no_grad():
        for i, r in enumerate(find_routers(model)):
            r.e_score_correction_bias.copy_(torch.linspace(-1, 1, r.num_experts) * (i + 1))
    dcp.save(_state(model, optimizer), checkpoint_id=folder)
    return _snapshot(model, optimizer)


def _load_rank(rank: int, world: int, ep: int, folder: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, make_optimizer = _build(seed=1)  # other weights: what matches was loaded
    if ep:
        _shard(model, world, ep)
    optimizer = make_optimizer()
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=folder, no_dist=not ep)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _snapshot(model, optimizer)


def _assert_identical(a: dict, b: dict, where: str) -> None:
    for part in ("params", "momentum", "biases"):
        assert sorted(a[part]) == sorted(b[part]) and a[part], (where, part)
        for name in a[part]:
            assert torch.equal(a[part][name], b[part][name]), (where, part, name)


@pytest.mark.slow
def test_checkpoint_written_at_2x2_loads_at_1x4_4x1_and_one_process(tmp_path):
    folder = str(tmp_path / "ckpt")
    saved = run_ranks(_save_rank, 4, tmp_path / "save", 2, folder)[0]
    assert any(k.endswith("experts.w1") for k in saved["momentum"])
    for ep in (4, 1):  # (efsdp, ep) = (1, 4), (4, 1)
        loaded = run_ranks(_load_rank, 4, tmp_path / f"ep{ep}", ep, folder)
        for r in loaded:
            _assert_identical(saved, r, f"ep={ep}")
    _assert_identical(saved, _load_rank(0, 1, 0, folder), "one process")
