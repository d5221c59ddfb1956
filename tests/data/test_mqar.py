"""MQAR: keys then queries, only the value after each query is scored, deterministic per seed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from components.data.base import IGNORE_INDEX
from components.data.mqar import MQAR, MQARConfig, MQARSegment, mqar_examples


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


def _segmented(**extra) -> MQARConfig:
    return MQARConfig(
        vocab_size=64,
        seq_len=32,
        batch_size=8,
        **extra,
        train_segments=[MQARSegment(16, 2, 24), MQARSegment(32, 4, 16)],
        test_segments=[MQARSegment(16, 2, 12), MQARSegment(64, 8, 8)],
    )


def test_training_cycles_through_the_fixed_segment_examples_once_per_epoch():
    data = MQAR(_segmented(), seed=1)
    rows = torch.cat([data.train_batch(i)[0] for i in range(5)])  # 40 rows = one epoch of 24 + 16 examples
    assert rows.shape == (40, 32)
    everything = data._train[0].long()
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, everything.tolist()))  # each example exactly once
    assert not torch.equal(torch.cat([data.train_batch(i)[0] for i in range(5, 10)]), rows)  # the next epoch reshuffles
    x, y = data.train_batch(0)
    for row_x, row_y in zip(x, y):
        scored = (row_y != IGNORE_INDEX).nonzero().flatten()
        short = len(scored) == 2  # a (16, 2) example: padded from position 16 on, never scored there
        assert len(scored) in (2, 4) and (not short or (scored.max() < 16 and (row_x[16:] == 0).all()))


def test_every_test_segment_is_validated_at_its_own_length_and_reported_alone():
    data = MQAR(_segmented(), seed=1)
    shapes = [data.val_batch(i)[0].shape for i in range(data.num_val_batches())]
    assert shapes == [(8, 16), (4, 16), (8, 64)]
    sums: dict[str, float] = {}
    for i in range(data.num_val_batches()):
        x, y = data.val_batch(i)
        logits = torch.zeros(*y.shape, 64)
        if x.shape[1] == 16:  # perfect recall on the short segment, none on the long one
            logits.scatter_(2, y.clamp(min=0).unsqueeze(-1), 1.0)
        for k, v in data.metric_sums(logits, y, torch.zeros(y.shape), i).items():
            sums[k] = sums.get(k, 0.0) + float(v)
    metrics = data.finish_metrics(sums)
    assert metrics["accuracy/T16_P2"] == 1.0 and metrics["accuracy/T64_P8"] == 0.0
    assert metrics["accuracy"] == (12 * 2) / (12 * 2 + 8 * 8)  # every scored value counts once overall


def test_segment_settings_are_checked_by_key():
    from components.registry import ConfigError

    with pytest.raises(
        ConfigError, match=r"data.train_segments\[1\].seq_len: 32 is longer than the training length data.seq_len=16"
    ):
        dataclasses.replace(_segmented(), seq_len=16).validate(None, "data")
    with pytest.raises(ConfigError, match=r"data.test_segments\[0\].seq_len: needs room for 8 pairs"):
        MQARConfig(test_segments=[MQARSegment(16, 8, 4)]).validate(None, "data")
    with pytest.raises(ConfigError, match="data.test_segments: two segments share"):
        MQARConfig(test_segments=[MQARSegment(16, 2, 4), MQARSegment(16, 2, 8)]).validate(None, "data")
    with pytest.raises(ConfigError, match=r"data.train_segments\[0\].num_examples: must be positive"):
        MQARConfig(train_segments=[MQARSegment(16, 2, 0)]).validate(None, "data")
