"""Router statistics as they travel between ranks: QB's histogram in int32 (half the bytes of int64 kept and
all-reduced every step), and a step whose token count int32 cannot hold refused by name."""

from __future__ import annotations

import pytest
import torch

from components.balancers.qb import QBBalancer, QBConfig
from components.ffn.router import Router


def _routed(tokens: int) -> Router:
    torch.manual_seed(0)
    router = Router(16, 8, 2).train()
    QBBalancer(QBConfig()).attach(router)
    router(torch.randn(tokens, 16))
    return router


def test_qb_histogram_is_int32_and_counts_every_token():
    router = _routed(64)
    assert router.hist.dtype == torch.int32 and router.hist.shape == (8, QBConfig().bins)
    assert int(router.hist.sum()) == 64 * 8  # each token's margin to every expert


def test_qb_refuses_a_step_beyond_int32_counts():
    router = _routed(64)
    router.tokens = 2**31  # as if a global step routed that many tokens
    with pytest.raises(OverflowError, match="int32"), pytest.warns(UserWarning):
        QBBalancer(QBConfig()).step(router)
