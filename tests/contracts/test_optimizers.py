"""Every registered optimizer (found through the registry) against the contract of
``components/optim/base.py``: it builds from its config on a tiny model, a step changes the parameters,
weight decay follows ``param_groups.py``, and its state_dict round-trips so that training resumes
exactly."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F

from components.model import Decoder
from components.optim.base import OptimizerConfig
from components.optim.param_groups import decayed_parameter_ids, unique_trainable
from components.registry import OPTIMIZERS
from tests.helpers import compose_root

NAMES = OPTIMIZERS.names()


def built(name: str, *overrides: str) -> tuple[OptimizerConfig, Decoder, torch.optim.Optimizer]:
    root = compose_root("model=tiny", f"optimizer={name}", *overrides)
    torch.manual_seed(0)
    model = Decoder(root.decoder_config()).train()
    return root.optimizer, model, OPTIMIZERS.build(root.optimizer, model, key="optimizer")


def take_steps(model: Decoder, optimizer: torch.optim.Optimizer, steps: int, seed: int = 1) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.vocab_size, (2, 17), generator=gen)  # [B, T + 1]
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", NAMES)
def test_builds_over_every_trainable_parameter_once_at_the_config_lr(name):
    cfg, model, optimizer = built(name)
    assert isinstance(cfg, OptimizerConfig) and isinstance(optimizer, torch.optim.Optimizer)
    held = [id(p) for group in optimizer.param_groups for p in group["params"]]
    assert sorted(held) == sorted(id(p) for _, p in unique_trainable(model))
    assert all(group["lr"] == cfg.lr for group in optimizer.param_groups)


@pytest.mark.parametrize("name", NAMES)
def test_a_step_changes_the_parameters(name):
    _, model, optimizer = built(name)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    take_steps(model, optimizer, 1)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert changed, "one optimizer step left every parameter unchanged"
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_weight_decay_follows_the_parameter_groups(name):
    cfg, model, optimizer = built(name, "optimizer.weight_decay=0.05")
    decayed = decayed_parameter_ids(model)
    for group in optimizer.param_groups:
        for p in group["params"]:
            expected = cfg.weight_decay if id(p) in decayed else 0.0
            assert group["weight_decay"] == expected, f"a {tuple(p.shape)} parameter decays by {group['weight_decay']}"


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trips_and_resumes_identically(name):
    _, model, optimizer = built(name)
    take_steps(model, optimizer, 2)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)  # what a checkpoint holds

    _, resumed_model, resumed = built(name)
    resumed_model.load_state_dict(copy.deepcopy(model.state_dict()))
    resumed.load_state_dict(state)
    assert take_steps(resumed_model, resumed, 2, seed=2) == take_steps(model, optimizer, 2, seed=2)
    for (n, a), (_, b) in zip(model.named_parameters(), resumed_model.named_parameters()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("name", NAMES)
def test_step_runs_the_closure_it_is_given(name):
    """Lightning hands forward and backward to ``step`` as a closure."""
    _, model, optimizer = built(name)
    ids = torch.randint(0, model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))  # [B, T + 1]

    def closure():
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        return loss

    assert torch.isfinite(optimizer.step(closure))
