"""analysis.export killed (SIGKILL) right before one of its writes -- the staging folder, a shard, the
index, config.json, the rename into place -- leaves nothing at OUT (or the empty folder that was there);
the next export clears what the killed one left beside OUT and writes the same folder."""

from __future__ import annotations

import pytest
import torch

from components.model import Decoder
from tests.helpers import compose_root, run_killed_at_write, save_run, tree_hash

SHARDED = ["--max-shard-gb", "0.0001"]  # about 100 KiB: the tiny model in five shards and an index


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = compose_root("model=tiny", "data=corpus")
    torch.manual_seed(0)
    return save_run(root, Decoder(root.decoder_config()), tmp_path_factory.mktemp("export-kill") / "run")


def test_an_export_killed_at_any_point_leaves_nothing_at_out(run, tmp_path):
    reference, work = tmp_path / "reference", tmp_path / "work"
    reference.mkdir()
    work.mkdir()
    proc, writes = run_killed_at_write("analysis.export", [run, reference / "model", *SHARDED], reference, 0)
    assert proc.returncode == 0 and "model.safetensors.index.json" in proc.stdout, proc.stderr[-2000:]
    assert writes >= 8
    for n in sorted({1, 2, 3, writes // 2, writes - 1, writes}):  # writes: the rename into place
        proc, _ = run_killed_at_write("analysis.export", [run, work / "model", *SHARDED], work, n)
        assert proc.returncode == -9, (n, proc.stderr[-2000:])
        assert not (work / "model").exists(), n
        assert all(p.name.startswith(".model.tmp-") for p in work.iterdir()), n  # a hidden staging folder at most
    (work / "model").mkdir()  # an empty OUT is taken over, and stays as it was when the export is killed
    empty = tree_hash(work / "model")
    proc, _ = run_killed_at_write("analysis.export", [run, work / "model", *SHARDED], work, writes)
    assert proc.returncode == -9 and (work / "model").is_dir() and tree_hash(work / "model") == empty
    proc, _ = run_killed_at_write("analysis.export", [run, work / "model", *SHARDED], work, 0)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [p.name for p in work.iterdir()] == ["model"]  # every killed export's staging folder cleared
    assert tree_hash(work / "model") == tree_hash(reference / "model")
