"""The largest-activation probe: its numbers equal the GLU intermediates and FFN outputs recomputed by
hand, SiTU-GLU's softcaps bound what SwiGLU lets grow, and a compiled model is probed as it runs."""

from __future__ import annotations

import pytest
import torch

from components.activation_probe import largest_activations
from tests.helpers import tiny_model


def _by_hand(model, x: torch.Tensor) -> dict[str, float]:
    """Each dense FFN's input captured on the way, then act(gate x, up x) and the FFN output recomputed."""
    inputs = []
    handles = [layer.ffn.register_forward_pre_hook(lambda m, a: inputs.append((m, a[0]))) for layer in model.layers]
    with torch.no_grad():
        model.hidden_states(x)
        for handle in handles:
            handle.remove()
        glu = [m.act(m.gate_proj(h), m.up_proj(h)).abs().max() for m, h in inputs]
        out = [m(h).abs().max() for m, h in inputs]
    return {"glu_max": float(max(glu)), "ffn_out_max": float(max(out))}


@pytest.mark.parametrize("activation", ["swiglu", "situ_glu"])
def test_probe_equals_the_intermediates_recomputed_by_hand(activation):
    model = tiny_model("mixer=gqa", "ffn=dense", f"ffn.activation={activation}", "data=corpus")
    x = torch.randint(0, 256, (2, 24))
    # the probe reports in fp32, as it is logged
    assert largest_activations(model, x) == pytest.approx(_by_hand(model, x), rel=1e-7)


def test_situ_glu_softcaps_bound_what_swiglu_lets_grow():
    """With the FFN input weights scaled up 200x, SwiGLU's intermediate grows far past 100; SiTU-GLU's
    stays below beta * linear_beta = 4 * 25 (docs/k3.md §5)."""
    largest = {}
    for activation in ("swiglu", "situ_glu"):
        model = tiny_model("mixer=gqa", "ffn=dense", f"ffn.activation={activation}", "data=corpus")
        with torch.no_grad():
            for layer in model.layers:
                layer.ffn.gate_proj.weight.mul_(200)
                layer.ffn.up_proj.weight.mul_(200)
        largest[activation] = largest_activations(model, torch.randint(0, 256, (2, 24)))["glu_max"]
    assert largest["swiglu"] > 1000
    assert 50 < largest["situ_glu"] < 100


def test_routed_experts_and_shared_experts_are_probed():
    """k3_tiny: every GLU holder (dense FFN, shared experts, routed experts) is seen; replacing the routed
    experts' activation by one that returns a marked value shows in glu_max."""
    model = tiny_model("experiment=k3_tiny")
    x = torch.randint(0, 256, (2, 32))
    routed = [m for m in model.modules() if type(m).__name__ == "RoutedExperts"]
    assert routed
    base = largest_activations(model, x)["glu_max"]
    originals = [m.act for m in routed]
    for m, act in zip(routed, originals):
        m.act = lambda a, b, act=act: act(a, b) * 0 + 1234.5
    assert largest_activations(model, x)["glu_max"] == 1234.5
    assert [m.act for m in routed] != originals  # the probe put back what it found
    for m, act in zip(routed, originals):
        m.act = act
    assert largest_activations(model, x)["glu_max"] == base > 0


def test_a_layer_compiled_model_is_probed_eagerly_with_the_same_numbers():
    model = tiny_model("mixer=gqa", "ffn=dense", "data=corpus").float()
    x = torch.randint(0, 256, (2, 16))
    eager = largest_activations(model, x)
    for layer in model.layers:
        layer.compile(dynamic=False, backend="aot_eager")
    with torch.no_grad():
        model.hidden_states(x)  # compiled once
    assert largest_activations(model, x) == pytest.approx(eager, rel=1e-6)
