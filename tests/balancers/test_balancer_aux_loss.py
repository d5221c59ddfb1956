"""Auxiliary balancing loss (docs/k3.md §6.2): normalisation, gradient only through P, sequence-wise form."""

import pytest
import torch
from torch import nn

from components.balancers.aux_loss import AuxLossBalancer, AuxLossConfig, balance_loss
from components.ffn.router import Router, RouterRecord


def _record(scores, indices, shape=None):
    return RouterRecord(
        scores=scores, indices=indices, cutoff=torch.zeros(scores.shape[0]), shape=shape or (scores.shape[0],)
    )


def test_balanced_value_is_alpha_and_collapse_is_alpha_times_e():
    E, k, T = 4, 1, 8
    idx = torch.arange(T).remainder(E)[:, None]  # perfectly balanced top-1
    s = torch.full((T, E), 0.5)
    assert float(balance_loss(_record(s, idx), k, 0.01)) == pytest.approx(0.01)
    collapsed = torch.zeros(T, 1, dtype=torch.long)
    s = torch.zeros(T, E).index_fill_(1, torch.tensor([0]), 1.0)  # all probability on expert 0
    assert float(balance_loss(_record(s, collapsed), k, 0.01)) == pytest.approx(0.01 * E)


def test_gradient_flows_only_through_p():
    torch.manual_seed(0)
    T, E, k = 12, 6, 2
    logits = torch.randn(T, E, requires_grad=True)
    s = torch.sigmoid(logits)
    idx = (s + torch.randn(E)).topk(k, dim=1).indices  # selection with some bias
    loss = balance_loss(_record(s, idx), k, 0.1)
    (g,) = torch.autograd.grad(loss, logits)
    # f is a constant count: the loss is linear in P with coefficients alpha * E * f_j
    f = torch.zeros(T, E).scatter_(1, idx, 1.0).sum(0) / (k * T)
    s2 = torch.sigmoid(logits)
    P = (s2 / s2.sum(1, keepdim=True)).mean(0)
    (g_ref,) = torch.autograd.grad(0.1 * E * (f * P).sum(), logits)
    torch.testing.assert_close(g, g_ref)
    assert float(loss.detach()) == pytest.approx(float(0.1 * E * (f * P).sum().detach()))


def test_sequence_wise_is_the_mean_over_sequences():
    torch.manual_seed(1)
    B, T, E, k = 3, 5, 4, 2
    s = torch.rand(B * T, E)
    idx = s.topk(k, dim=1).indices
    seq = balance_loss(_record(s, idx, (B, T)), k, 1e-4, sequence_wise=True)
    per = [balance_loss(_record(s[b * T : (b + 1) * T], idx[b * T : (b + 1) * T]), k, 1e-4) for b in range(B)]
    assert float(seq) == pytest.approx(float(sum(per) / B))
    assert float(balance_loss(_record(s, idx, (B, T)), k, 1e-4)) != pytest.approx(float(seq))


def test_balancer_sums_layers_and_grads_reach_only_the_router():
    torch.manual_seed(2)
    model = nn.ModuleList([Router(8, 4, 2, init_std=0.5, layer_idx=i) for i in range(2)])
    expert = nn.Linear(8, 8)
    x = torch.randn(2, 6, 8)
    for r in model:
        r.train()(expert(x))
    bal = AuxLossBalancer(AuxLossConfig(alpha=0.01))
    loss = bal.aux_loss(model)
    expected = sum(balance_loss(r.last, 2, 0.01) for r in model)
    assert float(loss.detach()) == pytest.approx(float(expected.detach()))
    loss.backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in model)
    assert torch.equal(model[0].e_score_correction_bias, torch.zeros(4))
    metrics = bal.step(model)
    assert {"maxvio/layer_0", "maxvio/layer_1", "maxvio/mean", "maxvio/max"} == set(metrics)
    assert bal.aux_loss(model) is None  # nothing routed since the step


def test_no_routers_no_loss():
    assert AuxLossBalancer(AuxLossConfig()).aux_loss(nn.Linear(2, 2)) is None
