"""MQAR: keys then queries, only the value after each query is scored, deterministic per seed."""

from __future__ import annotations

import torch

from components.data.base import IGNORE_INDEX
from components.data.mqar import MQAR, MQARConfig, mqar_examples


def test_structure_of_examples():
    cfg = MQARConfig(vocab_size=64, seq_len=32, num_kv_pairs=4, batch_size=16)
    g = torch.Generator().manual_seed(0)
    x, y = mqar_examples(cfg, 16, g)
    assert x.shape == y.shape == (16, 32)
    half = cfg.vocab_size // 2
    for row_x, row_y in zip(x, y):
        keys, values = row_x[0:8:2], row_x[1:8:2]
        assert ((keys >= 1) & (keys < half)).all() and ((values >= half) & (values < 64)).all()
        assert len(set(keys.tolist())) == 4
        scored = (row_y != IGNORE_INDEX).nonzero().flatten()
        assert len(scored) == 4  # one per key
        pairs = dict(zip(keys.tolist(), values.tolist()))
        for pos in scored.tolist():
            assert pos >= 8
            assert pairs[row_x[pos].item()] == row_y[pos].item()  # the query key's value


def test_deterministic_and_independent_batches():
    data = MQAR(MQARConfig(), seed=5)
    a, b = data.train_batch(3), data.train_batch(3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(data.train_batch(4)[0], a[0])
    vx, _ = data.val_batch(0)
    assert not torch.equal(vx[: a[0].shape[0]], a[0])


def test_accuracy_metric():
    data = MQAR(MQARConfig(vocab_size=16, seq_len=16, num_kv_pairs=2, batch_size=4, num_val_examples=4), seed=0)
    x, y = data.val_batch(0)
    logits = torch.zeros(*y.shape, 16)
    logits.scatter_(2, y.clamp(min=0).unsqueeze(-1), 1.0)  # perfect recall
    sums = data.metric_sums(logits, y, torch.zeros(y.shape))
    assert data.finish_metrics({k: float(v) for k, v in sums.items()})["accuracy"] == 1.0
