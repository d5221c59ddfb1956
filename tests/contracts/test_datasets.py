"""Every registered dataset (found through the registry): deterministic batches of the declared shape, a
metric contract that validation keeps, a tokenizer or the reason there is none, and a validation stream
or the reason there is none."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from components.data.base import NoTextTokenizer, NoValidationStream
from components.data.metrics import MetricContract
from components.data.text.tokenizers import TextTokenizer
from components.objective import token_losses
from components.registry import DATASETS
from tests.helpers import compose_root

NAMES = DATASETS.names()


def _memmap(tmp: Path) -> list[str]:
    path = tmp / "tokens.bin"
    (np.arange(50000) % 5000).astype(np.uint16).tofile(path)
    return [f"data.path={path}", "data.vocab_size=5000"]


def _mixture(tmp: Path) -> list[str]:
    from components.data.text.pipeline import PrepareOptions, prepare
    from tests.data.text_fixtures import write_text_folder

    for name in ("a", "b"):
        source = write_text_folder(tmp / f"src_{name}", n_files=12)
        prepare(PrepareOptions([str(source)], str(tmp / name), val_fraction=0.3, progress=False), log=lambda m: None)
    return [f"data.sources={{a: {{path: {tmp / 'a'}}}, b: {{path: {tmp / 'b'}, weight: 2}}}}"]


# datasets whose config names files that must exist: how a test makes them (the others build from defaults)
INPUTS = {"memmap": _memmap, "mixture": _mixture}


@pytest.fixture(params=NAMES)
def built(request, tmp_path):
    name = request.param
    extra = INPUTS[name](tmp_path) if name in INPUTS else []
    root = compose_root("model=tiny", f"data={name}", "data.seq_len=32", "data.batch_size=4", *extra)
    return root, DATASETS.build(root.data, root.seed)


def test_batches_are_deterministic_and_shaped(built):
    root, dataset = built
    x, y = dataset.train_batch(3)
    assert x.shape == y.shape == (root.data.batch_size, root.data.seq_len) and x.dtype == torch.int64
    assert int(x.max()) < root.model.vocab_size
    x2, y2 = dataset.train_batch(3)
    assert torch.equal(x, x2) and torch.equal(y, y2)


def test_validation_reports_what_the_metric_contract_names(built):
    root, dataset = built
    contract = dataset.metrics
    assert isinstance(contract, MetricContract) and contract.primary in contract.reports
    assert MetricContract.from_record(contract.record()) == contract
    torch.manual_seed(0)
    sums: dict[str, float] = {}
    for i in range(min(2, dataset.num_val_batches())):
        x, y = dataset.val_batch(i)
        logits = torch.randn(*y.shape, root.model.vocab_size)  # [B, T, V]
        for k, v in dataset.metric_sums(logits, y, token_losses(logits, y), i).items():
            sums[k] = sums.get(k, 0.0) + float(v)
    metrics = dataset.finish_metrics(sums)
    assert set(contract.reports) <= set(metrics), (contract.reports, sorted(metrics))
    assert all(math.isfinite(float(v)) for v in metrics.values())


def test_text_is_tokenized_or_the_reason_is_given(built):
    root, _ = built
    try:
        tokenizer = root.data.text_tokenizer()
    except NoTextTokenizer as err:
        assert str(err)
        return
    assert isinstance(tokenizer, TextTokenizer) and tokenizer.vocab_size <= root.model.vocab_size
    text = "def f(x):\n    return x + 1\n"
    assert tokenizer.decode(tokenizer.encode_batch([text])[0].tolist()) == text


def test_the_validation_stream_is_there_or_the_reason_is_given(built):
    root, dataset = built
    try:
        stream = dataset.validation_stream()
    except NoValidationStream as err:
        assert str(err)
        return
    assert stream.ndim == 1 and len(stream) > root.data.seq_len + 1
