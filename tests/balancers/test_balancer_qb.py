"""Quantile Balancing (docs/k3.md §6.4-6.6, 10.10 item 11): exact counts, sharding, histogram accuracy, causality."""

import warnings

import pytest
import torch

from components.balancers import load_stats, qb
from components.balancers.load_stats import maxvio
from components.balancers.qb import QBBalancer, QBConfig, center, qb_bias_exact, qb_bias_histogram, qb_bias_interpolated
from components.balancers.signsgd import SignSGDBalancer, SignSGDConfig
from components.ffn.router import Router, histogram_range, margin_histogram

E, K, D = 16, 2, 32


def skewed_router(seed=0, skew=2.0, E=E, k=K):
    """A router whose last input feature (always 1) pushes scores up for high expert ids."""
    torch.manual_seed(seed)
    r = Router(D, E, k, init_std=0.3)
    with torch.no_grad():
        r.weight[:, -1] = torch.linspace(-skew, skew, E)
    return r


def tokens(M, seed=1):
    x = torch.randn(M, D, generator=torch.Generator().manual_seed(seed))
    x[:, -1] = 1.0
    return x


def route_loads(router, x):
    with torch.no_grad():
        idx, _, _ = router.eval()(x)
    router.train()
    return torch.bincount(idx.flatten(), minlength=router.num_experts)


def margins_with(router, x):
    """r = cutoff - s [M, E] of x routed with the router's current bias."""
    with torch.no_grad():
        _, _, s = router.eval()(x)
    router.train()
    b = router.e_score_correction_bias
    cutoff = (s + b).topk(router.top_k + 1, dim=1).values[:, -1]
    return cutoff[:, None] - s


def test_exact_step_gives_fixed_cutoff_counts_equal_to_q():
    r = skewed_router()
    r.e_score_correction_bias.normal_(std=0.1, generator=torch.Generator().manual_seed(5))
    M = 4096
    R = margins_with(r, tokens(M))  # [M, E]
    q = M * K // E
    bhat = qb_bias_exact(R, K)  # uncentred
    counts = (R < bhat).sum(dim=0)  # tokens with s_ij + bhat_j > alpha_i (cutoffs held fixed)
    srt = R.double().sort(dim=0).values
    no_tie = srt[q - 1] < srt[q]
    assert no_tie.sum() >= E - 2  # ties only where an expert's atom at r = 0 straddles q
    assert (counts[no_tie] == q).all(), counts


def test_balancer_exact_step_writes_centred_quantile():
    r = skewed_router()
    bal = QBBalancer(QBConfig(estimator="exact"))
    bal.attach(r)
    x = tokens(2048)
    R = margins_with(r, x)
    r(x[:1000])
    r(x[1000:])  # two micro-batches with the same (old) bias
    metrics = bal.step(r)
    expected = center(qb_bias_exact(R, K)).float()
    torch.testing.assert_close(r.e_score_correction_bias, expected, rtol=0, atol=1e-6)
    assert abs(float(r.e_score_correction_bias.mean())) < 1e-6
    assert set(metrics) == {"maxvio/layer_0", "maxvio/mean", "maxvio/max"}
    assert r.tokens == 0 and not r.margins  # consumed and reset


def test_interpolated_estimator_is_the_linear_quantile():
    R = torch.randn(301, 8, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(qb_bias_interpolated(R, 3), torch.quantile(R.double(), 3 / 8, dim=0))


def test_histogram_over_any_sharding_equals_single_shard():
    r = skewed_router()
    r.e_score_correction_bias.normal_(std=0.2, generator=torch.Generator().manual_seed(6))
    R = margins_with(r, tokens(3000))
    lo, hi = histogram_range(r.e_score_correction_bias)
    whole = margin_histogram(R, lo, hi, 1000)
    for cuts in ([1500], [1, 2, 999, 2500], list(range(100, 3000, 100))):
        bounds = [0, *cuts, 3000]
        parts = sum(margin_histogram(R[a:b], lo, hi, 1000) for a, b in zip(bounds[:-1], bounds[1:]))
        assert torch.equal(parts, whole)
    assert int(whole.sum()) == 3000 * E


def test_histogram_balancer_micro_batches_equal_one_batch():
    x = tokens(2000)
    biases = []
    for splits in ([2000], [700, 600, 700], [1] * 10 + [1990]):
        r = skewed_router()
        bal = QBBalancer(QBConfig())
        bal.attach(r)
        for chunk in x.split(splits):
            r(chunk)
        bal.step(r)
        biases.append(r.e_score_correction_bias.clone())
    for b in biases[1:]:
        torch.testing.assert_close(b, biases[0], rtol=0, atol=1e-6)


def test_histogram_counts_summed_over_ranks(monkeypatch):
    """Rank 0 sees half the tokens, rank 1 the other half: the update equals one process with all of them."""
    x = tokens(2000)
    recorded = []

    def record(t):
        recorded.append(t.clone())
        return t

    def replay(t):
        t += recorded.pop(0)
        return t

    for mod in (load_stats, qb):
        monkeypatch.setattr(mod, "reduce_router_stats_", record)
    other = skewed_router()
    bal = QBBalancer(QBConfig())
    bal.attach(other)
    other(x[1000:])
    bal.step(other)  # "rank 1": records its loads and histogram
    for mod in (load_stats, qb):
        monkeypatch.setattr(mod, "reduce_router_stats_", replay)
    rank0 = skewed_router()
    bal.attach(rank0)
    rank0(x[:1000])
    rank0_metrics = bal.step(rank0)
    assert not recorded
    monkeypatch.undo()
    single = skewed_router()
    bal.attach(single)
    single(x)
    single_metrics = bal.step(single)
    torch.testing.assert_close(rank0.e_score_correction_bias, single.e_score_correction_bias, rtol=0, atol=1e-6)
    assert rank0_metrics == pytest.approx(single_metrics)


@pytest.mark.parametrize("bins", [100, 1000])
def test_histogram_within_one_bin_width_of_exact(bins):
    r = skewed_router()
    r.e_score_correction_bias.normal_(std=0.3, generator=torch.Generator().manual_seed(7))
    M = 4096
    R = margins_with(r, tokens(M))
    lo, hi = histogram_range(r.e_score_correction_bias)
    width = (hi - lo) / bins
    est = qb_bias_histogram(margin_histogram(R, lo, hi, bins), lo, hi, M, K)
    exact = qb_bias_exact(R, K)
    srt = R.double().sort(dim=0).values
    q = M * K // E
    # any value in [r_(q), r_(q+1)] is an exact solution; the histogram lands within one bin of that interval
    assert (est >= srt[q - 1] - width - 1e-9).all() and (est <= srt[q] + width + 1e-9).all()
    gap = srt[q] - srt[q - 1]
    assert ((est - exact).abs() <= width + gap + 1e-9).all()


def test_histogram_interpolation_hits_tau_exactly_in_a_uniform_bin():
    hist = torch.tensor([[2, 4, 2, 0], [0, 0, 8, 0]])  # 8 tokens, 2 experts, k = 1: tau = 4
    b = qb_bias_histogram(hist, 0.0, 4.0, 8, 1)
    torch.testing.assert_close(b, torch.tensor([1.5, 2.5], dtype=torch.float64))


def test_causality_bias_used_for_a_batch_does_not_depend_on_it():
    x1, x2, x2_alt = tokens(1024, 1), tokens(1024, 2), tokens(1024, 3) * 2.0
    runs = {}
    for name, second in (("a", x2), ("b", x2_alt)):
        r = skewed_router()
        bal = QBBalancer(QBConfig())
        bal.attach(r)
        r(x1)
        bal.step(r)  # step 1: bias from x1
        used = r.e_score_correction_bias.clone()  # the bias that will route the second batch
        idx_first, _, _ = r(second[:512])
        bal.aux_loss(r)  # a mid-step balancer call must not touch the bias
        assert torch.equal(r.e_score_correction_bias, used)
        idx_second, _, _ = r(second[512:])
        bal.step(r)
        runs[name] = (used, r.e_score_correction_bias.clone())
        # the batch was routed with the old bias, not the one computed from it
        with torch.no_grad():
            s = torch.sigmoid(second.float() @ r.weight.T)
        assert torch.equal(idx_second.sort(1).values, (s[512:] + used).topk(K, dim=1).indices.sort(1).values)
    assert torch.equal(runs["a"][0], runs["b"][0])  # same history -> same bias, whatever the current batch
    assert not torch.equal(runs["a"][1], runs["b"][1])  # the NEXT bias does depend on it


def _maxvio_after(balancer, steps, x):
    r = skewed_router()
    if hasattr(balancer, "attach"):
        balancer.attach(r)
    for _ in range(steps):
        r(x)
        balancer.step(r)
    return float(maxvio(route_loads(r, x)))


def test_qb_balances_a_skewed_router_faster_than_signsgd():
    x = tokens(4096)
    start = float(maxvio(route_loads(skewed_router(), x)))
    assert start > 1.0
    mv_qb = _maxvio_after(QBBalancer(QBConfig()), 5, x)
    mv_exact = _maxvio_after(QBBalancer(QBConfig(estimator="exact")), 5, x)
    mv_sign = _maxvio_after(SignSGDBalancer(SignSGDConfig()), 5, x)
    assert mv_qb < 0.25 and mv_exact < 0.25
    assert mv_sign > 0.9 * start
    assert mv_qb < 0.25 * mv_sign


def test_lazy_attach_back_fills_one_micro_batch_and_warns_otherwise():
    x = tokens(1000)
    ref = skewed_router()
    bal = QBBalancer(QBConfig())
    bal.attach(ref)
    ref(x)
    bal.step(ref)
    lazy = skewed_router()
    lazy(x)
    QBBalancer(QBConfig()).step(lazy)  # attaches at step time, back-fills from the latest forward
    torch.testing.assert_close(lazy.e_score_correction_bias, ref.e_score_correction_bias, rtol=0, atol=0)
    late = skewed_router()
    late(x[:500])
    late(x[500:])
    with pytest.warns(UserWarning, match="attach"):
        metrics = QBBalancer(QBConfig()).step(late)
    assert torch.equal(late.e_score_correction_bias, torch.zeros(E))
    assert "maxvio/mean" in metrics


def test_top_k_equal_to_num_experts_leaves_bias_unchanged():
    r = skewed_router(E=4, k=4)
    for est in ("histogram", "exact"):
        bal = QBBalancer(QBConfig(estimator=est))
        bal.attach(r)
        r(tokens(64))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            bal.step(r)
        assert torch.equal(r.e_score_correction_bias, torch.zeros(4))


# -- the functional entry point on a fixed skewed score distribution ---------------------------------------
def fixed_skewed_scores(M=4096, N=16, offset=0.9, seed=0):
    """Sigmoid scores whose logits carry a per-expert offset in [-offset, offset]: high ids are favoured."""
    g = torch.Generator().manual_seed(seed)
    return torch.sigmoid(torch.randn(M, N, generator=g) + torch.linspace(-offset, offset, N))


def _loads(scores, bias, k):
    return torch.bincount((scores + bias).topk(k, dim=1).indices.flatten(), minlength=scores.shape[1])


@pytest.mark.parametrize("num_bins", [1000, None])
def test_quantile_balance_update_cuts_maxvio_and_beats_signsgd(num_bins):
    s, k = fixed_skewed_scores(), 2
    bias = torch.zeros(16)
    start = float(maxvio(_loads(s, bias, k)))
    assert 1.6 < start < 2.0  # about 1.8
    bias = qb.quantile_balance_update(s, bias, k, num_bins=num_bins)
    assert float(maxvio(_loads(s, bias, k))) < 0.35  # one step
    assert abs(float(bias.mean())) < 1e-6  # centred
    for _ in range(9):
        bias = qb.quantile_balance_update(s, bias, k, num_bins=num_bins)
    assert float(maxvio(_loads(s, bias, k))) < 0.1  # repeated steps
    # SignSGD (u = 1e-3), the loss-free bias K3 replaced, after as many steps
    sign_bias = torch.zeros(16)
    for _ in range(10):
        load = _loads(s, sign_bias, k).float()
        sign_bias += 1e-3 * torch.sign(load.mean() - load)
    assert float(maxvio(_loads(s, sign_bias, k))) > 0.9 * start


def test_quantile_balance_update_histogram_within_one_bin_and_shard_invariant():
    s, k = fixed_skewed_scores(), 2
    bias = torch.randn(16, generator=torch.Generator().manual_seed(3)) * 0.2
    exact = qb.quantile_balance_update(s, bias, k, num_bins=None)
    hist = qb.quantile_balance_update(s, bias, k, num_bins=1000)
    lo, hi = histogram_range(bias)
    assert (exact - hist).abs().max() <= (hi - lo) / 1000 + 1e-6
    # the histogram of any split of the tokens into shards equals the unsplit one
    cutoff = (s + bias).topk(k + 1, dim=1).values[:, -1]
    r = cutoff[:, None] - s
    whole = margin_histogram(r, lo, hi, 1000)
    for cuts in ([1000, 3096], [1, 2047, 2048], [7, 500, 1500, 2089]):
        assert torch.equal(sum(margin_histogram(part, lo, hi, 1000) for part in r.split(cuts)), whole)
    # top-k >= N: nothing to balance
    assert torch.equal(qb.quantile_balance_update(s[:, :2], bias[:2], 2), bias[:2])
