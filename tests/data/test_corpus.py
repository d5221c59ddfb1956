"""The embedded standard-library corpus: split by path hash, byte tokens, cached memmaps, baselines."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from components.data.compressor_baselines import compressed_bits_per_byte
from components.data.corpus import SEPARATOR, CorpusConfig, StdlibCorpus
from components.data.stdlib_sources import is_validation, stdlib_root, stdlib_sources


@pytest.fixture(scope="module")
def corpus():
    return StdlibCorpus(CorpusConfig(seq_len=64, batch_size=4, val_tokens=4096), seed=3)


def test_split_depends_only_on_the_path():
    files = stdlib_sources(stdlib_root())
    val = [f for f in files if is_validation(f, 2.0)]
    assert 0 < len(val) < 0.05 * len(files)
    assert all(is_validation(f, 2.0) for f in val)  # pure function of the path
    assert "os.py" in files and not any("site-packages" in f for f in files)
    assert files == sorted(files)


def test_tokens_are_bytes_plus_separator(corpus):
    train = np.asarray(corpus.train[:200_000])
    assert train.max() <= SEPARATOR
    assert (corpus.train == SEPARATOR).sum() > 100  # one separator per file


def test_train_batches_are_deterministic_and_shifted(corpus):
    x1, y1 = corpus.train_batch(12)
    x2, y2 = corpus.train_batch(12)
    x3, _ = corpus.train_batch(13)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and not torch.equal(x1, x3)
    assert torch.equal(x1[:, 1:], y1[:, :-1])


def test_validation_windows_cover_the_split_in_order(corpus):
    xs = [corpus.val_batch(i)[0] for i in range(corpus.num_val_batches())]
    flat = torch.cat(xs).flatten()
    assert flat.numel() == corpus.num_val_windows * corpus.seq_len
    assert torch.equal(flat, torch.from_numpy(np.asarray(corpus.val[: flat.numel()]).astype(np.int64)))


def test_bits_per_byte_counts_only_byte_targets(corpus):
    targets = torch.tensor([[65, SEPARATOR, 66]])
    loss = torch.tensor([[1.0, 100.0, 3.0]])
    sums = corpus.metric_sums(None, targets, loss)
    metrics = corpus.finish_metrics({k: float(v) for k, v in sums.items()})
    assert metrics["bpb"] == pytest.approx(2.0 / np.log(2))


def test_baselines_compress_the_scored_bytes(corpus):
    base = corpus.baselines()
    assert set(base) == {"gzip-9", "xz-9e"}
    data = corpus.validation_bytes()
    assert len(data) > 3000
    assert base == pytest.approx(compressed_bits_per_byte(data))
    assert 0.5 < base["xz-9e"] < 8
