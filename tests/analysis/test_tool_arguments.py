"""Command-line tools refuse a bad option by name before any work: one line, exit status 2, no
traceback (the shared argument types of runtime/cli.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO, run_python


def _refused(capsys, main, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert message in err and "Traceback" not in err, err
    return err


GENERATE_CASES = {
    "temperature nan": (["--temperature", "nan"], "argument --temperature: must be a finite number, got nan"),
    "temperature negative": (["--temperature", "-1"], "argument --temperature: must be >= 0"),
    "top-k 0": (["--top-k", "0"], "argument --top-k: must be >= 1, got 0"),
    "top-p 0": (["--top-p", "0"], "argument --top-p: must be > 0"),
    "top-p above 1": (["--top-p", "1.5"], "argument --top-p: must be <= 1"),
    "max-new-tokens 0": (["--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1"),
    "device bogus": (["--device", "bogus"], "argument --device: 'bogus' is not a device"),
}


@pytest.mark.parametrize("case", GENERATE_CASES)
def test_generate_refuses_a_bad_option_naming_it(tmp_path, capsys, case):
    from analysis.generate import main

    options, message = GENERATE_CASES[case]
    _refused(capsys, main, [str(tmp_path / "run"), "--prompt", "x", *options], message)


def test_generate_refuses_a_device_this_machine_lacks(tmp_path, capsys):
    import torch

    from analysis.generate import main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    _refused(capsys, main, [str(tmp_path), "--prompt", "x", "--device", "cuda"], "has no CUDA device")


def test_generate_refuses_a_prompt_that_is_not_utf8(tmp_path):
    argv = [os.fsencode(sys.executable), b"-m", b"analysis.generate", os.fsencode(tmp_path), b"--prompt", b"caf\xe9"]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, timeout=120)
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == 2 and "argument --prompt: is not valid UTF-8 text" in err and "Traceback" not in err


HARNESS_TASKS = REPO / "tests" / "harness_tasks"


def _harness(tmp_path, *argv) -> tuple[int, str]:
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = run_python("-m", "analysis.harness", *argv, env=env, timeout=300)
    return proc.returncode, proc.stderr


@pytest.mark.parametrize(
    "model_args, message",
    [
        ("max_length=abc", "--model_args max_length=abc: not a whole number"),
        # each case starts the harness (about 6 s): the other two run with -m slow
        pytest.param("max_length=0", "--model_args max_length=0: must be >= 1", marks=pytest.mark.slow),
        pytest.param("batch_size=x", "--model_args batch_size=x: not a whole number", marks=pytest.mark.slow),
    ],
)
def test_harness_refuses_a_bad_model_argument_naming_it(tmp_path, model_args, message):
    argv = ["--model", "k3", "--model_args", f"run={tmp_path},{model_args}", "--tasks", "python_idioms"]
    rc, err = _harness(tmp_path, *argv, "--include_path", str(HARNESS_TASKS))
    assert rc == 2 and f"analysis.harness: error: {message}" in err and "Traceback" not in err, err


def test_harness_checks_the_model_sizes_before_the_tasks(tmp_path):
    """A bad size is refused before the harness looks for the tasks (whose unknown one would take it through
    its ten-second index of built-in tasks) and before it starts."""
    argv = ["--model", "k3", "--model_args", f"run={tmp_path},batch_size=x", "--tasks", "python_idioms,no_such"]
    rc, err = _harness(tmp_path, *argv, "--include_path", str(HARNESS_TASKS))
    assert rc == 2 and "error: --model_args batch_size=x: not a whole number" in err and "unknown task" not in err


@pytest.mark.slow  # naming a task unknown means indexing all the harness's built-in tasks (about ten seconds)
def test_harness_refuses_an_unknown_task_before_loading_the_run(tmp_path):
    argv = ["--model", "k3", "--model_args", f"run={tmp_path / 'missing'}", "--tasks", "python_idioms,no_such"]
    rc, err = _harness(tmp_path, *argv, "--include_path", str(HARNESS_TASKS))
    assert rc == 2 and "--tasks: unknown task(s) no_such" in err and "Traceback" not in err, err


@pytest.mark.parametrize("spec", ["infx", "nanx", "-2x", "0", "abc"])
def test_evaluate_refuses_a_bad_length_before_loading_the_run(tmp_path, capsys, spec):
    from analysis.evaluate import main

    assert main([str(tmp_path), f"--lengths={spec}"]) == 2  # tmp_path is no run: the form is refused first
    err = capsys.readouterr().err
    assert f"--lengths: '{spec}' is neither" in err and "Traceback" not in err, err


def test_evaluate_refuses_an_out_that_is_a_file_before_loading_the_run(tmp_path, capsys):
    from analysis.evaluate import main

    (tmp_path / "results").write_text("mine")
    assert main([str(tmp_path), "--lengths", "1x", "--out", str(tmp_path / "results")]) == 2
    assert "--out" in capsys.readouterr().err and (tmp_path / "results").read_text() == "mine"
    with pytest.raises(SystemExit):  # a file on the way to it
        main([str(tmp_path), "--lengths", "1x", "--out", str(tmp_path / "results" / "sub")])
    assert "results is a file, not a folder" in capsys.readouterr().err


def test_compare_names_a_torn_summary_and_skips_a_torn_index_line(tmp_path, capsys):
    from analysis.compare import main
    from runtime.sweep_job import read_index

    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text('{"val": {"loss": 1.2')
    assert main([str(run), "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err
    assert f"{run / 'summary.json'}: not readable JSON" in err and "Traceback" not in err, err
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "index.jsonl").write_text('{"job": 0, "run_dir": "a"}\n{"job": 1, "run_')
    assert read_index(str(sweep)) == [{"job": 0, "run_dir": "a"}]
    (tmp_path / "taken").write_text("mine")
    with pytest.raises(SystemExit) as exit_:
        main([str(run), "--out", str(tmp_path / "taken")])
    assert exit_.value.code == 2 and "is a file, not a folder" in capsys.readouterr().err
    assert (tmp_path / "taken").read_text() == "mine"
