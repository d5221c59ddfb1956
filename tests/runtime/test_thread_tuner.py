"""A run whose thread count changes while it trains gives the same losses, bit for bit, as a run that keeps
its count: the tuner may choose anything. The tuner here probes every step (one timed step per count,
held one step), so the count alternates between 2 and 1 whatever the timings say."""

from __future__ import annotations

import torch

from tests.helpers import FAST

SWITCHING = (
    "+callbacks.threads={_target_:runtime.callbacks.thread_tuner.CpuThreadTuner,"
    "plan:{_target_:runtime.cpu_thread_tuning.TuningPlan,warm_steps:0,settle_steps:0,probe_steps:1,hold_steps:1}}"
)
STEPS = ["trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.checkpoint_every_n_steps=100"]


def counts_set_during(monkeypatch) -> list[int]:
    """Every count torch.set_num_threads is given from now on (the switches themselves, not a report)."""
    seen: list[int] = []
    original = torch.set_num_threads

    def recording(threads: int) -> None:
        seen.append(threads)
        original(threads)

    monkeypatch.setattr(torch, "set_num_threads", recording)
    return seen


def assert_switching_changes_nothing(train_run, monkeypatch, tmp_path, overrides: list[str]) -> None:
    common = [*overrides, *STEPS, "logger=csv", "trainer.cpu_threads=fixed"]
    two = train_run(*common, f"output_root={tmp_path / 'two'}", threads=2)
    seen = counts_set_during(monkeypatch)
    switched = train_run(*common, SWITCHING, f"output_root={tmp_path / 'switched'}", threads=2)
    # the run started on 2 threads, was switched to 1 and back to 2 while it trained
    assert seen[0] == 2 and 1 in seen and 2 in seen[seen.index(1) :], seen
    assert sorted(switched.losses) == list(range(6))
    assert switched.losses == two.losses
    assert switched.summary["val"] == two.summary["val"]  # the final validation
    assert "cpu threads:" in switched.stdout  # each decision is printed


def test_losses_are_bit_identical_when_the_thread_count_changes_mid_run(train_run, monkeypatch, tmp_path):
    # the default model's layers (GQA, dense SiTU-GLU, Muon) at test size, eager
    assert_switching_changes_nothing(train_run, monkeypatch, tmp_path, [*FAST])


def test_auto_tunes_only_one_process_cpu_runs_of_thread_invariant_compositions():
    from runtime.callbacks.thread_tuner import CpuThreadTuner
    from tests.helpers import compose_root

    auto = "trainer.cpu_threads=auto"
    assert CpuThreadTuner.for_run(compose_root()).enabled  # the default run: auto is the default
    assert not CpuThreadTuner.for_run(compose_root("trainer.cpu_threads=fixed")).enabled
    assert not CpuThreadTuner.for_run(compose_root(auto, "trainer.devices=2", "trainer.strategy=ddp")).enabled
    assert not CpuThreadTuner.for_run(compose_root(auto, "trainer=gpu")).enabled
    k3 = CpuThreadTuner.for_run(compose_root(auto, "experiment=k3_tiny"))  # drifts when switched: not tuned
    assert not k3.enabled and k3.summary()["requested"] == "auto" and k3.summary()["mode"] == "fixed"
    assert not CpuThreadTuner.for_run(compose_root(auto, "model.mtp_depth=1")).enabled
