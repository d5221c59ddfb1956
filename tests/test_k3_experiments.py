"""K3 experiment overlays: k3_small keeps every K3 decision, each ablation flips exactly one, k3_tiny trains."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from runtime.compose import compose, strip_hydra
from runtime.jsonl_logger import read_metrics
from sweeps.ladder import stability_metrics
from tests.helpers import compose_root


def flat(experiment: str) -> dict:
    cfg = OmegaConf.to_container(strip_hydra(compose([f"experiment={experiment}"])), resolve=True)

    def walk(node, prefix=""):
        if isinstance(node, dict):
            for k, v in node.items():
                yield from walk(v, f"{prefix}{k}.")
        else:
            yield prefix[:-1], node

    return dict(walk(cfg))


def test_k3_small_keeps_the_k3_decisions():
    root = compose_root("experiment=k3_small")
    assert (root.mixer.name, root.mixers["mla"].name, root.ffn.name, root.ffns["dense"].name) == (
        "kda",
        "mla",
        "stable_latent_moe",
        "dense",
    )
    assert (root.balancer.name, root.residual.name, root.optimizer.name, root.optimizer.per_head) == (
        "qb",
        "block_attnres",
        "muon",
        True,
    )
    assert root.mixers["mla"].rope is False and root.mixers["mla"].output_gate and root.mixers["mla"].q_lora_rank
    assert root.ffn.activation == root.ffns["dense"].activation == "situ_glu"
    assert not root.model.tie_embeddings
    assert root.model.mtp_depth == 1 and root.optimizer.per_head_scope == "qkv"


ABLATIONS = {
    "k3_small_swiglu": {"ffn.activation": "swiglu", "ffns.dense.activation": "swiglu"},
    "k3_small_signsgd": {"balancer.name": "signsgd"},
    "k3_small_plain_residual": {"residual.name": "plain"},
    "k3_small_rope": {"mixers.mla.rope": True},
    "k3_small_no_latent_norm": {"ffn.name": "latent_moe"},
    "k3_small_all_mla": {"model.mixer_plan.repeat": ["mla"], "model.mixer_plan.at": {}},
    "k3_small_no_mtp": {"model.mtp_depth": 0},
}
# fields that belong to the swapped component (they disappear or appear with it) or to the run's name
INCIDENTAL = ("name", "balancer.", "residual.")


@pytest.mark.parametrize("ablation", sorted(ABLATIONS))
def test_each_ablation_flips_one_decision(ablation):
    base, new = flat("k3_small"), flat(ablation)
    changed = {k for k in base.keys() | new.keys() if base.get(k, "<absent>") != new.get(k, "<absent>")}
    expected = ABLATIONS[ablation]
    for key, value in expected.items():
        assert new.get(key, "<absent>") == value or (value == {} and key not in new), (key, new.get(key))
    unexpected = {
        k
        for k in changed
        if k not in expected and not k.startswith(INCIDENTAL) and not k.startswith("model.mixer_plan.")
    }
    assert not unexpected, unexpected
    compose_root(f"experiment={ablation}")  # validates


def test_k3_tiny_trains_with_maxvio_and_depth_weights(train_run):
    result = train_run(
        "experiment=k3_tiny",
        "data.seq_len=64",
        "data.batch_size=8",
        "data.val_tokens=2048",
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "trainer.compile=false",
        "trainer.max_time_minutes=null",
        "trainer.enable_progress_bar=false",
        "trainer.log_every_n_steps=1",
        "logger=csv",
    )
    run_dir = result.run_dir
    rows = read_metrics(str(run_dir / "metrics.jsonl"))
    assert sum("balance/maxvio/mean" in r for r in rows) == 6
    # the ladder's stability columns read this run's metrics as logged (a key the ladder guessed wrong
    # once left its maxvio column empty)
    columns = stability_metrics(str(run_dir))
    assert isinstance(columns["maxvio"], float) and isinstance(columns["max_activation"], float), columns
    assert any(k.startswith("depth/") for r in rows for k in r)
    assert json.loads((run_dir / "depth_weights.json").read_text())[-1]["step"] == 6


@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["k3_small", *sorted(ABLATIONS)])
def test_k3_small_and_each_ablation_train(experiment, train_run):
    result = train_run(
        f"experiment={experiment}",
        "data.seq_len=64",
        "data.batch_size=4",
        "data.val_tokens=1024",
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
        "trainer.max_time_minutes=null",
        "trainer.enable_progress_bar=false",
        "logger=csv",
    )
    run_dir = result.run_dir
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["val"]["loss"] < 10
