"""Everything tests share: composing configs, building small models, running train.py, fault injection."""

from __future__ import annotations

import atexit
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from components.model import Decoder
from runtime.config import RootConfig
from runtime.launch import compose, strip_hydra
from runtime.validation import validate
from tests.fork_server import ForkedRun, ForkServer

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


_FORK_SERVER = ForkServer()
atexit.register(_FORK_SERVER.stop)


class _PlainRun:
    """A run in a fresh interpreter, with ``ForkedRun``'s ``poll``, ``returncode`` and ``wait``."""

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


def start_python(*command: str, env: dict | None = None, cwd: Path = REPO) -> ForkedRun | _PlainRun:
    """``python command...`` (a script, ``-m module`` or ``-c code``, and its arguments) started in a process of its own
    in ``cwd``, with this checkout (or ``cwd``) on PYTHONPATH; ``.wait(timeout)`` gives what ``subprocess.run``
    would. Where it runs this checkout's code the process is forked from a server that has already imported
    what a training run imports (tests/fork_server.py), which saves most of a short run's time; a fresh
    interpreter otherwise, or everywhere with ``K3_TEST_FORK=0``."""
    full_env = {**os.environ, "PYTHONPATH": str(cwd), **(env or {})}
    if Path(cwd).resolve() == REPO and os.environ.get("K3_TEST_FORK", "1") != "0":
        forked = _FORK_SERVER.start(list(command), REPO, full_env)
        if forked is not None:
            return forked
    return _PlainRun([sys.executable, *command], cwd, full_env)


def run_python(
    *command: str, timeout: float = 600, env: dict | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """``python command...`` run to its end (``start_python``)."""
    return start_python(*command, env=env, cwd=cwd).wait(timeout)


def start_train(*overrides: str, env: dict | None = None, cwd: Path = REPO) -> ForkedRun | _PlainRun:
    """``python train.py overrides...`` started from the repository root (or ``cwd``): ``start_python``."""
    return start_python(str(Path(cwd) / "train.py"), *overrides, env=env, cwd=cwd)


def run_train(
    *overrides: str, timeout: float = 600, env: dict | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """``python train.py overrides...`` run to its end (``start_python``)."""
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
    from runtime.config import to_container
    from runtime.load_run import CONFIG_KEY, MODULE_PREFIX

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
