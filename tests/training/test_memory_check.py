"""The out-of-memory guard: a model that cannot fit stops with one message before anything is written."""

from __future__ import annotations

from components.training import memory_check
from tests.conftest import run_train
from tests.helpers import compose_root


def test_k3_full_is_refused_before_any_output(tmp_path):
    result = run_train("experiment=k3_full", f"output_root={tmp_path}", timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: model: training this model needs at least")
    assert "2,779,484,393,568 parameters" in lines[0] and "analysis.model_report" in lines[0]
    assert not any(tmp_path.iterdir())


def test_floor_counts_parameters_and_respects_the_switch(monkeypatch):
    root = compose_root("model=tiny")
    need, n = memory_check.training_floor_bytes(root)
    assert need == 16 * n and n > 0
    monkeypatch.setattr(memory_check, "_mem_available_bytes", lambda: need - 1)
    try:
        memory_check.check_fits(root)
        raise AssertionError("expected a ConfigError")
    except memory_check.ConfigError as err:
        assert err.key == "model"
    memory_check.check_fits(compose_root("model=tiny", "trainer.memory_check=false"))
    monkeypatch.setattr(memory_check, "_mem_available_bytes", lambda: need)
    memory_check.check_fits(root)
