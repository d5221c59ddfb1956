"""A trained K3 run with MTP, exported from the command line, goes through every tool as its run does:
``load_run`` gives the run's logits, ``analysis.generate`` the run's text, ``analysis.evaluate --lengths 1x``
the run's loss, the harness the run's log-likelihoods, and ``init_from`` starts a run from its weights."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from runtime.config import to_container
from runtime.load_run import load_run

K3 = [
    "experiment=k3_tiny",  # KDA x 3 then MLA, dense layer 0, Stable LatentMoE, QB, block AttnRes, one MTP depth
    "data.seq_len=32",
    "data.batch_size=4",
    "data.val_tokens=256",
    "trainer.val_check_interval=100",
    "trainer.enable_progress_bar=false",
    "trainer.compile=false",
    # fp32 like the tools below, so the run's validation loss and theirs agree to rounding (in bf16-mixed the
    # attention kernel alone moves the loss by more than the 1e-5 that tells the same windows apart)
    "trainer.precision=32-true",
    "trainer.max_time_minutes=null",
    "logger=csv",
]


@pytest.fixture(scope="module")
def run_and_export(trained_run, tmp_path_factory):
    from analysis.export import main as export_main

    run = trained_run(*K3, "trainer.max_steps=2").run_dir
    export = tmp_path_factory.mktemp("k3-export") / "export"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert export_main([str(run), str(export)]) == 0
    assert "K3SandboxForCausalLM" in printed.getvalue()  # K3 text-only: the registered class, never Kimi-Linear-48B's
    return run, export


def test_the_export_loads_back_as_the_run(run_and_export):
    run, export = run_and_export
    run_root, run_model = load_run(str(run))
    root, model = load_run(str(export))
    assert root.model.mtp_depth == 1 and to_container(root) == to_container(run_root)
    for (key, a), b in zip(model.state_dict().items(), run_model.state_dict().values()):
        assert torch.equal(a, b), key
    ids = torch.randint(0, model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids), run_model(ids))


def test_generate_and_evaluate_take_the_export_as_the_run(run_and_export, tmp_path, capsys):
    from analysis.evaluate import main as evaluate
    from analysis.generate import main as generate

    run, export = run_and_export
    texts = []
    for source in (run, export):
        assert generate([str(source), "--prompt", "def ", "--max-new-tokens", "12", "--seed", "3"]) == 0
        texts.append(capsys.readouterr().out.split("\n\n[")[0])
    assert texts[0] == texts[1] and len(texts[0]) > len("def ")

    results = []
    for source, out in ((run, tmp_path / "run-eval"), (export, tmp_path / "export-eval")):
        assert evaluate([str(source), "--lengths", "1x", "--tokens", "256", "--out", str(out)]) == 0
        results.append(json.loads((out / "lengths.json").read_text())["results"])
    assert results[0] == results[1]
    summary = json.loads((run / "summary.json").read_text())
    assert results[1][0]["loss"] == pytest.approx(summary["val"]["loss"], rel=1e-5)  # the same 8 windows


def test_the_harness_scores_the_export_as_the_run(run_and_export):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from analysis.harness import K3HarnessModel

    run, export = run_and_export
    text = "import os\nprint(os.getcwd())\n"
    scores = [
        K3HarnessModel(str(source)).loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
        for source in (run, export)
    ]
    assert scores[0] == scores[1]


def test_a_run_starts_from_the_export(run_and_export, train_run):
    _, export = run_and_export
    # a learning rate of 1e-30 and no balancer leave every non-zero weight bit-identical: what the run holds
    # after its one step is what it loaded
    result = train_run(*K3, "trainer.max_steps=1", f"init_from={export}", "optimizer.lr=1e-30", "balancer=none")
    assert f"initial weights from {export}" in result.stdout
    _, started = load_run(str(result.run_dir))
    _, source = load_run(str(export))
    for (key, a), b in zip(started.state_dict().items(), source.state_dict().values()):
        assert torch.allclose(a, b, rtol=0, atol=1e-20), key
