"""End to end: a MoE decoder trained on the embedded corpus logs MaxVio falling under QB and SignSGD and
staying high without a balancer (slow: three short training runs).

SignSGD runs at u = 1e-2 here: at K3's 1e-3 the bias moves at most 0.2 in 200 steps, less than the
router's own drift towards imbalance (tests/balancers/test_balancer_qb.py shows that slowness directly).

The data is pinned to the byte corpus, as the studies pin it: the thresholds below are relative to the first
step's MaxVio, about 2.2 on bytes (a few frequent byte ids carry much of the text, and the untrained router
sends each id to the same experts). On the default BPE data the first step is already near balance (0.63);
QB holds 0.69 and SignSGD 0.57 there against 3.8 without a balancer, and "falls to half" no longer describes
balancing."""

from __future__ import annotations

import statistics

import pytest

STEPS = 200
COMMON = [
    "data=corpus",
    "model=tiny",
    "ffn=stable_latent_moe",
    "ffn.num_experts=16",
    "ffn.top_k=2",
    "data.seq_len=64",
    "data.batch_size=16",
    "data.val_tokens=2048",
    f"trainer.max_steps={STEPS}",
    "trainer.val_check_interval=100000",
    "trainer.compile=false",
    "trainer.max_time_minutes=null",
    "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1",
    "logger=csv",
]


def maxvio_curve(rows: list[dict]) -> list[float]:
    return [r["balance/maxvio/mean"] for r in rows if "balance/maxvio/mean" in r]


@pytest.mark.slow
def test_maxvio_falls_with_qb_and_signsgd_and_stays_high_without(tmp_path, train_run):
    curves = {}
    for balancer, extra in (("none", []), ("signsgd", ["balancer.update_rate=0.01"]), ("qb", [])):
        result = train_run(*COMMON, f"balancer={balancer}", *extra, f"output_root={tmp_path / balancer}")
        curves[balancer] = maxvio_curve(result.metrics)
        assert len(curves[balancer]) == STEPS
    early = {b: c[0] for b, c in curves.items()}  # step 0: routed with the zero initial bias
    late = {b: statistics.mean(c[-20:]) for b, c in curves.items()}
    print({b: (round(early[b], 3), round(late[b], 3)) for b in curves})
    assert late["qb"] < 0.5 * early["qb"]
    assert late["signsgd"] < 0.8 * early["signsgd"]
    assert late["none"] > 0.8 * early["none"]
    assert late["qb"] < late["signsgd"] < late["none"]
