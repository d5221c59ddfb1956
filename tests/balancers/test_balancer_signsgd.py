"""Loss-free SignSGD bias update (docs/k3.md §6.3) and the shared MaxVio / all-reduce plumbing (docs/k3.md §6.1)."""

import pytest
import torch
from torch import nn

from components.balancers import load_stats
from components.balancers.load_stats import find_routers, finish_step, maxvio, maxvio_metrics, reduced_loads
from components.balancers.signsgd import SignSGDBalancer, SignSGDConfig
from components.ffn.router import Router


def _set_loads(router, loads):
    router.load = torch.tensor(loads, dtype=torch.int64)
    router.tokens = int(sum(loads)) // router.top_k


def test_update_sign_and_size():
    r = Router(8, 4, 2)
    _set_loads(r, [10, 2, 4, 4])  # ideal q = 5
    metrics = SignSGDBalancer(SignSGDConfig(update_rate=0.01)).step(r)
    torch.testing.assert_close(r.e_score_correction_bias, torch.tensor([-0.01, 0.01, 0.01, 0.01]))
    assert metrics["maxvio/layer_0"] == pytest.approx((10 - 5) / 5)
    assert r.load is None and r.tokens == 0  # consumed


def test_balanced_expert_is_left_alone_and_updates_accumulate():
    r = Router(8, 4, 1)
    bal = SignSGDBalancer(SignSGDConfig())
    for _ in range(3):
        _set_loads(r, [3, 5, 4, 4])
        bal.step(r)
    torch.testing.assert_close(r.e_score_correction_bias, torch.tensor([3e-3, -3e-3, 0.0, 0.0]))


def test_loads_are_summed_over_micro_batches_from_real_routing():
    torch.manual_seed(0)
    r = Router(16, 8, 2, init_std=0.5).train()
    x = torch.randn(100, 16)
    idx_a, _, _ = r(x[:30])
    idx_b, _, _ = r(x[30:])
    load = torch.bincount(torch.cat([idx_a, idx_b]).flatten(), minlength=8).double()
    SignSGDBalancer(SignSGDConfig(update_rate=1.0)).step(r)
    assert torch.equal(r.e_score_correction_bias, torch.sign(load.mean() - load).float())


def test_loads_are_summed_over_ranks(monkeypatch):
    """One all-reduce of the packed [L, E + 1] loads: the update uses the global counts."""
    r = Router(8, 4, 1)
    other_rank = torch.tensor([[0.0, 8.0, 0.0, 0.0, 8.0]])  # [L, E | tokens] of another rank

    def fake_all_reduce(t):
        t += other_rank
        return t

    monkeypatch.setattr(load_stats, "reduce_router_stats_", fake_all_reduce)
    _set_loads(r, [6, 0, 1, 1])  # alone: expert 1 starved; with the other rank: expert 1 overloaded (q = 4)
    SignSGDBalancer(SignSGDConfig(update_rate=1.0)).step(r)
    torch.testing.assert_close(r.e_score_correction_bias, torch.tensor([-1.0, -1.0, 1.0, 1.0]))


def test_all_reduce_with_a_real_single_process_group(tmp_path):
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        r = Router(8, 4, 1)
        _set_loads(r, [5, 1, 1, 1])
        loads, tokens = reduced_loads([r])
        assert loads.tolist() == [[5, 1, 1, 1]] and tokens.tolist() == [8]
    finally:
        dist.destroy_process_group()


def test_maxvio_definition_and_metrics():
    assert float(maxvio(torch.tensor([4, 4, 4, 4]))) == 0.0
    assert float(maxvio(torch.tensor([16, 0, 0, 0]))) == pytest.approx(3.0)  # N - 1 at full collapse
    model = nn.ModuleList([Router(8, 4, 1, layer_idx=1), Router(8, 4, 1, layer_idx=3)])
    loads = torch.tensor([[2.0, 2, 2, 2], [5, 1, 1, 1]])
    m = maxvio_metrics(find_routers(model), loads, torch.tensor([8.0, 8.0]))
    assert m == pytest.approx({"maxvio/layer_1": 0.0, "maxvio/layer_3": 1.5, "maxvio/mean": 0.75, "maxvio/max": 1.5})


def test_finish_step_without_routers_or_tokens():
    assert finish_step(nn.Linear(2, 2)) == {}
    assert SignSGDBalancer(SignSGDConfig()).step(nn.Linear(2, 2)) == {}
    r = Router(8, 4, 1)
    assert finish_step(r) == {}  # no tokens routed this step: nothing to report
    assert torch.equal(r.e_score_correction_bias, torch.zeros(4))
