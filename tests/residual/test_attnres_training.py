"""train.py with AttnRes on the corpus and on MQAR: depth weights reach the logs and render as a PNG."""

from __future__ import annotations

import json

import pytest

from analysis.depth_weights import main as plot_main
from runtime.jsonl_logger import read_metrics

DATA = {
    "corpus": ["data.seq_len=64", "data.batch_size=8", "data.val_tokens=2048"],
    "mqar": ["data.num_val_examples=64"],
}


# the default suite trains K3's block form; -m slow adds full AttnRes (whose sublayer reads the unit tests
# compare against the naive loop)
@pytest.mark.parametrize(
    "residual",
    [
        pytest.param(["residual=block_attnres", "residual.block_size=2"], id="block2"),
        pytest.param(["residual=full_attnres"], id="full", marks=pytest.mark.slow),
    ],
)
# the default suite trains on MQAR (whose accuracy the depth weights serve); -m slow adds the byte corpus
@pytest.mark.parametrize(
    "data", [pytest.param(d, marks=pytest.mark.slow) if d == "corpus" else d for d in sorted(DATA)]
)
def test_attnres_trains_and_logs_depth_weights(tmp_path, residual, data, train_run):
    result = train_run(
        *residual,
        f"data={data}",
        *DATA[data],
        "model=tiny",
        "model.n_layers=4",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "trainer.compile=false",
        "trainer.max_time_minutes=null",
        "trainer.enable_progress_bar=false",
        "trainer.log_every_n_steps=1",
        "logger=csv",
    )
    run_dir = result.run_dir
    history = json.loads((run_dir / "depth_weights.json").read_text())
    assert [e["step"] for e in history][-1] == 4 and len(history) >= 2
    rows = history[-1]["rows"]
    assert len(rows) == 2 * 4 + 1 and rows[-1]["sublayer"] == "final"
    for row in rows:
        assert sum(w for w in row["weights"] if w is not None) == pytest.approx(1.0, abs=1e-6)
    logged = [r for r in read_metrics(str(run_dir / "metrics.jsonl")) if any(k.startswith("depth/") for k in r)]
    assert logged and "depth/final/embedding" in logged[-1]
    out = tmp_path / "depth.png"
    assert plot_main([str(run_dir), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
