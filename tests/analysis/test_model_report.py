"""analysis.model_report: the published K3 numbers from a meta-device build, and any small config."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from analysis.model_report import main, report
from tests.helpers import REPO, build_model


@pytest.fixture(scope="module")
def k3():
    out = subprocess.run(
        [sys.executable, "-m", "analysis.model_report", "experiment=k3_full", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": ""},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_k3_counts(k3):
    assert k3["total_params"] == 2_779_484_476_000
    assert k3["active_params"] == 105_364_017_760
    assert k3["active_params_without_embedding"] == 104_189_612_640
    s = k3["schedule"]
    assert s["mixer_counts"] == {"kda": 69, "mla": 24} and s["ffn_counts"] == {"dense": 1, "stable_latent_moe": 92}
    # MLA at layers 4, 8, ..., 92 and 93 (1-indexed); dense FFN in layer 1
    assert [i + 1 for i in s["mixer_layers"]["mla"]] == list(range(4, 93, 4)) + [93]
    assert s["ffn_layers"]["dense"] == [0]
    assert k3["attnres"]["final_read_sources"] == 9


def test_k3_seed_figures(k3):
    lb = k3["latent_moe"]
    assert lb["latent_projection_params"] == 51_380_224
    assert round(100 * lb["latent_projection_share"], 1) == 9.7
    fw = lb["full_width_equivalent"]
    assert (fw["experts"], fw["top_k"], fw["same_budget"]) == (448, 8, True)
    c = k3["cache"]
    assert c["all_mla_crossover_tokens"] == {"state_2B": 2731, "state_4B": 5461}
    assert c["mla_macs_per_layer"]["mla"] == {
        "prefill_macs_per_cached_position": 30_720,
        "decode_macs_per_cached_position": 104_448,
    }


def test_small_config_report_matches_the_built_model():
    r = report(["model=tiny", "ffn=moe", "ffn.num_experts=8", "ffn.top_k=2"])
    model = build_model("model=tiny", "ffn=moe", "ffn.num_experts=8", "ffn.top_k=2")
    buffers = sum(layer.ffn.gate.e_score_correction_bias.numel() for layer in model.layers)
    assert r["total_params"] == model.num_params() + buffers
    unchosen = sum((8 - 2) * layer.ffn.experts.expert_params() for layer in model.layers)
    assert r["active_params"] == r["total_params"] - unchosen
    assert r["active_params_without_embedding"] == r["active_params"] - model.embed.weight.numel()
    assert sum(r["params_by_kind"].values()) == r["total_params"]
    assert r["attnres"] is None and r["latent_moe"] is None


def test_bad_override_is_one_clear_error(capsys):
    assert main(["mixer=nope"]) == 2
    assert "mixer" in capsys.readouterr().err
