"""W&B offline runs of train.py read back with wandb's own reader (``wandb leet inspect``, through
runtime/wandb_offline.py): the compute in the summary and on the history's axis, validation at the step it
was computed, the run's identity, and nothing W&B refuses ending a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.jsonl_logger import read_metrics
from runtime.wandb_offline import read_folder, segments
from tests.helpers import FAST, only_run_dir, run_train

LONG_TAG = "t" * 200


@pytest.mark.slow
def test_offline_run_carries_compute_identity_and_validation_at_its_step(tmp_path):
    result = run_train(
        *FAST,
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "trainer.log_every_n_steps=2",
        "logger=wandb",
        f"logger.tags=[{LONG_TAG}]",
        f"output_root={tmp_path}",
        env={"WANDB_MODE": "offline"},
    )
    assert result.returncode == 0, result.stderr[-3000:]  # a 200-character tag does not end the run
    run_dir = only_run_dir(tmp_path)
    local = json.loads((run_dir / "summary.json").read_text())
    (folder,) = segments(run_dir / "wandb")
    run = read_folder(folder)

    # the whole summary.json record in the W&B summary; the best validation loss beside the last
    assert run.summary["compute"]["train_flops"] == local["compute"]["train_flops"] > 0
    assert run.summary["baselines"] == local["baselines"] and set(local["baselines"]) == {"gzip-9", "xz-9e"}
    assert run.summary["ended_by"] == "budget" and run.summary["precision"] == local["precision"]
    assert run.summary["metric"] == local["metric"]
    assert run.summary["val/loss"]["last"] == pytest.approx(local["val"]["loss"])
    assert run.summary["val/loss"]["min"] <= run.summary["val/loss"]["last"]

    # a cumulative FLOPs axis: tokens trained before each row's measurement, from step 0
    tokens_per_step = 8 * 64
    flops_per_token = local["compute"]["flops_per_token"]
    assert all("perf/flops" in r and "perf/tokens" in r for r in run.history)
    for r in run.history:
        assert r["perf/tokens"] == tokens_per_step * r["step"]
        assert r["perf/flops"] == pytest.approx(r["perf/tokens"] * flops_per_token, rel=1e-6)
    flops = [r["perf/flops"] for r in run.history]
    assert flops == sorted(flops) and flops[-1] == pytest.approx(local["compute"]["train_flops"], rel=1e-6)

    # validation at the step it was computed, once (the final validation at step 6 is the same record)
    assert [r["step"] for r in run.history if "val/loss" in r] == [3, 6]
    # training rows every second step, their throughput over the two steps since the last row
    assert [r["step"] for r in run.history if "train/loss" in r] == [1, 3, 5]
    assert run.history == read_metrics(str(run_dir / "metrics.jsonl"))

    # identity: name, group and job type; config fields to filter on; the tag fitted, its full value kept
    fields = run.config["run"]
    assert run.job_type == "train" and run.name.endswith(fields["config_hash"]) and run.group == fields["group"]
    # the overrides it was given, shortened readably (where it writes, logs or how often: left out)
    label = "model=tiny seq_len=64 batch_size=8 val_tokens=2048 compile=false max_time_minutes=null max_steps=6"
    assert run.name.startswith(label) and run.group.startswith(label) and "output_root" not in run.name
    assert Path(fields["run_dir"]).resolve() == run_dir.resolve() and fields["layer_plan"] == "GG"
    (cut,) = [t for t in run.tags if t.startswith("ttt")]
    assert len(cut) == 64 and fields["tags_cut"] == {cut: LONG_TAG}


@pytest.mark.slow
def test_wandb_that_cannot_start_leaves_the_run_to_finish(tmp_path):
    # an id W&B refuses: wandb.init fails before the run starts
    result = run_train(
        *FAST,
        "trainer.max_steps=2",
        "logger=wandb",
        f"output_root={tmp_path}",
        env={"WANDB_MODE": "offline", "WANDB_RUN_ID": "planted/failure"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warning: W&B could not start (UsageError" in result.stdout
    run_dir = only_run_dir(tmp_path)
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    assert "wandb_id" not in json.loads((run_dir / "run.json").read_text())
    assert any("train/loss" in r for r in read_metrics(str(run_dir / "metrics.jsonl")))


@pytest.mark.slow
def test_layer_plan_sweep_with_long_values_runs(tmp_path):
    repeat = "model.mixer_plan.repeat=[mixer,mixer,mixer,mixer,mixer,mixer,mixer,mla],[mixer,mla]"
    result = run_train(
        "-m",
        repeat,
        "experiment=k3_tiny",
        "logger=wandb",
        "data.seq_len=64",
        "data.batch_size=4",
        "data.val_tokens=1024",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "trainer.enable_progress_bar=false",
        "trainer.compile=false",
        "trainer.max_time_minutes=null",
        f"output_root={tmp_path}",
        env={"WANDB_MODE": "offline"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (sweep_dir,) = list((tmp_path / "sweeps").iterdir())
    runs = [read_folder(segments(job / "wandb")[0]) for job in sorted(p for p in sweep_dir.iterdir() if p.is_dir())]
    assert [r.exit_code for r in runs] == [0, 0]
    assert {r.group for r in runs} == {f"sweep-{sweep_dir.name}"} and {r.job_type for r in runs} == {"sweep-point"}
    assert len({r.name for r in runs}) == 2  # sweep members named apart
    assert all(len(t) <= 64 for r in runs for t in r.tags)
    assert [r.config["run"]["layer_plan"] for r in runs] == ["KKKM", "KMKM"]
    assert runs[0].config["sweep"]["model.mixer_plan.repeat"] == "[mixer,mixer,mixer,mixer,mixer,mixer,mixer,mla]"


def test_a_second_offline_segment_never_shares_the_first_ones_folder(tmp_path):
    """Offline folders are named by the second a segment starts: a segment started within the same second as
    another of its run (an evaluation right after a short run) waits into the next second."""
    import time

    from runtime.wandb_offline import wait_for_a_new_segment_name

    now = time.strftime("%Y%m%d_%H%M%S", time.localtime())
    (tmp_path / f"offline-run-{now}-abc123").mkdir()
    wait_for_a_new_segment_name(tmp_path, "abc123")
    assert time.strftime("%Y%m%d_%H%M%S", time.localtime()) != now
    started = time.monotonic()
    wait_for_a_new_segment_name(tmp_path, "other")  # another run's folder: no wait
    assert time.monotonic() - started < 0.5


def test_a_resumed_offline_training_segment_checks_for_a_same_second_folder(tmp_path, monkeypatch):
    """A resumed run's new offline segment, like an evaluation's, waits out a folder of its run named by
    the current second before W&B starts (runtime/loggers.py calls the wait with the run's own id)."""
    import runtime.loggers as loggers
    from runtime.compose import compose_root

    class Started(Exception):
        pass

    calls = []

    def wait(wandb_dir, run_id):
        calls.append((Path(wandb_dir), run_id))
        raise Started  # stop before W&B starts: the order is what is checked

    monkeypatch.setattr(loggers, "wait_for_a_new_segment_name", wait)
    monkeypatch.setenv("WANDB_MODE", "offline")
    root = compose_root(["logger=wandb", "logger.mode=offline"])
    with pytest.raises(Started):
        loggers.build_loggers(root, str(tmp_path), "run", {}, resume_id="abc123", overrides=[])
    assert calls == [(tmp_path / "wandb", "abc123")]
    assert not list(tmp_path.glob("wandb/offline-run-*"))  # it waited before W&B wrote anything
    calls.clear()
    loggers.build_loggers(root, str(tmp_path / "fresh"), "run", {}, resume_id=None, overrides=[])[1].experiment.finish()
    assert calls == []  # a new run has no earlier segment to collide with
