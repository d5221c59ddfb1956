"""What ``init_from`` names is verified completely before a run folder exists: a truncated or corrupt
checkpoint, a checkpoint whose weights do not fit the composed model, an exported folder whose data is cut
short behind an intact header -- each named, exit status 2, no traceback, no run folder."""

from __future__ import annotations

import shutil

import pytest
import torch

from analysis.export import main as export_main
from components.hf.safetensors_files import SINGLE
from components.model import Decoder
from components.registry import ConfigError
from runtime.train_command import EXIT_CONFIG_ERROR, main
from tests.helpers import compose_root, save_run, tree_hash

MODEL = ["model=tiny", "data=corpus", "data.seq_len=32", "data.batch_size=4", "data.val_tokens=256"]
TRAIN = [
    *MODEL,
    "trainer.max_steps=1",
    "trainer.enable_progress_bar=false",
    "trainer.compile=false",
    "trainer.max_time_minutes=null",
    "logger=csv",
]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A run folder with a checkpoint at step 2 (and last.ckpt), and the folder analysis.export wrote from it."""
    folder = tmp_path_factory.mktemp("source")
    root = compose_root(*MODEL)
    torch.manual_seed(0)
    run = save_run(root, Decoder(root.decoder_config()), folder / "run")
    shutil.copy(run / "checkpoints" / "last.ckpt", run / "checkpoints" / "step=2.ckpt")
    assert export_main([str(run), str(folder / "export")]) == 0
    return run, folder / "export"


def _cut(path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: keep if keep > 0 else len(data) + keep])


def test_an_intact_checkpoint_is_accepted(source):
    run, _ = source
    compose_root(*MODEL, f"init_from={run / 'checkpoints' / 'last.ckpt'}")
    compose_root(*MODEL, f"init_from={run}", "init_step=2")


@pytest.mark.parametrize("keep", [100, -100, -5000], ids=["head-only", "tail-cut", "data-cut"])
def test_a_truncated_checkpoint_is_named(source, tmp_path, keep):
    run, _ = source
    ckpt = tmp_path / "model.ckpt"
    shutil.copy(run / "checkpoints" / "last.ckpt", ckpt)
    _cut(ckpt, keep)
    with pytest.raises(ConfigError, match=rf"init_from: checkpoint {ckpt} is unreadable \(truncated or corrupt\)"):
        compose_root(*MODEL, f"init_from={ckpt}")


def test_a_corrupt_checkpoint_of_a_run_folder_is_named_on_init_step(source, tmp_path):
    run, _ = source
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    step = copy / "checkpoints" / "step=2.ckpt"
    data = bytearray(step.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)  # zeros over the middle: tensor data and CRCs disagree
    step.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=rf"init_step: checkpoint {step} is unreadable"):
        compose_root(*MODEL, f"init_from={copy}", "init_step=2")


def test_a_checkpoint_that_does_not_fit_the_composed_model_is_named(source):
    run, _ = source
    ckpt = run / "checkpoints" / "last.ckpt"
    with pytest.raises(ConfigError, match=r"init_from: .*last.ckpt: embed.weight has shape \[257, 64\], the composed"):
        compose_root(*MODEL, "model.d_model=96", f"init_from={ckpt}")
    with pytest.raises(ConfigError, match=r"init_from: .*last.ckpt has no mtp\.0\..* \(a tensor of the composed model"):
        compose_root(*MODEL, "model.mtp_depth=1", f"init_from={ckpt}")


def _refused_by_train(tmp_path, init_from, message, capsys):
    """train.py's command line (in this process) exits with status 2 and one message, writing nothing."""
    out = tmp_path / "runs"
    before = tree_hash(tmp_path)
    capsys.readouterr()
    assert main([*TRAIN, f"init_from={init_from}", f"output_root={out}"]) == EXIT_CONFIG_ERROR
    stderr = capsys.readouterr().err
    assert message in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.count("\n") == 1, stderr  # one message
    assert not out.exists() and tree_hash(tmp_path) == before  # no run folder, nothing touched


def test_train_refuses_a_truncated_checkpoint_before_making_a_run_folder(source, tmp_path, capsys):
    run, _ = source
    ckpt = tmp_path / "model.ckpt"
    shutil.copy(run / "checkpoints" / "last.ckpt", ckpt)
    _cut(ckpt, -100)
    _refused_by_train(
        tmp_path, ckpt, f"error: init_from: checkpoint {ckpt} is unreadable (truncated or corrupt)", capsys
    )


def test_train_refuses_an_export_cut_short_behind_its_header_before_making_a_run_folder(source, tmp_path, capsys):
    _, export = source
    copy = tmp_path / "export"
    shutil.copytree(export, copy)
    _cut(copy / SINGLE, -100)
    _refused_by_train(tmp_path, copy, f"error: init_from: {copy / SINGLE}: the header describes", capsys)
