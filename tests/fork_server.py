"""Runs of ``train.py`` (and the project's other commands) forked from a process that has already imported
what a run imports.

A training run in a fresh interpreter spends most of a tiny test run's time importing (torch, Lightning and the
torchmetrics it pulls in, Hydra, W&B, the project): about ten seconds of CPU on a small machine, paid again by
every one of the suite's train.py runs. The server imports all of that once, in a process of its own that has
started no threads, and forks a child for each run. The child is a separate process as a subprocess would be
(its own pid, process group, environment, working folder, argv, stdout and stderr; a SIGKILL kills it alone and
shows as return code -9), so the tests keep exercising the command line end to end; only the import is shared.

Protocol, JSON lines over the server's stdin/stdout: a request ``{"command", "cwd", "env", "stdout", "stderr"}``
(the last two are files the child's output goes to) is answered with ``{"run", "pid"}`` right after the fork;
each child's end with ``{"run", "status"}`` (a return code, negative for a signal, as subprocess reports it).
``run`` numbers the requests, so a pid the system hands out again after its first process was reaped never
mixes up two runs' ends.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
# what a training run imports before it does anything else
PRELOAD = (
    "torch",
    "lightning.pytorch",
    "hydra",
    "wandb",
    "components.model",
    "runtime.launch",
    "runtime.run",
    "runtime.lit_module",
    "runtime.checkpoint_io",
    "runtime.validation",
)


# environment variables read when a run runs, not when a module is imported (those differ per run and test)
RUN_TIME_VARIABLES = {
    "OMP_NUM_THREADS",  # the child sets its thread count from it
    "PYTHONDONTWRITEBYTECODE",  # the child sets sys.dont_write_bytecode from it
    "PLANTED_DEFECT",
    "PATH",
    # set by libraries the test process imports (lm_eval, threadpoolctl, torch's compiler), for their own use:
    # a subprocess would inherit them too, and a training run does not depend on them
    "HF_XET_HIGH_PERFORMANCE",
    "KMP_DUPLICATE_LIB_OK",
    # set by Inductor in the test process the first time it compiles (its default cache folder, for its compile
    # workers); read when a run compiles
    "TORCHINDUCTOR_CACHE_DIR",
}
RUN_TIME_PREFIXES = ("WANDB_", "PYTEST_", "K3_")


def _child(request: dict) -> None:
    """In the forked child: become the process ``python command...`` would be, run it, exit."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own process group (the server sets it too, so a kill never misses it)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt, as in a fresh interpreter
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        fd_in = os.open(os.devnull, os.O_RDONLY)
        fd_out = os.open(request["stdout"], os.O_WRONLY | os.O_TRUNC)
        fd_err = os.open(request["stderr"], os.O_WRONLY | os.O_TRUNC)
        # onto the interpreter's own streams, which keep their buffering and error handling (stderr line by
        # line, unencodable characters escaped) and which handlers made in the server write to
        for fd, target in ((fd_in, 0), (fd_out, 1), (fd_err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        os.environ.clear()
        os.environ.update(request["env"])
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads:
            import torch

            torch.set_num_threads(int(threads))  # the pool was sized when torch loaded, in the server
        sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))  # read at start-up
        os.chdir(request["cwd"])
        import runpy

        command = request["command"]  # what follows ``python``: a script, -m module or -c code, and arguments
        try:
            if command[0] == "-c":
                sys.argv = ["-c", *command[2:]]
                sys.path[0] = ""  # -c: the working folder first
                main = type(sys)("__main__")
                sys.modules["__main__"] = main
                exec(compile(command[1], "<string>", "exec"), main.__dict__)
            elif command[0] == "-m":
                sys.argv = [command[1], *command[2:]]  # run_module puts the module's file first, as -m does
                sys.path[0] = request["cwd"]  # -m: the working folder first
                runpy.run_module(command[1], run_name="__main__", alter_sys=True)
            else:
                script = Path(request["cwd"], command[0])
                sys.argv = [str(script), *command[1:]]
                sys.path[0] = str(script.parent)  # a script: its own folder first
                runpy.run_path(str(script), run_name="__main__")
            code = 0
        except SystemExit as exit_:
            if exit_.code is None:
                code = 0
            elif isinstance(exit_.code, int):
                code = exit_.code
            else:
                print(exit_.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            sys.excepthook(*sys.exc_info())
            code = -signal.SIGINT  # a fresh interpreter ends by SIGINT then
        except BaseException:
            sys.excepthook(*sys.exc_info())  # exit hooks (W&B's) see the exception, as in a fresh interpreter
            code = 1
        # what the interpreter does at exit: join non-daemon threads, then the atexit handlers
        threading._shutdown()  # type: ignore[attr-defined]
        import atexit

        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            if code == -signal.SIGINT:
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            os._exit(code)


class _Lines:
    """Whole lines from a file descriptor, with a timeout (select on a buffered reader can miss lines it holds)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buffer = fd, b""

    def next(self, timeout: Optional[float]) -> Optional[str]:
        """The next line; "" at end of input; None when nothing came within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.fd], [], [], left)[0]:
                return None
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return ""
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()


def serve() -> None:
    """The server's loop: preload, then one forked child per request, until stdin closes; each child's end is
    reported as it happens, so several runs can go at once."""
    sys.path.insert(0, str(REPO))
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # nothing else may write into the channel

    def say(message: dict) -> None:
        channel.write(json.dumps(message) + "\n")
        channel.flush()

    if threading.active_count() != 1:  # forking a process with threads can leave locks held in the child
        say({"ready": False, "why": f"{threading.active_count()} threads after the imports"})
        return
    say({"ready": True, "env": dict(os.environ)})  # with what its imports set (lightning: an NVML switch)
    requests, started = _Lines(0), 0
    running: dict[int, int] = {}  # pid -> run number, of the children not yet reaped
    while True:
        line = requests.next(0.05 if running else None)
        if line == "":  # the client is gone: so are its runs
            for pid in running:
                _signal_group(pid, signal.SIGKILL)
            return
        if line:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                channel.close()
                _child(json.loads(line))
            try:
                os.setpgid(pid, pid)  # before the client can time it out (the child does the same)
            except OSError:  # it already has, or has already ended
                pass
            started += 1
            running[pid] = started
            say({"run": started, "pid": pid})
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            say({"run": running.pop(pid), "status": os.waitstatus_to_exitcode(status)})


def _signal_group(pid: int, sig: int) -> bool:
    """Send ``sig`` to the process group run ``pid`` leads (0: none, a liveness probe); whether the group exists."""
    try:
        os.killpg(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


class ForkedRun:
    """One run the server started, with ``subprocess.Popen``'s ``poll`` and ``returncode``; ``wait`` gives what
    ``subprocess.run`` would have."""

    def __init__(
        self, server: "ForkServer", run: int, pid: int, command: list[str], tmp: tempfile.TemporaryDirectory
    ) -> None:
        self.server, self.run, self.pid, self.args, self.tmp = server, run, pid, [sys.executable, *command], tmp
        self.returncode: Optional[int] = None

    def _output(self) -> tuple[str, str]:
        return tuple(Path(self.tmp.name, name).read_text(errors="replace") for name in ("stdout", "stderr"))

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self.server.status_of(self.run, 0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> subprocess.CompletedProcess:
        if self.tmp is None:
            raise RuntimeError(f"run {self.pid} was already waited for")
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            if self.returncode is None:
                self.returncode = self.server.status_of(self.run, timeout)
            # what the run started (ranks, workers) and left running: subprocess.run would wait for it while
            # it holds the output open; here, while its process group lives
            while self.returncode is not None and _signal_group(self.pid, 0):
                if deadline is not None and time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            if self.returncode is None or _signal_group(self.pid, 0):  # as subprocess.run's timeout: kill, report
                _signal_group(self.pid, signal.SIGKILL)
                if self.returncode is None:
                    self.returncode = self.server.status_of(self.run, 60)
                raise subprocess.TimeoutExpired(self.args, timeout or 0, *self._output())
            return subprocess.CompletedProcess(self.args, self.returncode, *self._output())
        finally:
            self.tmp.cleanup()
            self.tmp = None


class ForkServer:
    """The client: one server per test process, started on first use, stopped at exit."""

    def __init__(self) -> None:
        # the environment the test process started with: a test's monkeypatched variables are passed to its own
        # runs, never frozen into what the server imports
        self.env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.env_after_imports: dict[str, str] = {}  # the server's, once it has imported PRELOAD
        self.proc: Optional[subprocess.Popen] = None
        self.lines: Optional[_Lines] = None
        self.broken: Optional[str] = None
        self.ended: dict[int, int] = {}  # run number -> return code, of runs nobody has waited for yet

    def _start(self) -> bool:
        if self.proc is not None:
            return True
        if self.broken is not None:
            return False
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fork_server"],
            cwd=REPO,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert self.proc.stdout is not None
        self.lines = _Lines(self.proc.stdout.fileno())
        try:
            hello = self._message(300)
        except RuntimeError:  # it ended during its imports: the runs show why, in fresh interpreters
            hello = None
        if not hello or not hello.get("ready"):
            self._give_up((hello or {}).get("why", "the server did not start"))
            return False
        self.env_after_imports = hello["env"]
        return True

    def _give_up(self, why: str) -> None:
        """Stop using the server for the rest of this test process, and say why once (the suite's warnings)."""
        self.broken = why
        self.stop()
        warnings.warn(f"tests/fork_server.py: {why}; runs start in fresh interpreters from now on", stacklevel=3)

    def _message(self, timeout: Optional[float]) -> Optional[dict]:
        if self.lines is None:
            raise RuntimeError("the fork server was stopped")
        line = self.lines.next(timeout)
        if line == "":
            raise RuntimeError("the fork server ended")
        return None if line is None else json.loads(line)

    def stop(self) -> None:
        """End the server; it kills the runs still going when its input closes."""
        if self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc, self.lines = None, None

    def forkable(self, env: dict) -> bool:
        """Whether a run with environment ``env`` can be forked: every variable has the value the server's
        imports saw (as it started) or left (the test process sets the same ones when it imports the same
        modules), or is one that is read at run time. Anything else (HF_HOME, a TORCH_* switch, ...) may be read
        when a module is imported, which for a forked child happened in the server, so such a run gets a fresh
        interpreter."""
        differs = {
            k
            for k in env.keys() | self.env.keys()
            if env.get(k) not in (self.env.get(k), self.env_after_imports.get(k))
        }
        return all(k in RUN_TIME_VARIABLES or k.startswith(RUN_TIME_PREFIXES) for k in differs)

    def start(self, command: list[str], cwd: Path, env: dict) -> Optional[ForkedRun]:
        """``python command...`` (a script, ``-m module`` or ``-c code``, and its arguments) as a forked child;
        None where the server cannot start (run it plainly)."""
        if not self._start() or not self.forkable(env):
            return None
        assert self.proc is not None and self.proc.stdin is not None
        tmp = tempfile.TemporaryDirectory()
        out, err = Path(tmp.name, "stdout"), Path(tmp.name, "stderr")
        out.touch()
        err.touch()
        request = {"command": command, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:  # the server is gone: this run and the next ones run plainly
            self._give_up("the server ended")
            tmp.cleanup()
            return None
        while True:
            message = self._message(60)
            if message is None:
                self.stop()
                raise RuntimeError("the fork server did not start the run")
            if "status" in message:
                self.ended[message["run"]] = message["status"]
            else:
                return ForkedRun(self, message["run"], message["pid"], command, tmp)

    def status_of(self, run: int, timeout: Optional[float]) -> Optional[int]:
        """Run number ``run``'s return code once it ends; None if it has not within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while run not in self.ended:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            message = self._message(left)
            if message is None:
                return None
            self.ended[message["run"]] = message["status"]
        return self.ended.pop(run)


if __name__ == "__main__":
    serve()
