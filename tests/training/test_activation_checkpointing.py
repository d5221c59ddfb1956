"""``trainer.activation_checkpointing``: each decoder layer is recomputed in backward, with the loss,
gradients, router statistics and balancer update of the plain model, and the same parameter names."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from components.balancers.load_stats import find_routers
from components.model import Decoder
from components.registry import BALANCERS, DATASETS, OPTIMIZERS
from tests.helpers import FAST, compose_root, metric_rows, only_run_dir, run_train

K3_TINY = (
    "experiment=k3_tiny",
    "model.mtp_depth=0",
)  # KDA x 3 + MLA, dense layer 0 then Stable LatentMoE, QB, block AttnRes; the
# checkpointed decoder layers only (MTP depths run beside them in training, not in these forwards)


def _model(root, checkpointing: bool) -> tuple[Decoder, object]:
    torch.manual_seed(0)  # same weights for both
    model = Decoder(root.decoder_config()).train()
    balancer = BALANCERS.build(root.balancer)
    balancer.attach(model)
    model.set_activation_checkpointing(checkpointing)
    return model, balancer


def _one_step(root, checkpointing: bool, micro_batches: int = 2) -> dict:
    """Two micro-batches accumulated, then the balancer's step: everything the step produced."""
    model, balancer = _model(root, checkpointing)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(micro_batches):
        ids = torch.randint(0, model.vocab_size, (2, 33), generator=gen)
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten())
        aux = balancer.aux_loss(model)
        (loss if aux is None else loss + aux).backward()
        losses.append(loss.detach())
    routers = find_routers(model)
    stats = [(r.tokens, r.load.clone(), None if r.hist is None else r.hist.clone()) for r in routers]
    metrics = balancer.step(model)
    return {
        "losses": torch.stack(losses),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "stats": stats,
        "bias": [r.e_score_correction_bias.clone() for r in routers],
        "metrics": metrics,
    }


@pytest.mark.parametrize("balancer", ["qb", "aux_loss"])  # aux_loss: its loss reads router scores saved in forward
def test_checkpointing_keeps_loss_gradients_and_router_statistics(balancer):
    root = compose_root(*K3_TINY, f"balancer={balancer}")
    plain, ckpt = _one_step(root, False), _one_step(root, True)
    torch.testing.assert_close(ckpt["losses"], plain["losses"], rtol=0, atol=1e-6)
    assert set(ckpt["grads"]) == set(plain["grads"]) and len(plain["grads"]) > 50
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(ckpt["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert plain["stats"], "k3_tiny has routed layers"
    for (tokens, load, hist), (tokens_c, load_c, hist_c) in zip(plain["stats"], ckpt["stats"]):
        assert tokens_c == tokens == 2 * 2 * 32  # every token counted once, not once more per recomputation
        assert torch.equal(load_c, load)
        assert (hist is None and hist_c is None) or torch.equal(hist_c, hist)
    for b, b_c in zip(plain["bias"], ckpt["bias"]):
        assert torch.equal(b_c, b)
    assert ckpt["metrics"] == plain["metrics"]


def test_router_statistics_would_double_without_the_recompute_guard(monkeypatch):
    """The statistics check above can fail: a router that also records in the recomputation counts twice."""
    import components.ffn.router as router_module

    monkeypatch.setattr(router_module, "recomputing", lambda: False)
    root = compose_root(*K3_TINY)
    stats = _one_step(root, True)["stats"]
    assert all(tokens == 2 * 2 * 2 * 32 for tokens, _, _ in stats)


def _forward_backward_counts(model: Decoder) -> tuple[list[int], int]:
    """Mixer calls per layer over one forward + backward, and bytes autograd saved outside checkpointed calls."""
    calls = [0] * len(model.layers)
    hooks = [
        layer.mixer.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, layer in enumerate(model.layers)
    ]
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    ids = torch.randint(0, model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids).float().square().mean()
    loss.backward()
    for h in hooks:
        h.remove()
    return calls, saved[0]


def test_checkpointing_recomputes_each_layer_and_saves_less():
    root = compose_root(*K3_TINY)
    plain_calls, plain_saved = _forward_backward_counts(_model(root, False)[0])
    model = _model(root, True)[0]
    ckpt_calls, ckpt_saved = _forward_backward_counts(model)
    assert plain_calls == [1] * len(plain_calls)
    assert ckpt_calls == [2] * len(ckpt_calls)  # forward, then again in backward
    assert ckpt_saved < plain_saved / 2, (ckpt_saved, plain_saved)
    model.eval()  # evaluation is not checkpointed, even with gradients
    eval_calls, _ = _forward_backward_counts(model)
    assert eval_calls == [1] * len(eval_calls)


def test_names_state_dict_and_optimizer_groups_are_unchanged():
    root = compose_root(*K3_TINY)
    plain, ckpt = _model(root, False)[0], _model(root, True)[0]
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    assert not any("_checkpoint_wrapped_module" in k for k in ckpt.state_dict())
    ckpt.load_state_dict(plain.state_dict())  # strict: a checkpoint of either loads into the other
    groups = [OPTIMIZERS.build(root.optimizer, m).param_groups for m in (plain, ckpt)]

    def layout(param_groups):
        return [(len(g["params"]), [tuple(p.shape) for p in g["params"]]) for g in param_groups]

    assert layout(groups[1]) == layout(groups[0])


def test_lightning_module_turns_it_on_in_configure_model():
    from runtime.lit_module import LanguageModelModule

    root = compose_root("model=tiny", "data=mqar", "trainer.activation_checkpointing=true")
    module = LanguageModelModule(root, DATASETS.build(root.data, root.seed))
    assert not any(layer.activation_checkpointing for layer in module.model.layers)
    module.configure_model()
    assert all(layer.activation_checkpointing for layer in module.model.layers)
    off = compose_root("model=tiny", "data=mqar")
    module = LanguageModelModule(off, DATASETS.build(off.data, off.seed))
    module.configure_model()
    assert not any(layer.activation_checkpointing for layer in module.model.layers)


@pytest.mark.slow  # two train.py runs; the in-process tests above check loss and gradients equal
def test_training_runs_log_the_same_losses_with_and_without(tmp_path, train_run):
    """Through Lightning: one process without and with checkpointing (trained in this one), and FSDP2 on two
    processes with it (each layer recomputed inside its sharded forward; Lightning starts its second rank by
    running the command again, so it is train.py in processes of their own): the same losses."""
    common = [
        *FAST,
        *K3_TINY,
        "trainer.max_steps=3",
        "trainer.val_check_interval=1000",
        "logger=csv",
        "trainer.precision=32-true",
    ]
    fsdp2 = [
        "trainer=fsdp2",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.precision=32-true",
        "trainer.compile=false",
        "trainer.max_time_minutes=null",
        "trainer.checkpoint_every_n_steps=3",
    ]
    runs = {
        "plain": ["trainer.activation_checkpointing=false"],
        "checkpointed": ["trainer.activation_checkpointing=true"],
        "fsdp2": ["trainer.activation_checkpointing=true", *fsdp2],
    }
    train, val = {}, {}
    for name, extra in runs.items():
        out = tmp_path / name
        if name == "fsdp2":
            result = run_train(*common, *extra, f"output_root={out}", env={"OMP_NUM_THREADS": "1"})
            assert result.returncode == 0, result.stderr[-3000:]
        else:
            train_run(*common, *extra, f"output_root={out}", threads=1)
        records = metric_rows(only_run_dir(out))
        train[name] = [r["train/loss"] for r in records if "train/loss" in r]
        val[name] = [r["val/loss"] for r in records if "val/loss" in r]
    assert len(train["plain"]) == 3 and len(val["plain"]) == 1
    assert train["checkpointed"] == pytest.approx(train["plain"], rel=0, abs=1e-6)
    assert val["checkpointed"] == pytest.approx(val["plain"], rel=0, abs=1e-6)
    assert train["fsdp2"] == pytest.approx(train["plain"], rel=0, abs=1e-5)  # same global batch, sharded
