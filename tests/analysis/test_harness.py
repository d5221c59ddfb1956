"""The lm-evaluation-harness on a run: the harness's accuracy on the shipped task equals the accuracy of
the project's own log-likelihoods, rolling log-likelihood equals the summed token loss, generation stops
at the stop string, and the harness's command line finds the model as ``k3``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from analysis.harness import K3HarnessModel  # noqa: E402
from components.sampling import generate  # noqa: E402
from runtime.load_run import load_run, load_tokenizer  # noqa: E402
from tests.helpers import REPO  # noqa: E402

TASKS = REPO / "tests" / "harness_tasks"
RUN = [
    "model=tiny",
    "data.seq_len=64",
    "data.batch_size=8",
    "trainer.max_steps=4",
    "trainer.val_check_interval=100",
    "trainer.enable_progress_bar=false",
    "trainer.max_time_minutes=null",
    "trainer.compile=false",
    "logger=csv",
]


# the default suite runs the byte-level model; -m slow adds the BPE one (the project's code corpus)
@pytest.fixture(scope="module", params=["corpus", pytest.param("code", marks=pytest.mark.slow)], ids=["bytes", "bpe"])
def trained(request, trained_run):
    return trained_run(
        *RUN, f"data={request.param}", *(["data.val_tokens=1024"] if request.param == "corpus" else [])
    ).run_dir


@pytest.fixture(autouse=True)
def offline_datasets(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


def _direct_logprob(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context) from one plain forward pass (the harness's convention: the context's
    trailing spaces belong to the continuation, and the pair is tokenised whole, then split)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer.encode_batch([context + continuation])[0].tolist()
    n_context = len(tokenizer.encode_batch([context])[0])
    with torch.no_grad():
        logprobs = model(torch.tensor([whole[:-1]])).float().log_softmax(-1)[0]
    return float(sum(logprobs[i - 1, whole[i]] for i in range(n_context, len(whole))))


def test_harness_accuracy_equals_the_projects_own_loglikelihoods(trained):
    from analysis.evaluate import main

    assert main([str(trained), "--tasks", "python_idioms", "--include-path", str(TASKS)]) == 0
    harness = json.loads((trained / "eval" / "harness.json").read_text())["results"]["python_idioms"]["acc"]
    root, model = load_run(str(trained))
    tokenizer = load_tokenizer(str(trained), root)
    items = [json.loads(line) for line in (TASKS / "python_idioms.jsonl").read_text().splitlines()]
    correct = 0
    for item in items:
        scores = [_direct_logprob(model, tokenizer, item["context"], choice) for choice in item["choices"]]
        correct += int(max(range(len(scores)), key=scores.__getitem__) == item["answer"])
    assert harness == correct / len(items)


def test_rolling_loglikelihood_is_the_summed_token_loss_and_generation_stops(trained):
    lm = K3HarnessModel(str(trained), max_length=48)
    text = "def add(a, b):\n    return a + b\n"
    tokens = lm.tok_encode(text)
    assert len(tokens) <= 48
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    with torch.no_grad():
        logits = lm.model(torch.tensor([[lm.eot_token_id, *tokens[:-1]]]))[0]
    assert rolling == pytest.approx(
        -float(F.cross_entropy(logits.float(), torch.tensor(tokens), reduction="sum")), rel=1e-5
    )
    # a text longer than max_length is scored in windows; every token is still scored once
    long_text = text * 8
    (long_score,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (long_text,), 0)])
    assert long_score < rolling * 4

    prompt = "def main():\n"
    (free,) = lm.generate_until(
        [Instance("generate_until", {}, (prompt, {"until": ["\x00never"], "max_gen_toks": 12}), 0)]
    )
    ids = generate(lm.model, torch.tensor([lm.tok_encode(prompt)]), 12)[0, len(lm.tok_encode(prompt)) :].tolist()
    eod = ids.index(lm.eot_token_id) if lm.eot_token_id in ids else len(ids)
    assert free == lm.tokenizer_.decode(ids[:eod])  # greedy, as the library's greedy generate
    if free[1:]:
        stop = free[1:3]
        (cut,) = lm.generate_until([Instance("generate_until", {}, (prompt, {"until": [stop], "max_gen_toks": 12}), 0)])
        assert cut == free.split(stop)[0]


@pytest.mark.slow  # the harness's command line indexes all its built-in tasks first (about ten seconds)
def test_the_harness_command_line_finds_the_model_as_k3(trained, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "analysis.harness",
            "--model",
            "k3",
            "--model_args",
            f"run={trained},device=cpu,batch_size=8",  # the form the module's docstring shows
            "--tasks",
            "python_idioms",
            "--include_path",
            str(TASKS),
            "--limit",
            "4",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "python_idioms" in result.stdout and "acc" in result.stdout
    missing = subprocess.run(
        [
            sys.executable,
            "-m",
            "analysis.harness",
            "--model",
            "k3",
            "--model_args",
            f"run={tmp_path / 'missing'}",
            "--tasks",
            "python_idioms",
            "--include_path",
            str(TASKS),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert (
        missing.returncode == 2
        and "analysis.harness: error:" in missing.stderr
        and "no such run folder" in missing.stderr
    )


@pytest.mark.slow  # naming a task unknown means indexing all the harness's built-in tasks (about ten seconds)
def test_unknown_tasks_are_refused(trained, capsys):
    from analysis.evaluate import main

    assert main([str(trained), "--tasks", "no_such_task", "--include-path", str(TASKS)]) == 2
    assert "unknown task(s) no_such_task" in capsys.readouterr().err


def test_missing_runs_and_missing_options_are_refused(trained, tmp_path, capsys):
    from analysis.evaluate import main

    assert main([str(tmp_path / "missing"), "--tasks", "python_idioms"]) == 2
    assert "no such run folder" in capsys.readouterr().err
    assert main([str(trained)]) == 2
    assert "--lengths and/or --tasks" in capsys.readouterr().err
