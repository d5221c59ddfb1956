"""Everything tests share: composing configs, building small models, training runs (in this process, or as
``train.py`` in a process of its own), fault injection."""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import re
import signal
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from components.model import Decoder
from runtime.compose import compose, strip_hydra
from runtime.config import RootConfig
from runtime.validation import validate

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"


def compose_root(*overrides: str) -> RootConfig:
    """Typed, validated RootConfig for the given overrides."""
    return validate(strip_hydra(compose(list(overrides))))


def build_model(*overrides: str) -> Decoder:
    """The decoder the given overrides compose (fp32, random init from the current torch seed)."""
    return Decoder(compose_root(*overrides).decoder_config())


def tiny_model(*overrides: str, seed: int = 0, gain_noise: float = 0.1) -> Decoder:
    """``model=tiny`` in fp64, eval mode, with random (not unit) norm gains and non-zero 1-D parameters,
    so that a wiring bug hidden by symmetric weights (unit gains, zero AttnRes queries) still shows."""
    torch.manual_seed(seed)
    model = build_model("model=tiny", *overrides).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(gain_noise * torch.randn_like(p))
    return model


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


# -- training runs in this process (the ``train_run`` / ``trained_run`` fixtures in tests/conftest.py) ----------
# a tiny model on short windows of the default data, trained in seconds: logging every step, no compile, no time guard
FAST = [
    "model=tiny",
    "data.seq_len=64",
    "data.batch_size=8",
    "data.val_tokens=2048",
    "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1",
    "trainer.compile=false",
    "trainer.max_time_minutes=null",
]


def only_run_dir(output_root: Path) -> Path:
    """The one run folder under ``output_root``."""
    dirs = [p for p in Path(output_root).iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(dirs) == 1, dirs
    return dirs[0]


def metric_rows(run_dir: Path) -> list[dict]:
    """Every row of the run's metrics.jsonl."""
    from runtime.jsonl_logger import read_metrics

    return read_metrics(str(Path(run_dir) / "metrics.jsonl"))


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """The run's logged training losses by step (steps count from 0)."""
    return {r["step"]: r["train/loss"] for r in metric_rows(run_dir) if "train/loss" in r}


@dataclass
class TrainedRun:
    """What a run trained in this process left: its folder, its summary and what it printed."""

    run_dir: Path
    summary: dict
    stdout: str

    @property
    def metrics(self) -> list[dict]:
        return metric_rows(self.run_dir)

    @property
    def losses(self) -> dict[int, float]:
        return losses_by_step(self.run_dir)


class _Tee(io.TextIOBase):
    """Writes to a buffer, and to the stream it stands in for (pytest's capture, shown when a test fails)."""

    def __init__(self, stream) -> None:
        self.stream, self.buffer = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.stream.write(text)
        return self.buffer.write(text)

    def flush(self) -> None:
        self.stream.flush()


def train_in_process(*overrides: str, threads: int | None = None) -> TrainedRun:
    """``python train.py overrides...`` in this process: the config composed, validated and checked to fit
    and the run folder chosen as the command line does (``runtime.train_command.prepare_single_run``), then
    ``runtime.training_run.train``. Every process-wide setting a run changes is put back afterwards
    (``isolated_process_state``); ``threads`` runs it on that many threads (a run compared bit for bit with
    one started with ``OMP_NUM_THREADS``). Raises what the run raises (the command line turns ConfigError,
    NonFiniteTrainingError and CheckpointWriteError into exit statuses 2, 3 and 4)."""
    from runtime.train_command import prepare_single_run
    from runtime.training_run import train

    with isolated_process_state():
        if threads is not None:
            torch.set_num_threads(threads)
        tee = _Tee(sys.stdout)
        with contextlib.redirect_stdout(tee):
            run = prepare_single_run(list(overrides))
            summary = train(run.root, run.run_dir)
        return TrainedRun(Path(run.run_dir), summary, tee.buffer.getvalue())


def train_command_in_process(*argv: str) -> int:
    """``python train.py argv...``'s whole command line (``runtime.train_command.main``: flags, the composition
    an ``init_from`` folder brings, Hydra's job and ``.hydra/``, the exit statuses) in this process; its exit
    status. What it prints goes to this process's streams (pytest's ``capsys``)."""
    from runtime.train_command import main

    with isolated_process_state():
        return main(list(argv))


@contextlib.contextmanager
def isolated_process_state():
    """Puts back what a training run changes in its process, so that runs and tests after it start as they
    would in a fresh interpreter: the random generators (torch, CUDA, Python, NumPy), torch's thread count,
    deterministic-algorithm flags, default dtype and matmul precision; the environment (W&B's mode and
    service address, Lightning's seed variables); logger levels and handlers; warning filters; signal
    handlers Lightning installs; Lightning's rank; ``sys.argv`` and the working folder. After it: a W&B run
    still open is finished, Hydra's global state cleared, and torch.compile's caches reset when it compiled."""
    import random

    import numpy as np
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    torch_flags = (
        torch.get_num_threads(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.get_default_dtype(),
        torch.get_float32_matmul_precision(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    environ = dict(os.environ)
    named = logging.Logger.manager.loggerDict.values()
    loggers = [logging.getLogger(), *(lg for lg in named if isinstance(lg, logging.Logger))]
    logger_state = [(lg, lg.level, list(lg.handlers), lg.propagate, lg.disabled) for lg in loggers]
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    rank = getattr(rank_zero_only, "rank", None)
    argv, cwd = list(sys.argv), os.getcwd()
    compiles_before = _dynamo_frames()
    try:
        with warnings.catch_warnings():
            yield
    finally:
        import wandb

        if wandb.run is not None:
            wandb.finish(exit_code=1)
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None
        if _dynamo_frames() != compiles_before:
            torch._dynamo.reset()
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        threads, deterministic, warn_only, dtype, matmul, cudnn_deterministic, cudnn_benchmark = torch_flags
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.set_default_dtype(dtype)
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_deterministic, cudnn_benchmark
        os.environ.clear()
        os.environ.update(environ)
        for lg, level, lg_handlers, propagate, disabled in logger_state:
            lg.setLevel(level)
            lg.handlers[:] = lg_handlers
            lg.propagate, lg.disabled = propagate, disabled
        for s, handler in handlers.items():
            signal.signal(s, handler)
        if rank is None:
            rank_zero_only.__dict__.pop("rank", None)
        else:
            rank_zero_only.rank = rank
        sys.argv[:] = argv
        os.chdir(cwd)


def _dynamo_frames() -> int:
    """How many frames torch.compile has compiled in this process (0 before it was first imported)."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    return 0 if dynamo is None else sum(dynamo.counters["frames"].values())


# -- command-line runs in a process of their own ---------------------------------------------------------
class _PlainRun:
    """A command started in a fresh interpreter: ``poll``, ``returncode``, and ``wait`` that gives what
    ``subprocess.run`` would."""

    def __init__(self, args: list[str], cwd: Path, env: dict) -> None:
        self.proc = subprocess.Popen(
            args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True
        )
        self.pid = self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> subprocess.CompletedProcess:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            raise subprocess.TimeoutExpired(self.proc.args, timeout or 0, out, err) from None
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)


def start_python(*command: str, env: dict | None = None, cwd: Path = REPO) -> _PlainRun:
    """``python command...`` (a script, ``-m module`` or ``-c code``, and its arguments) started in a fresh
    interpreter in ``cwd``, with this checkout (or ``cwd``) on PYTHONPATH and ``env`` added to this process's
    environment. For what only a process of its own shows: exit statuses, a SIGKILL, several ranks."""
    full_env = {**os.environ, "PYTHONPATH": str(cwd), **(env or {})}
    return _PlainRun([sys.executable, *command], cwd, full_env)


def run_python(
    *command: str, timeout: float = 600, env: dict | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """``python command...`` run to its end (``start_python``)."""
    return start_python(*command, env=env, cwd=cwd).wait(timeout)


def start_train(*overrides: str, env: dict | None = None, cwd: Path = REPO) -> _PlainRun:
    """``python train.py overrides...`` started from the repository root (or ``cwd``): ``start_python``."""
    return start_python(str(Path(cwd) / "train.py"), *overrides, env=env, cwd=cwd)


def run_train(
    *overrides: str, timeout: float = 600, env: dict | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """``python train.py overrides...`` run to its end in a process of its own (``start_python``); a test of
    what a run produces trains in this process instead (``train_in_process``)."""
    return start_train(*overrides, env=env, cwd=cwd).wait(timeout)


def kill_after_microbatch(n: int) -> str:
    """The override that SIGKILLs a run right after micro-batch ``n`` (runtime/callbacks/fault_injection.py)."""
    return f"+callbacks.kill={{_target_:runtime.callbacks.fault_injection.FaultInjection,kill_after:{n}}}"


def tree_hash(root: Path) -> str:
    """One hash over every path under ``root`` and every file's bytes (a missing ``root``: "absent")."""
    if not root.exists():
        return "absent"
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file() and not p.is_symlink():
            h.update(p.read_bytes())
    return h.hexdigest()


def save_run(root: RootConfig, model: Decoder, run_dir: Path) -> Path:
    """A run folder as far as ``load_run`` and ``analysis.export`` read one: ``checkpoints/last.ckpt`` with
    the training module's weights (``model.`` keys) and the run's composed config, as train.py saves it."""
    from runtime.checkpoints.layout import CONFIG_KEY, MODULE_PREFIX
    from runtime.config import to_container

    path = run_dir / "checkpoints" / "last.ckpt"
    path.parent.mkdir(parents=True)
    state = {f"{MODULE_PREFIX}{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, CONFIG_KEY: to_container(root), "global_step": 0}, path)
    return run_dir


# A tool run under an audit hook that SIGKILLs it right before its Nth write under a folder: every file
# opened for writing, folder made, rename, removal, permission change and folder swap is one write.
_KILL_AT_WRITE = r"""
import os, runpy, signal, sys

root, n, target = os.path.abspath(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
WRITES = {"open", "os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.chmod", "os.truncate", "shutil.rmtree",
          "atomic_folder.put_in_place"}
count = 0


def under_root(event, args):
    path = args[0]
    if not isinstance(path, (str, bytes, os.PathLike)):
        return False
    path = os.fsdecode(path)
    if event in ("os.remove", "os.rmdir") and isinstance(args[-1], int) and not os.path.isabs(path):
        path = os.path.join(os.readlink(f"/proc/self/fd/{args[-1]}"), path)  # shutil.rmtree's removals
    path = os.path.abspath(path)
    return path == root or path.startswith(root + os.sep)


def hook(event, args):
    global count
    if event not in WRITES or not args or not under_root(event, args):
        return
    if event == "open":
        mode, flags = args[1], args[2]
        writing = any(c in mode for c in "wax+") if mode is not None else flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        if not writing:
            return
    count += 1
    if count == n:
        os.kill(os.getpid(), signal.SIGKILL)


sys.addaudithook(hook)
import atexit

atexit.register(lambda: print(f"write events: {count}", file=sys.stderr))
sys.argv = [target, *sys.argv[4:]]
if target.endswith(".py"):
    sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    runpy.run_path(target, run_name="__main__")
else:
    runpy.run_module(target, run_name="__main__", alter_sys=True)
"""


def run_killed_at_write(
    tool: str, argv: list[str], root: Path, n: int, timeout: float = 300
) -> tuple[subprocess.CompletedProcess, int]:
    """Run ``tool`` (``prepare.py`` or a module such as ``analysis.export``) with ``argv`` from the
    repository root, SIGKILLed right before its ``n``-th write under ``root`` (``n`` = 0: never).
    Returns the process and, when it was not killed, how many writes under ``root`` it made."""
    env = {"PYTHONDONTWRITEBYTECODE": "1"}
    proc = run_python("-c", _KILL_AT_WRITE, str(root), str(n), tool, *map(str, argv), env=env, timeout=timeout)
    found = re.search(r"write events: (\d+)", proc.stderr)
    return proc, int(found.group(1)) if found else -1


# -- contract checks shared by the registry-driven tests (tests/contracts/) ------------------------------
def assert_shape(model: Decoder) -> None:
    ids = torch.randint(0, model.vocab_size, (3, 11))
    assert model(ids).shape == (3, 11, model.vocab_size)


def assert_causal(model: Decoder, T: int = 24) -> None:
    """Changing the tokens after t leaves every output up to t unchanged, and changes some later one."""
    ids = torch.randint(0, model.vocab_size, (2, T))
    base = model(ids)
    for t in (0, 7, T - 2):
        changed = ids.clone()
        changed[:, t + 1 :] = torch.randint(0, model.vocab_size, (2, T - t - 1))
        out = model(changed)
        torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-10)
        assert not torch.allclose(out[:, t + 1 :], base[:, t + 1 :])


def assert_cached_decoding_matches(model: Decoder, prefill: int, steps: int, tol: float = 1e-9) -> None:
    """Prefill, single-token steps and a multi-token continuation through the cache equal one full pass
    (``tol``: fp64 round-off; routers score in fp32 by design, so routed FFNs need fp32's)."""
    ids = torch.randint(0, model.vocab_size, (2, prefill + steps + 3))
    full = model(ids)
    cache = model.new_cache()
    outs = [model(ids[:, :prefill], cache=cache)]
    for t in range(prefill, prefill + steps):
        outs.append(model(ids[:, t : t + 1], cache=cache))
    outs.append(model(ids[:, prefill + steps :], cache=cache))
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=tol, atol=tol)
    assert cache.seq_len == ids.shape[1]


def train_steps(*overrides: str, steps: int = 4, seed: int = 0) -> tuple[Decoder, list[float], dict[str, float]]:
    """A few optimizer steps on one fixed batch, wired as the runtime wires them: the model, the
    balancer's loss term and per-step update, and the optimizer, all built from their registries.
    Returns the model, the losses and the balancer's last metrics."""
    import torch.nn.functional as F

    from components.registry import BALANCERS, OPTIMIZERS

    root = compose_root("model=tiny", *overrides)
    torch.manual_seed(seed)
    model = Decoder(root.decoder_config()).train()
    balancer = BALANCERS.build(root.balancer)
    balancer.attach(model)
    optimizer = OPTIMIZERS.build(root.optimizer, model)
    ids = torch.randint(0, model.vocab_size, (4, 33))
    losses, metrics = [], {}
    for _ in range(steps):
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten())
        aux = balancer.aux_loss(model)
        optimizer.zero_grad(set_to_none=True)
        (loss if aux is None else loss + aux).backward()
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert not missing, f"parameters without a gradient (unused in forward): {missing}"
        optimizer.step()
        metrics = balancer.step(model)
        losses.append(loss.item())
    return model, losses, metrics


def lr_multiplier(step: int, warmup: int, total: int, schedule: str, min_ratio: float = 0.1, **fields) -> float:
    """The registered schedule ``schedule``'s learning-rate multiplier at ``step`` (its other fields:
    ``fields``; ``min_ratio`` for the schedules that decay)."""
    from components.optim.schedules.base import SCHEDULES, DecayingScheduleConfig

    config_cls = SCHEDULES.get(schedule).config_cls
    if issubclass(config_cls, DecayingScheduleConfig):
        fields["min_lr_ratio"] = min_ratio
    return SCHEDULES.build(config_cls(**fields)).multiplier(step, warmup, total)


def assert_same_bits_on_one_and_two_threads(run) -> None:
    """``run()`` (a tuple of tensors) gives the same bits on one thread as on two."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two):
        assert torch.equal(a, b)
