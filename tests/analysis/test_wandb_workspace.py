"""``python -m analysis.compare SWEEP --wandb-workspace FILE``: the study's W&B workspace, checked offline as
the saved-view definition the wandb-workspaces package would send (skipped where the package is absent)."""

from __future__ import annotations

import json

import pytest

from analysis.compare import main
from analysis.wandb_workspace import group_keys

pytest.importorskip("wandb_workspaces")


def _sweep(tmp_path, varied: list[dict[str, str]]):
    sweep = tmp_path / "study-1"
    sweep.mkdir()
    for job, point in enumerate(varied):
        run_dir = sweep / str(job)
        run_dir.mkdir()
        (run_dir / "summary.json").write_text(
            json.dumps({"name": f"run{job}", "steps": 4, "params": 5, "active_params": 5, "val": {"loss": 2.0}})
        )
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": 3.0}) + "\n")
        with open(sweep / "index.jsonl", "a") as f:
            line = {"job": job, "run_dir": str(run_dir), "status": "finished", "overrides": [], "varied": point}
            f.write(json.dumps(line) + "\n")
    return sweep


def _panels(spec: dict) -> dict[str, dict]:
    sections = spec["spec"]["section"]["panelBankConfig"]["sections"]
    return {p["config"]["chartTitle"]: p["config"] | {"section": s["name"]} for s in sections for p in s["panels"]}


def test_study_workspace_definition(tmp_path, capsys):
    sweep = _sweep(tmp_path, [{"point": "kda", "seed": "0"}, {"point": "kda", "seed": "1"}, {"point": "mla"}])
    path = tmp_path / "view.json"
    assert main([str(sweep), "--out", str(tmp_path / "cmp"), "--wandb-workspace", str(path)]) == 0
    spec = json.loads(path.read_text())
    assert spec["project"] == "k3-sandbox" and spec["displayName"] == "study study-1"
    panels = _panels(spec)
    # loss and bits per byte against tokens and FLOPs, grouped by the study's point (seeds pooled)
    for metric in ("val/loss", "val/bpb"):
        for axis in ("perf/tokens", "perf/flops"):
            config = next(c for c in panels.values() if c["metrics"] == [metric] and c["xAxis"] == axis)
            assert config["groupBy"] == "sweep.value.point" and config["xLogScale"]
    assert panels["MaxVio per layer"]["metricRegex"] == "balance/maxvio/layer_.*"
    assert panels["MaxVio per layer"]["section"] == "MoE balance"
    assert panels["largest glu_max"]["metrics"] == ["act/glu_max"]
    (runset,) = spec["spec"]["section"]["runSets"]
    assert runset["grouping"] == [{"section": "config", "name": "sweep.value.point"}]
    assert runset["filters"]["filters"][0]["key"] == {"section": "config", "name": "sweep.group"}
    assert runset["filters"]["filters"][0]["value"] == "sweep-study-1"
    assert str(path) in capsys.readouterr().out


def test_save_needs_credentials_and_the_definition_stays(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    sweep = _sweep(tmp_path, [{"optimizer.lr": "0.1"}, {"optimizer.lr": "0.2"}])
    path = tmp_path / "view.json"
    args = [str(sweep), "--out", str(tmp_path / "cmp"), "--wandb-workspace", str(path), "--save-workspace"]
    assert main(args) == 0
    assert "W&B workspace not saved: no W&B credentials" in capsys.readouterr().out
    (runset,) = json.loads(path.read_text())["spec"]["section"]["runSets"]
    assert runset["grouping"] == [{"section": "config", "name": "optimizer.value.lr"}]  # a varied config path


def test_group_keys():
    assert group_keys(["point", "seed"]) == ["sweep.point"]
    assert group_keys(["optimizer.lr", "seed"]) == ["optimizer.lr"]
