"""Prepared text in training: meta.json drives the config, bits per byte for any tokenizer, mixtures
(deterministic sampling, per-source metrics, exact resume), and folders whose files contradict meta.json."""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from components.data.mixture import Mixture
from components.data.text.pipeline import PrepareOptions, prepare
from components.data.text.prepared import PreparedFolder
from components.data.text.stream import PreparedStream
from components.registry import DATASETS, ConfigError
from runtime.jsonl_logger import read_metrics
from tests.data.text_fixtures import write_text_folder
from tests.helpers import (
    FAST,
    compose_root,
    kill_after_microbatch,
    losses_by_step,
    only_run_dir,
    start_train,
    train_command_in_process,
)

SHORT_WINDOWS = [*FAST, "data.seq_len=32", "data.val_tokens=512"]  # later overrides win


def _prep(inputs, out, tokenizer):
    return prepare(
        PrepareOptions(
            inputs=[str(i) for i in inputs], out=str(out), tokenizer=tokenizer, val_fraction=0.25, progress=False
        ),
        log=lambda m: None,
    ).folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    a = _prep([write_text_folder(root / "src_a", n_files=40, seed=1)], root / "a", "bpe:320")
    b = _prep([write_text_folder(root / "src_b", n_files=40, seed=2, words=200)], root / "b", str(a / "tokenizer.json"))
    c = _prep([root / "src_b"], root / "c", "bytes")
    return {"a": a, "b": b, "c": c, "root": root}


def test_prepared_folder_sets_vocabulary_and_dtype(folders):
    root = compose_root("data=memmap", f"data.path={folders['a']}")
    meta = json.loads((folders["a"] / "meta.json").read_text())
    assert root.data.vocab_size == root.model.vocab_size == meta["vocab_size"] == 320
    assert root.data.dtype == "uint16"
    padded = compose_root(
        "data=memmap", f"data.path={folders['a']}", "data.vocab_size=384"
    )  # padding the table is fine
    assert padded.model.vocab_size == 384
    with pytest.raises(ConfigError, match=r"data.vocab_size.*below the 320 ids"):
        compose_root("data=memmap", f"data.path={folders['a']}", "data.vocab_size=300")
    with pytest.raises(ConfigError, match=r"data.dtype.*contradicts .*meta.json"):
        compose_root("data=memmap", f"data.path={folders['a']}", "data.dtype=uint32")


def test_bits_per_byte_is_summed_loss_over_the_targets_utf8_bytes(folders):
    folder = PreparedFolder.open(folders["a"])
    data = PreparedStream(folder, seq_len=32, batch_size=4, val_tokens=None, seed=0)
    x, y = data.val_batch(0)
    loss = torch.rand(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    sums = data.metric_sums(None, y, loss)
    text = folder.tokenizer.decode(y.flatten().tolist())
    assert float(sums["bytes"]) == len(text.encode("utf-8"))  # end-of-document tokens stand for no bytes
    bpb = data.finish_metrics({k: float(v) for k, v in sums.items()})["bpb"]
    assert bpb == pytest.approx(float(loss.sum()) / math.log(2) / len(text.encode("utf-8")), rel=1e-12)
    # the bytes validation scores are the bytes the compressors baselines see
    all_bytes = sum(
        float(data.metric_sums(None, yy, torch.zeros_like(yy, dtype=torch.float64))["bytes"])
        for _, yy in data.val_batches()
    )
    assert all_bytes == len(data.validation_bytes()) > 0


def test_mixture_batches_are_a_function_of_seed_and_index(folders):
    cfg = compose_root(
        "data=mixture",
        f"data.sources={{a: {{path: {folders['a']}, weight: 3}}, b: {{path: {folders['b']}, weight: 1}}}}",
        "data.seq_len=16",
        "data.batch_size=64",
    ).data
    m1, m2 = DATASETS.build(cfg, 5), DATASETS.build(cfg, 5)
    assert isinstance(m1, Mixture) and m1.vocab_size == 320
    for i in (0, 7, 123):
        assert all(torch.equal(u, v) for u, v in zip(m1.train_batch(i), m2.train_batch(i)))
    assert not torch.equal(m1.train_batch(1)[0], m1.train_batch(2)[0])
    # rows follow the weights: count the rows that come from source a's training stream
    a_train = np.asarray(m1.streams[0].train)
    windows = {bytes(a_train[s : s + 16].astype(np.uint16)) for s in range(len(a_train) - 16)}
    rows = torch.cat([m1.train_batch(i)[0] for i in range(20)])
    share = np.mean([bytes(r.numpy().astype(np.uint16)) in windows for r in rows])
    assert 0.68 < share < 0.82  # 3:1 weights


def test_mixture_sources_must_share_a_tokenizer(folders):
    with pytest.raises(ConfigError, match=r"data.sources.c.path.*mixed sources must share one tokenizer"):
        compose_root("data=mixture", f"data.sources={{a: {{path: {folders['a']}}}, c: {{path: {folders['c']}}}}}")
    with pytest.raises(ConfigError, match=r"data.sources.x.path.*not a folder made by prepare.py"):
        compose_root("data=mixture", f"data.sources={{x: {{path: {folders['root']}}}}}")


def test_folder_whose_tokenizer_is_not_the_one_meta_names_is_refused(folders, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(folders["b"], bad)
    other = prepare(
        PrepareOptions(
            inputs=[str(folders["root"] / "src_a")],
            out=str(tmp_path / "other"),
            tokenizer="bpe:300",
            val_fraction=0.25,
            progress=False,
        ),
        log=lambda m: None,
    ).folder
    shutil.copy(other / "tokenizer.json", bad / "tokenizer.json")
    status = train_command_in_process(  # train.py's command line
        *SHORT_WINDOWS,
        "data=memmap",
        f"data.path={bad}",
        "trainer.max_steps=2",
        f"output_root={tmp_path / 'runs'}",
        "logger=csv",
    )
    assert status == 2
    stderr = capsys.readouterr().err
    assert "data.path" in stderr and "is not the one meta.json says the tokens were made with" in stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_mixture_resumes_exactly_and_logs_per_source_metrics(folders, tmp_path, train_run):
    """A mixture run killed mid-run (train.py in a process of its own) and resumed logs the uninterrupted run's
    losses; validation reports loss and bits per byte per source and overall, in metrics.jsonl and in the W&B
    run. The uninterrupted and the resumed run train in this process, on the killed process's one thread."""
    sources = f"data.sources={{a: {{path: {folders['a']}, weight: 2}}, b: {{path: {folders['b']}, weight: 1}}}}"
    common = [
        *SHORT_WINDOWS,
        "data=mixture",
        sources,
        "trainer.max_steps=10",
        "trainer.checkpoint_every_n_steps=4",
        "trainer.val_check_interval=5",
    ]
    env = {"OMP_NUM_THREADS": "1"}  # CPU kernels split their sums by thread: every run here on one
    killing = start_train(*common, "logger=csv", f"output_root={tmp_path / 'b'}", kill_after_microbatch(6), env=env)
    train_run(*common, "logger=wandb", f"output_root={tmp_path / 'a'}", threads=1)  # W&B offline (tests/conftest.py)
    killed = killing.wait(timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    train_run(*common, "logger=csv", f"output_root={tmp_path / 'b'}", "ckpt_path=last", threads=1)
    reference_dir, run_dir = only_run_dir(tmp_path / "a"), only_run_dir(tmp_path / "b")
    reference, losses = losses_by_step(reference_dir), losses_by_step(run_dir)
    assert sorted(losses) == sorted(reference) == list(range(10))
    assert all(losses[s] == reference[s] for s in range(4, 10))

    records = read_metrics(str(reference_dir / "metrics.jsonl"))
    val = [r for r in records if "val/bpb" in r]
    assert len(val) >= 2  # every val_check_interval, and once at the end
    for r in val:
        assert {"val/a/bpb", "val/b/bpb", "val/a/loss", "val/b/loss"} <= set(r)
        lo, hi = sorted([r["val/a/bpb"], r["val/b/bpb"]])
        assert lo <= r["val/bpb"] <= hi  # the overall figure pools the two sources
    wandb_cli = str(Path(sys.executable).with_name("wandb"))
    (wandb_run,) = list((reference_dir / "wandb").glob("offline-run-*"))
    summary = subprocess.run(
        [wandb_cli, "leet", "inspect", "--summary", "--json", str(wandb_run)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert summary.returncode == 0, summary.stderr
    logged = json.loads(summary.stdout)["summary"]
    assert logged["val/a/bpb"] == pytest.approx(val[-1]["val/a/bpb"], rel=1e-6) and logged[
        "val/b/bpb"
    ] == pytest.approx(val[-1]["val/b/bpb"], rel=1e-6)


@pytest.mark.parametrize("mixer", ["gqa", "kda"])
def test_document_masking_reaches_the_model_in_training(mixer):
    """data.document_masking=true: the training module's hidden states after an end-of-document token do
    not depend on anything before it; without masking they do."""
    from runtime.lit_module import LanguageModelModule

    def hidden(masking: bool, x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(0)
        root = compose_root(
            "model=tiny",
            f"mixer={mixer}",
            "data=corpus",
            "data.seq_len=48",
            "data.batch_size=2",
            f"data.document_masking={str(masking).lower()}",
            "trainer.compile=false",
        )
        module = LanguageModelModule(root, DATASETS.build(root.data, root.seed))
        with torch.no_grad():
            return module._hidden_states(x, module._segments(x))

    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (2, 48), generator=g)
    x[:, 20] = 256  # the separator: the next document starts here
    other = x.clone()
    other[:, :20] = torch.randint(0, 256, (2, 20), generator=g)
    torch.testing.assert_close(hidden(True, x)[:, 20:], hidden(True, other)[:, 20:], rtol=0, atol=1e-5)
    assert not torch.allclose(hidden(False, x)[:, 20:], hidden(False, other)[:, 20:], atol=1e-3)
