"""``trainer.profiler``: Lightning's profilers write their report / trace into the run folder; an unknown
choice is refused before anything starts."""

from __future__ import annotations

import json

import pytest

from components.registry import ConfigError
from runtime.profiling import build_profiler, report_name
from runtime.run_folder import config_fingerprint
from runtime.train_command import EXIT_CONFIG_ERROR, main
from tests.helpers import FAST, compose_root

PROFILED = [*FAST, "trainer.val_check_interval=1000", "logger=csv"]


def test_simple_profiler_writes_its_report_into_the_run_folder(train_run):
    result = train_run(*PROFILED, "trainer.max_steps=3", "trainer.profiler=simple")
    folder = result.run_dir / "profiler"
    report = folder / "fit-report.txt"
    assert report.is_file() and report.stat().st_size > 0, sorted(folder.iterdir())
    text = report.read_text()
    assert "FIT Profiler Report" in text and "training_step" in text
    assert (folder / "validate-report.txt").stat().st_size > 0  # the final validation


def test_pytorch_profiler_writes_a_chrome_trace_into_the_run_folder(train_run):
    result = train_run(*PROFILED, "trainer.max_steps=6", "trainer.profiler=pytorch")
    folder = result.run_dir / "profiler"
    traces = sorted(folder.glob("fit-*training_step*.pt.trace.json"))
    assert len(traces) == 1, sorted(folder.iterdir())  # one recorded window of training steps
    trace = json.loads(traces[0].read_text())
    assert trace["traceEvents"], "empty trace"
    assert (folder / "fit-report.txt").stat().st_size > 0  # the operator table


@pytest.mark.parametrize("value", ["bogus", "Simple", "none"])
def test_unknown_profiler_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError) as err:
        compose_root("model=tiny", f"trainer.profiler={value}")
    message = str(err.value)
    assert "trainer.profiler" in message
    for choice in ("null", "simple", "advanced", "pytorch"):
        assert choice in message, message


def test_unknown_profiler_stops_train_py_before_any_folder(tmp_path, capsys):
    assert main(["model=tiny", "trainer.profiler=nvtx", f"output_root={tmp_path}"]) == EXIT_CONFIG_ERROR
    stderr = capsys.readouterr().err
    assert "trainer.profiler" in stderr and "pytorch" in stderr
    assert not any(tmp_path.iterdir())


def test_factory_builds_each_profiler_into_the_run_folder(tmp_path):
    from lightning.pytorch.profilers import (
        AdvancedProfiler,
        PyTorchProfiler,
        SimpleProfiler,
    )

    expected = {"simple": SimpleProfiler, "advanced": AdvancedProfiler, "pytorch": PyTorchProfiler}
    assert build_profiler(compose_root("model=tiny").trainer, str(tmp_path)) is None  # the default: off
    for choice, cls in expected.items():
        profiler = build_profiler(compose_root("model=tiny", f"trainer.profiler={choice}").trainer, str(tmp_path))
        assert type(profiler) is cls
        assert profiler.dirpath == str(tmp_path / "profiler") and profiler.filename == "report"
    pytorch = build_profiler(compose_root("model=tiny", "trainer.profiler=pytorch").trainer, str(tmp_path))
    assert pytorch._profiler_kwargs["record_shapes"] is False
    assert pytorch._schedule._schedule is PyTorchProfiler._default_schedule()  # wait 1, warmup 1, active 3


def test_nodes_sharing_a_run_folder_write_different_files():
    assert report_name(1, {"NODE_RANK": "3"}) == "report"
    assert report_name(2, {"NODE_RANK": "1"}) == "report-node1"
    assert report_name(2, {"SLURM_NODEID": "4"}) == "report-node4"
    assert report_name(2, {}) == "report-node0"


def test_profiling_a_run_keeps_its_run_folder():
    """Profiling (or activation checkpointing) does not make another run: ``ckpt_path=last`` finds the same folder."""
    base = config_fingerprint(compose_root("model=tiny"))
    assert config_fingerprint(compose_root("model=tiny", "trainer.profiler=pytorch")) == base
    assert config_fingerprint(compose_root("model=tiny", "trainer.activation_checkpointing=true")) == base
    assert config_fingerprint(compose_root("model=tiny", "trainer.max_steps=7")) != base
