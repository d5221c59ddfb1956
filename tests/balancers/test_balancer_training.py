"""A tiny MoE decoder composed through the config system trains a few CPU steps with each balancer."""

import pytest
import torch
import torch.nn.functional as F

from components.ffn.router import Router
from components.model import Decoder
from components.registry import BALANCERS
from runtime.compose import compose, strip_hydra
from runtime.validation import validate


def _train(ffn, balancer, steps=3, micro_batches=2, extra=()):
    root = validate(strip_hydra(compose(["model=tiny", f"ffn={ffn}", f"balancer={balancer}", *extra])))
    torch.manual_seed(0)
    model = Decoder(root.decoder_config()).train()
    bal = BALANCERS.build(root.balancer)
    if hasattr(bal, "attach"):
        bal.attach(model)
    routers = [m for m in model.modules() if isinstance(m, Router)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    biases, history, aux_terms = [torch.stack([r.e_score_correction_bias.clone() for r in routers])], [], []
    for _ in range(steps):
        for _ in range(micro_batches):
            ids = torch.randint(0, root.model.vocab_size, (2, 17), generator=g)
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()) / micro_batches
            aux = bal.aux_loss(model)
            if aux is not None:
                aux_terms.append(float(aux.detach()))
                loss = loss + aux / micro_batches
            loss.backward()
        opt.step()
        opt.zero_grad()
        history.append(bal.step(model))
        biases.append(torch.stack([r.e_score_correction_bias.clone() for r in routers]))
    return model, routers, biases, history, aux_terms


@pytest.mark.parametrize("balancer", ["none", "aux_loss", "signsgd", "qb"])
def test_tiny_stable_latent_moe_trains_with_each_balancer(balancer):
    model, routers, biases, history, aux_terms = _train("stable_latent_moe", balancer)
    assert len(routers) == model.config.model.n_layers
    moved = not torch.equal(biases[-1], biases[0])
    assert moved == (balancer in ("signsgd", "qb"))
    for metrics in history:
        assert {"maxvio/mean", "maxvio/max"} <= set(metrics)
        assert {f"maxvio/layer_{i}" for i in range(model.config.model.n_layers)} <= set(metrics)
        assert all(v >= 0 for v in metrics.values())
    assert (len(aux_terms) == 6) == (balancer == "aux_loss")
    if balancer == "qb":
        assert torch.allclose(biases[-1].mean(dim=1), torch.zeros(len(routers)), atol=1e-6)  # centred
    assert all(r.tokens == 0 for r in routers)  # statistics consumed by the step
    sd = model.state_dict()
    assert torch.equal(sd["layers.0.ffn.gate.e_score_correction_bias"], biases[-1][0])


@pytest.mark.parametrize("ffn", ["moe", "latent_moe"])
def test_other_variants_train_with_qb(ffn):
    _, _, biases, history, _ = _train(ffn, "qb", steps=2, micro_batches=1, extra=["balancer.estimator=exact"])
    assert not torch.equal(biases[-1], biases[0])
    assert "maxvio/max" in history[-1]
