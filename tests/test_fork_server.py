"""The tests' fork server (tests/fork_server.py) gives what a fresh interpreter gives: return codes, signals,
output, environment, working folder and arguments, and a timeout that kills the run."""

from __future__ import annotations

import json
import os
import subprocess
from types import SimpleNamespace

import pytest

from tests.helpers import REPO, run_python, start_python

SHOW = (
    "import json, os, sys; "
    "print(json.dumps([os.environ.get('K3_TEST_PROBE'), os.getcwd(), sys.argv[1:], os.getppid()]))"
)


@pytest.fixture(params=["forked", "fresh"])
def mode(request, monkeypatch):
    if request.param == "fresh":
        monkeypatch.setenv("K3_TEST_FORK", "0")
    return request.param


def test_output_environment_folder_and_arguments_arrive_as_in_a_fresh_interpreter(mode):
    done = run_python("-c", SHOW + "; print('to stderr', file=sys.stderr)", "a b", "c", env={"K3_TEST_PROBE": "seen"})
    assert done.returncode == 0, done.stderr
    probe, cwd, argv, parent = json.loads(done.stdout)
    assert (probe, cwd, argv) == ("seen", str(REPO), ["a b", "c"])
    assert done.stderr == "to stderr\n"
    # forked: the server is the parent, not this test process (this fails if a variable the test process's
    # libraries set makes every run fall back to a fresh interpreter: add it to RUN_TIME_VARIABLES if it is one)
    assert (parent != os.getpid()) == (mode == "forked")


@pytest.mark.parametrize(
    "code, returncode, stderr",
    [
        ("import sys; sys.exit(3)", 3, ""),
        ("import sys; sys.exit('bad input')", 1, "bad input\n"),
        ("raise ValueError('broken')", 1, "ValueError: broken"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9, ""),
        ("import atexit; atexit.register(print, 'at exit')", 0, ""),
        ("raise KeyboardInterrupt", -2, "KeyboardInterrupt"),
        # stderr is written line by line (kept when the run is killed) and escapes what it cannot encode
        ("import os, sys; print('before the kill', file=sys.stderr); os.kill(os.getpid(), 9)", -9, "before the kill"),
        ("import sys; print('a\\udcffb', file=sys.stderr)", 0, "a\\udcffb"),
    ],
)
def test_return_codes_and_signals_are_those_of_a_subprocess(mode, code, returncode, stderr):
    done = run_python("-c", code)
    assert done.returncode == returncode
    assert stderr in done.stderr
    if "atexit" in code:
        assert done.stdout == "at exit\n"  # exit handlers run, as at an interpreter's exit


def test_a_module_runs_as_python_m_runs_it(mode):
    done = run_python("-m", "json.tool", "--help")
    assert done.returncode == 0 and "usage:" in done.stdout


def test_a_timeout_kills_the_run_and_says_so(mode):
    run = start_python("-c", "import time; time.sleep(60)")
    assert run.poll() is None  # poll does not wait
    with pytest.raises(subprocess.TimeoutExpired):
        run.wait(timeout=1)
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(run.pid, 0)
    quick = start_python("-c", "pass")
    assert quick.wait(timeout=60).returncode == 0 and quick.poll() == 0


def test_a_variable_a_module_may_read_at_import_gets_a_fresh_interpreter(mode):
    """HF_HOME is read when huggingface_hub is imported, which a forked child did in the server: such a run
    is not forked."""
    done = run_python("-c", SHOW, env={"HF_HOME": "/nonexistent/hf"})
    assert json.loads(done.stdout)[3] == os.getpid()


def test_what_the_test_process_s_own_libraries_set_still_forks(monkeypatch):
    """Variables the test process's imports and compilations set for themselves do not make runs fall back to
    fresh interpreters: Lightning's NVML switch (set when lightning is imported, as the server's imports set
    it) and Inductor's cache folder (set at the first compile). Each once made every later run in its test
    process a fresh interpreter, which only the order-dependent check above could notice."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(default_cache_dir()))
    done = run_python("-c", SHOW)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[3] != os.getpid()


def test_what_a_run_leaves_running_is_waited_for_as_its_output_would_be(mode):
    code = (
        "import subprocess, sys; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1); print(\\'late\\', flush=True)'])"
    )
    assert run_python("-c", code, timeout=60).stdout == "late\n"


def test_a_different_pythonpath_gets_a_fresh_interpreter(mode, tmp_path):
    (tmp_path / "extra_module.py").write_text("VALUE = 7\n")
    code = SHOW + "; import extra_module; print(extra_module.VALUE)"
    done = run_python("-c", code, env={"PYTHONPATH": f"{REPO}:{tmp_path}"})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[0])[3] == os.getpid() and done.stdout.splitlines()[1] == "7"


def test_a_pid_handed_out_again_never_mixes_up_two_runs_ends():
    """The client keys each run's end by the server's run number: here run 1 (pid 4242) ends, unread, and the
    system gives the same pid to run 2, which is still going. Keyed by pid, run 2 would report run 1's code."""
    from tests.fork_server import ForkServer, _Lines

    read, write = os.pipe()
    server = ForkServer()
    server.proc = SimpleNamespace(stdin=open(os.devnull, "wb"))  # requests go nowhere; the answers are scripted
    server.lines = _Lines(read)
    script = [{"run": 1, "pid": 4242}, {"run": 1, "status": 3}, {"run": 2, "pid": 4242}]
    os.write(write, "".join(json.dumps(m) + "\n" for m in script).encode())
    first = server.start(["-c", "pass"], REPO, server.env)
    second = server.start(["-c", "pass"], REPO, server.env)
    assert (first.pid, second.pid) == (4242, 4242)
    assert second.poll() is None  # still going: run 1's end is not its end
    assert first.poll() == 3
    os.write(write, (json.dumps({"run": 2, "status": 0}) + "\n").encode())
    assert second.poll() == 0
    server.proc.stdin.close()
    for run in (first, second):
        run.tmp.cleanup()
    os.close(read)
    os.close(write)
