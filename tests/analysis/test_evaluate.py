"""analysis.evaluate --lengths: at the training length it reproduces the run's own validation loss; longer
lengths are scored by position bucket; results land in the run folder; bad input is refused by name."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.compare import compare
from analysis.evaluate import main, position_buckets

RUN = [
    "model=tiny",
    "mixer=gqa",
    "data=corpus",
    "data.seq_len=32",
    "data.batch_size=8",
    "data.val_tokens=512",
    "trainer.max_steps=3",
    "trainer.val_check_interval=100",
    "trainer.enable_progress_bar=false",
    "trainer.max_time_minutes=null",
    "trainer.compile=false",
]


@pytest.fixture(scope="module")
def trained(trained_run):
    return trained_run(*RUN, "logger=wandb").run_dir  # W&B offline (tests/conftest.py)


def test_lengths_reproduce_the_validation_loss_and_split_it_by_position(trained, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert main([str(trained), "--lengths", "1x,4x,2x", "--tokens", "512"]) == 0
    record = json.loads((trained / "eval" / "lengths.json").read_text())
    assert (trained / "eval" / "lengths.png").is_file()
    assert [r["length"] for r in record["results"]] == [32, 64, 128] and record["train_length"] == 32
    one = record["results"][0]
    summary = json.loads((trained / "summary.json").read_text())
    # 1x scores the same 16 windows of 32 tokens as the run's own validation
    assert one["windows"] == 16 and one["loss"] == pytest.approx(summary["val"]["loss"], rel=1e-5)
    assert one["bpb"] == pytest.approx(summary["val"]["bpb"], rel=1e-5)
    for r in record["results"]:  # the buckets partition the scored tokens
        assert sum(b["tokens"] for b in r["buckets"]) == r["windows"] * r["length"]
        weighted = sum(b["loss"] * b["tokens"] for b in r["buckets"] if b["tokens"]) / (r["windows"] * r["length"])
        assert weighted == pytest.approx(r["loss"], rel=1e-6)
    assert [(b["from"], b["to"]) for b in record["results"][2]["buckets"]] == [
        (0, 8),
        (8, 16),
        (16, 32),
        (32, 64),
        (64, 128),
    ]
    assert "by position" in capsys.readouterr().out

    # into the run's W&B run: a new offline segment of the same id (wandb sync merges them)
    wandb_id = json.loads((trained / "run.json").read_text())["wandb_id"]
    segments = sorted((trained / "wandb").glob(f"offline-run-*-{wandb_id}"))
    assert len(segments) == 2
    cli = str(Path(sys.executable).with_name("wandb"))
    inspected = subprocess.run(
        [cli, "leet", "inspect", "--summary", "--json", str(segments[-1])],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(inspected.stdout)["summary"]["eval/length_128/loss"] == pytest.approx(
        record["results"][2]["loss"]
    )

    # and beside the training metrics in analysis.compare
    out = compare([str(trained)], str(trained.parent / "cmp"))
    assert any(p.endswith("eval_lengths.png") for p in out["images"])
    header = (trained.parent / "cmp" / "eval.csv").read_text().splitlines()[0]
    assert header.startswith("run,length_32/loss,length_32/bpb,length_64/loss")


def test_position_buckets_double_beyond_the_training_length():
    assert position_buckets(256, 256) == [(0, 64), (64, 128), (128, 256)]
    assert position_buckets(256, 2048) == [(0, 64), (64, 128), (128, 256), (256, 512), (512, 1024), (1024, 2048)]
    assert position_buckets(256, 300) == [(0, 64), (64, 128), (128, 256), (256, 300)]


def test_what_cannot_be_evaluated_is_refused_by_name(trained, tmp_path, capsys, monkeypatch):
    assert main([str(tmp_path / "missing"), "--lengths", "2x"]) == 2
    assert "no such run folder" in capsys.readouterr().err
    broken = tmp_path / "broken"
    shutil.copytree(trained, broken)
    for ckpt in (broken / "checkpoints").glob("*.ckpt"):
        ckpt.write_bytes(b"not a checkpoint")
    assert main([str(broken), "--lengths", "2x"]) == 2
    assert "none of its" in capsys.readouterr().err
    assert main([str(trained), "--lengths", "2y"]) == 2
    assert "'2y' is neither a positive multiple" in capsys.readouterr().err
    assert main([str(trained), "--lengths", "100000000"]) == 2
    assert "longer than the validation split" in capsys.readouterr().err
    from components.mixers.base import Mixer

    monkeypatch.setattr(Mixer, "max_seq_len", lambda self: 48)  # a mixer with a bounded context
    assert main([str(trained), "--lengths", "1x,2x"]) == 2
    assert "64 tokens is beyond what layer 0's mixer (gqa) supports: at most 48" in capsys.readouterr().err


def test_with_document_masking_the_position_is_the_one_within_the_document():
    import torch

    from analysis.evaluate import positions_in_context

    x = torch.tensor([[5, 0, 3, 4, 0, 7], [1, 2, 3, 4, 5, 6]])
    assert positions_in_context(x, eod_id=0).tolist() == [
        [0, 0, 1, 2, 0, 1],
        [0, 1, 2, 3, 4, 5],
    ]  # eod begins a document
    assert positions_in_context(x, eod_id=None).tolist() == [list(range(6))] * 2
