"""Adding a component is one module plus one YAML file, nothing else: in a copy of the repository, a new
mixer, a new balancer and a new residual scheme are written that way, ``train.py`` trains with all three,
and the registry-driven tests (contracts, defaults, registry) collect and pass them."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO, run_train

MIXER = '''"""Causal token shift: each position mixes its own input with the previous token's, then projects."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from components.config import ComponentConfig
from components.mixers.base import Mixer
from components.nn.build_context import BuildContext
from components.registry import MIXERS


@dataclass
class CausalShiftConfig(ComponentConfig):
    name: str = "causal_shift"


@MIXERS.register("causal_shift", CausalShiftConfig)
class CausalShift(Mixer):
    """Token shift: o_proj(m * x_t + (1 - m) * x_(t-1)), with a learned per-channel mix m."""

    def __init__(self, cfg: CausalShiftConfig, ctx: BuildContext):
        super().__init__(cfg, ctx)
        d = ctx.d_model
        self.mix = nn.Parameter(torch.full((d,), 0.5))
        self.o_proj = nn.Linear(d, d, bias=False)
        nn.init.normal_(self.o_proj.weight, std=ctx.out_init_std or ctx.init_std)

    def new_cache(self, batch_size: int) -> Any:
        return SimpleNamespace(last=None)  # the previous token's input [B, 1, d]

    def forward(self, x: torch.Tensor, state: Any = None, offset: int = 0, segments: Any = None) -> torch.Tensor:
        first = state.last if state is not None and state.last is not None else torch.zeros_like(x[:, :1])
        prev = torch.cat([first, x[:, :-1]], dim=1)  # [B, T, d]
        if segments is not None:  # the previous token counts only inside the same document
            prev = prev * segments.same_segment_as_shifted(1)  # [B, T, 1]
        if state is not None:
            state.last = x[:, -1:]
        return self.o_proj(self.mix * x + (1 - self.mix) * prev)
'''

BALANCER = '''"""Records every routed layer's expert loads after each step; no loss term, no bias update."""

from __future__ import annotations

from dataclasses import dataclass

from components.balancers.base import Balancer
from components.balancers.load_stats import find_routers, reduced_loads
from components.config import ComponentConfig
from components.registry import BALANCERS


@dataclass
class LoadRecorderConfig(ComponentConfig):
    name: str = "load_recorder"


@BALANCERS.register("load_recorder", LoadRecorderConfig)
class LoadRecorder(Balancer):
    """Keeps the per-step expert loads of every routed layer (for inspection)."""

    def __init__(self, cfg: LoadRecorderConfig):
        super().__init__(cfg)
        self.history: list = []

    def step(self, model):
        routers = find_routers(model)
        if routers:
            loads, _ = reduced_loads(routers)
            self.history.append(loads.tolist())
        metrics = super().step(model)
        metrics["recorded_steps"] = float(len(self.history))
        return metrics
'''

RESIDUAL = '''"""Pre-norm residual with a scaled update: x <- x + scale * sublayer(norm(x))."""

from __future__ import annotations

from dataclasses import dataclass

from components.config import ComponentConfig
from components.registry import RESIDUALS
from components.residual.base import ResidualScheme


@dataclass
class ScaledResidualConfig(ComponentConfig):
    name: str = "scaled"
    scale: float = 0.5


@RESIDUALS.register("scaled", ScaledResidualConfig)
class ScaledResidual(ResidualScheme):
    """Every sublayer adds a fixed fraction of its output to the running sum."""

    def start(self, x0):
        return x0

    def read(self, state, sublayer, norm=None):
        return state if norm is None else norm(state)

    def write(self, state, sublayer, out):
        return state + self.cfg.scale * out

    def finish(self, state, norm=None):
        return state if norm is None else norm(state)
'''

NEW_FILES = {
    "components/mixers/causal_shift.py": MIXER,
    "conf/mixer/causal_shift.yaml": (
        "# Causal token shift (components/mixers/causal_shift.py).\ndefaults:\n  - causal_shift_schema\n  - _self_\n"
    ),
    "components/balancers/load_recorder.py": BALANCER,
    "conf/balancer/load_recorder.yaml": (
        "# Expert-load recorder (components/balancers/load_recorder.py).\n"
        "defaults:\n  - load_recorder_schema\n  - _self_\n"
    ),
    "components/residual/scaled.py": RESIDUAL,
    "conf/residual/scaled.yaml": (
        "# Scaled residual updates (components/residual/scaled.py).\ndefaults:\n  - scaled_schema\n  - _self_\n"
    ),
}
NEW_NAMES = ("causal_shift", "load_recorder", "scaled")


def _tree_hashes(root: Path) -> dict[str, str]:
    out = {}
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and "__pycache__" not in rel and not rel.startswith(("outputs/", ".pytest_cache/")):
            out[rel] = hashlib.sha1(path.read_bytes()).hexdigest()
    return out


def _copy_repository(dest: Path) -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    )
    for rel in listed.stdout.splitlines():
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_bytes(src.read_bytes())


def repository_copy_with(tmp_path: Path, new_files: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """A copy of the repository under ``tmp_path`` with ``new_files`` (none of which may exist) written
    in, and the copy's file hashes from before they were written."""
    copy = tmp_path / "repo"
    _copy_repository(copy)
    before = _tree_hashes(copy)
    for rel, text in new_files.items():
        assert not (copy / rel).exists(), rel
        (copy / rel).write_text(text)
    return copy, before


def test_one_module_and_one_yaml_add_a_component(tmp_path):
    copy, before = repository_copy_with(tmp_path, NEW_FILES)

    # train.py trains with all three (a routed FFN, so the balancer has loads to record)
    out = tmp_path / "out"
    proc = run_train(
        "mixer=causal_shift",
        "balancer=load_recorder",
        "residual=scaled",
        "ffn=moe",
        "ffn.num_experts=4",
        "model=tiny",
        "data.seq_len=32",
        "data.batch_size=4",
        "data.val_tokens=256",
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
        "trainer.log_every_n_steps=1",
        "trainer.compile=false",
        "trainer.enable_progress_bar=false",
        "logger=csv",
        f"output_root={out}",
        "name=new_parts",
        cwd=copy,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "new_parts" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["val"]["loss"] > 0
    metrics = [json.loads(line) for line in (out / "new_parts" / "metrics.jsonl").read_text().splitlines()]
    assert any(m.get("balance/recorded_steps") == 3.0 for m in metrics), "the new balancer's step() ran every step"

    # the registry-driven tests collect the three new members and pass
    selection = ["tests/contracts", "tests/test_defaults.py", "tests/test_registry.py", "-k", " or ".join(NEW_NAMES)]
    # one process (-n 0): a test run of a few dozen tests does not pay for two more workers' start-up;
    # -v lists every test it ran, so the run shows that the new members were collected
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-v", *selection]
    ran = subprocess.run(cmd, cwd=copy, capture_output=True, text=True, timeout=600)
    for expected in (
        "test_mixers.py::test_is_causal[causal_shift]",
        "test_mixers.py::test_cached_decoding_equals_full_pass[5-4-causal_shift]",
        "test_mixers.py::test_trains[causal_shift]",
        "test_balancers.py::test_trains_a_routed_model_and_reports_balance[load_recorder]",
        "test_residuals.py::test_is_causal_and_decodes_from_the_cache[scaled]",
        "test_residuals.py::test_trains[scaled]",
        "test_defaults.py::test_command_line_member_equals_its_dataclass_defaults[mixer=causal_shift]",
    ):
        assert f"{expected} PASSED" in ran.stdout, f"{expected} did not run and pass:\n{ran.stdout[-3000:]}"
    assert ran.returncode == 0, ran.stdout[-4000:]
    passed = int(re.search(r"(\d+) passed", ran.stdout).group(1))
    assert passed >= 14, ran.stdout[-2000:]  # 6 mixer, 2 balancer, 3 residual contract tests, 3 default checks

    # nothing but the six new files differs from the repository
    after = _tree_hashes(copy)
    added = set(after) - set(before)
    changed = {rel for rel in before if after.get(rel) != before[rel]}
    assert added == set(NEW_FILES) and not changed, (sorted(added), sorted(changed))
