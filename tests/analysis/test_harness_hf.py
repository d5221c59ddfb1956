"""The harness's own Hugging Face model (``--model hf``, nothing of the project's adapter) on an exported
run gives the accuracy, and the same per-choice log-likelihoods, as the project's ``k3`` model on the run
itself. The export says which class it is and why: this run's SiTU-GLU GQA model is not Llama."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

import lm_eval  # noqa: E402

import analysis.harness  # noqa: E402, F401  (registers "k3" beside the harness's own models)
import components.hf.transformers_model  # noqa: E402, F401  (the project's transformers classes)
from analysis.harness import task_manager  # noqa: E402
from tests.helpers import REPO  # noqa: E402

TASKS = REPO / "tests" / "harness_tasks"


@pytest.fixture(scope="module")
def run_and_export(trained_run, tmp_path_factory):
    """A 4-step byte-level run (the default GQA + dense SiTU-GLU model, tiny) and its export."""
    from analysis.export import main

    run = trained_run(
        "model=tiny",
        "data=corpus",
        "data.seq_len=64",
        "data.batch_size=8",
        "data.val_tokens=1024",
        "trainer.max_steps=4",
        "trainer.val_check_interval=100",
        "trainer.enable_progress_bar=false",
        "trainer.max_time_minutes=null",
        "trainer.compile=false",
        "logger=csv",
    ).run_dir
    out = tmp_path_factory.mktemp("harness-hf") / "export"
    return run, out, main([str(run), str(out)])


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


def test_the_export_names_its_class_and_why_it_is_not_llama(run_and_export, capsys):
    from analysis.export import main

    run, out, status = run_and_export
    assert status == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["K3SandboxForCausalLM"]
    assert main([str(out), str(out.parent / "again")]) == 0  # an export exports again, with the same message
    message = capsys.readouterr().out
    assert (
        "K3SandboxForCausalLM (model_type k3_sandbox); not LlamaForCausalLM: ffn.activation=situ_glu (SiTU-GLU"
        in message
    )


def test_the_harness_hf_model_on_the_export_scores_as_the_k3_model_on_the_run(run_and_export):
    run, out, _ = run_and_export
    manager = task_manager(["python_idioms"], str(TASKS))
    results = {}
    for name, args in (("hf", f"pretrained={out}"), ("k3", f"run={run}")):
        results[name] = lm_eval.simple_evaluate(
            model=name, model_args=args, tasks=["python_idioms"], task_manager=manager, device="cpu", log_samples=True
        )
    acc = {name: r["results"]["python_idioms"]["acc,none"] for name, r in results.items()}
    assert acc["hf"] == acc["k3"]
    scores = {
        name: [[c[0][0] for c in s["resps"]] for s in r["samples"]["python_idioms"]] for name, r in results.items()
    }
    assert len(scores["hf"]) == 20
    for a, b in zip(scores["hf"], scores["k3"]):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)


@pytest.mark.slow  # the harness's command line indexes all its built-in tasks first (about ten seconds each)
def test_the_harness_command_line_runs_the_export_as_hf(run_and_export, tmp_path):
    run, out, _ = run_and_export
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    acc = {}
    for name, args in (("hf", f"pretrained={out}"), ("k3", f"run={run}")):
        result = subprocess.run(
            [sys.executable, "-m", "analysis.harness", "--model", name, "--model_args", args,
             "--tasks", "python_idioms", "--include_path", str(TASKS), "--output_path", str(tmp_path / name)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        (path,) = list((tmp_path / name).rglob("results_*.json"))
        acc[name] = json.loads(path.read_text())["results"]["python_idioms"]["acc,none"]
    assert acc["hf"] == acc["k3"]
