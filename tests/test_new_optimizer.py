"""Adding an optimizer is one module plus one YAML file, nothing else: in a copy of the repository Lion
is written that way, ``train.py`` trains with ``optimizer=lion``, and the optimizer contract tests
collect and pass it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import run_train
from tests.test_new_component import _tree_hashes, repository_copy_with

LION = '''"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): the sign of an interpolated
momentum, with decoupled weight decay on the matrices param_groups.py decays."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from components.optim.base import OptimizerConfig
from components.optim.param_groups import adamw_param_groups, unique_trainable
from components.registry import OPTIMIZERS


class Lion(torch.optim.Optimizer):
    def __init__(self, param_groups, lr: float, betas: tuple[float, float], weight_decay: float):
        super().__init__(list(param_groups), dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # Lightning passes forward and backward as the closure
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                update = m.lerp(p.grad, 1 - beta1).sign_()
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(update, alpha=-group["lr"])
                m.lerp_(p.grad, 1 - beta2)
        return loss


@dataclass
class LionConfig(OptimizerConfig):
    name: str = "lion"
    # sign updates have unit size per entry: a tenth of AdamW's rate (the paper's advice)
    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])


@OPTIMIZERS.register("lion", LionConfig, "Lion: the sign of an interpolated momentum.")
def build_lion(cfg: LionConfig, model: nn.Module) -> Lion:
    groups = adamw_param_groups(model, unique_trainable(model), cfg.weight_decay)
    return Lion(groups, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
'''

NEW_FILES = {
    "components/optim/lion.py": LION,
    "conf/optimizer/lion.yaml": "# Lion (components/optim/lion.py).\ndefaults:\n  - lion_schema\n  - _self_\n",
}


@pytest.mark.slow
def test_one_module_and_one_yaml_add_an_optimizer(tmp_path):
    copy, before = repository_copy_with(tmp_path, NEW_FILES)

    out = tmp_path / "out"
    proc = run_train(
        "optimizer=lion",
        "optimizer.lr=3e-3",
        "optimizer.warmup_steps=2",
        "model=tiny",
        "data.seq_len=32",
        "data.batch_size=4",
        "data.val_tokens=256",
        "trainer.max_steps=6",
        "trainer.val_check_interval=6",
        "trainer.log_every_n_steps=1",
        "trainer.precision=32-true",
        "trainer.compile=false",
        "trainer.enable_progress_bar=false",
        "logger=csv",
        f"output_root={out}",
        "name=lion",
        cwd=copy,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "lion" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["train/loss"] for m in metrics if "train/loss" in m]
    assert len(losses) == 6 and losses[-1] < losses[0], losses

    # the contract tests collect Lion and pass
    selection = ["tests/contracts/test_optimizers.py", "tests/test_defaults.py", "-k", "lion"]
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *selection]
    collected = subprocess.run([*cmd, "--collect-only"], cwd=copy, capture_output=True, text=True, timeout=600)
    for expected in (
        "test_optimizers.py::test_a_step_changes_the_parameters[lion]",
        "test_optimizers.py::test_state_dict_round_trips_and_resumes_identically[lion]",
        "test_optimizers.py::test_weight_decay_follows_the_parameter_groups[lion]",
        "test_defaults.py::test_command_line_member_equals_its_dataclass_defaults[optimizer=lion]",
    ):
        assert expected in collected.stdout, f"{expected} not collected:\n{collected.stdout[-3000:]}"
    ran = subprocess.run(cmd, cwd=copy, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stdout[-4000:]

    # nothing but the two new files differs from the repository
    after = _tree_hashes(copy)
    added = set(after) - set(before)
    changed = {rel for rel in before if after.get(rel) != before[rel]}
    assert added == set(NEW_FILES) and not changed, (sorted(added), sorted(changed))
