"""Router (docs/k3.md §4.1, 10.10 item 7): selection-only bias, weights from unbiased scores, ROUTE-S0, statistics."""

import math

import pytest
import torch

from components.ffn.router import Router, histogram_range, margin_histogram


def _router(E=16, k=4, d=32, seed=0, **kw):
    torch.manual_seed(seed)
    r = Router(d, E, k, init_std=0.5, **kw)
    return r


def _x(N=256, d=32, seed=1):
    return torch.randn(N, d, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shift", [-1.0, 0.25, 0.5, 2.0])
def test_constant_bias_shift_never_changes_selection(shift):
    r = _router().eval()
    x = _x()
    r.e_score_correction_bias.copy_(0.1 * torch.randn(16, generator=torch.Generator().manual_seed(2)))
    idx0, w0, s0 = r(x)
    r.e_score_correction_bias += shift
    idx1, w1, s1 = r(x)
    assert torch.equal(idx0, idx1)
    assert torch.equal(w0, w1)
    assert torch.equal(s0, s1)


def test_bias_changes_selection_but_never_enters_the_weights():
    r = _router().eval()
    x = _x()
    _, _, scores = r(x)
    b = torch.zeros(16)
    b[3] = 10.0  # expert 3 is always chosen
    r.e_score_correction_bias.copy_(b)
    idx, w, scores_b = r(x)
    assert torch.equal(scores, scores_b)  # scores are unbiased
    assert (idx == 3).any(dim=1).all()
    chosen = scores.gather(1, idx)  # [N, k] unbiased scores of the chosen experts
    torch.testing.assert_close(w, chosen / chosen.sum(dim=1, keepdim=True), rtol=1e-6, atol=0)


@pytest.mark.parametrize("scale", [1.0, 2.446])
@pytest.mark.parametrize("activation", ["sigmoid", "softmax"])
def test_weights_sum_to_routed_scaling_factor(scale, activation):
    r = _router(routed_scaling_factor=scale, activation=activation).eval()
    r.e_score_correction_bias.normal_(generator=torch.Generator().manual_seed(3))
    _, w, _ = r(_x())
    assert w.dtype == torch.float32
    torch.testing.assert_close(w.sum(dim=1), torch.full((256,), scale), rtol=1e-6, atol=1e-6)


def test_no_renormalisation_keeps_raw_scores_and_top1_is_never_renormalised():
    r = _router(renormalize=False, routed_scaling_factor=2.0).eval()
    idx, w, s = r(_x())
    torch.testing.assert_close(w, 2.0 * s.gather(1, idx))
    r1 = _router(k=1).eval()
    idx, w, s = r1(_x())
    torch.testing.assert_close(w, s.gather(1, idx))


def test_route_s0_example():
    """[S0]: 8 experts, top-2, s(E2) = 0.9, s(E7) = 0.6 -> weights 0.6 and 0.4."""
    scores = torch.tensor([0.1, 0.2, 0.9, 0.3, 0.05, 0.4, 0.25, 0.6])
    r = Router(8, 8, 2).eval()
    with torch.no_grad():
        r.weight.copy_(torch.diag(torch.logit(scores.double()).float()))  # x = e_0 + ... reads one logit each
    x = torch.ones(1, 8)
    idx, w, s = r(x)
    torch.testing.assert_close(s[0], scores, rtol=1e-6, atol=1e-6)
    assert idx[0].tolist() == [2, 7]
    torch.testing.assert_close(w[0], torch.tensor([0.6, 0.4]), rtol=1e-6, atol=1e-6)


def test_logits_fp32_and_state_stays_fp32_under_module_casts():
    r = _router()
    r.to(torch.bfloat16)
    assert r.weight.dtype == torch.float32 and r.e_score_correction_bias.dtype == torch.float32
    idx, w, s = r.eval()(_x().bfloat16())
    assert s.dtype == torch.float32 and w.dtype == torch.float32 and idx.dtype == torch.int64
    assert "e_score_correction_bias" in r.state_dict()  # checkpointed
    assert "e_score_correction_bias" not in dict(r.named_parameters())  # not trained by the optimizer


def test_statistics_accumulate_in_training_mode_only():
    r = _router(E=8, k=2)
    x = _x(N=64)
    r.eval()(x)
    assert r.tokens == 0 and r.load is None and r.last is None
    r.train()
    idx_a, _, _ = r(x[:40])
    idx_b, _, _ = r(x[40:])
    assert r.tokens == 64
    expected = torch.bincount(torch.cat([idx_a, idx_b]).flatten(), minlength=8)
    assert torch.equal(r.load, expected)
    assert int(r.load.sum()) == 64 * 2
    assert r.last.indices.shape == (24, 2) and r.last.scores.requires_grad
    r.reset_stats()
    assert r.tokens == 0 and r.load is None and r.last is None


def test_cutoff_is_the_k_plus_1_th_biased_score_and_leading_shape_is_kept():
    r = _router(E=8, k=3).train()
    r.e_score_correction_bias.normal_(generator=torch.Generator().manual_seed(4))
    x = _x(N=30).view(5, 6, 32)
    idx, w, s = r(x)
    assert idx.shape == (30, 3) and s.shape == (30, 8)
    assert r.last.shape == (5, 6)
    biased = s.detach() + r.e_score_correction_bias
    torch.testing.assert_close(r.last.cutoff, biased.sort(dim=1, descending=True).values[:, 3])
    # every chosen expert beats the cutoff, every other one does not
    chosen = torch.zeros(30, 8, dtype=torch.bool).scatter_(1, idx, True)
    margin = biased - r.last.cutoff[:, None]
    assert (margin[chosen] > 0).all() and (margin[~chosen] <= 0).all()


def test_histogram_statistic_matches_margin_histogram_and_is_additive():
    r = _router(E=8, k=2)
    r.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, 8))
    r.configure_stats(hist_bins=50)
    r.train()
    x = _x(N=96)
    r(x[:50])
    r(x[50:])
    lo, hi = histogram_range(r.e_score_correction_bias)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in r.hist_range)  # on device, no host read
    assert [float(v) for v in r.hist_range] == [float(lo), float(hi)]
    assert math.isclose(lo, -1.3, rel_tol=1e-6) and math.isclose(hi, 1.3, rel_tol=1e-6)
    with torch.no_grad():
        _, _, s = r.eval()(x)
        cutoff = (s + r.e_score_correction_bias).topk(3, dim=1).values[:, 2]
    ref = margin_histogram(cutoff[:, None] - s, lo, hi, 50)
    assert torch.equal(r.hist, ref)
    assert r.stats_complete()


def test_a_diverging_step_reaches_the_non_finite_guard_instead_of_failing_in_the_histogram():
    """NaN scores (weights gone non-finite at a too-high rate) give NaN margins: they count in the last bin
    and the forward pass ends, so the run stops naming the non-finite step instead of failing in bincount."""
    r = torch.tensor([[0.1, float("nan")], [float("inf"), -float("inf")], [float("nan"), float("nan")]])
    h = margin_histogram(r, -1.0, 1.0, 4)  # [E=2, bins=4]
    assert h.tolist() == [[0, 0, 1, 2], [1, 0, 0, 2]]
    router = _router(E=8, k=2)
    router.configure_stats(hist_bins=50)
    router.train()
    with torch.no_grad():
        router.weight.fill_(float("nan"))
    router(_x(N=16))
    assert int(router.hist.sum()) == 16 * 8


def test_lazy_stats_backfill_from_the_latest_forward():
    r = _router(E=8, k=2).train()
    x = _x(N=40)
    r(x)
    r.configure_stats(hist_bins=20)  # switched on after one micro-batch: back-filled
    assert r.stats_complete() and int(r.hist[0].sum()) == 40
    r(x)
    r.configure_stats(keep_margins=True)  # two micro-batches seen: cannot back-fill
    assert not r.stats_complete()
