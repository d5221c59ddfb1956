"""MoE FFNs: K3 parameter names/shapes/counts (docs/k3.md §1.3, 4.2, 4.3), Stable LatentMoE scale invariance
(10.10 item 9)."""

import pytest
import torch

from components.ffn.moe import LatentMoEConfig, MoEFFNConfig, StableLatentMoEConfig
from components.nn.build_context import BuildContext
from components.registry import FFNS, ConfigError
from runtime.compose import compose, strip_hydra
from runtime.validation import validate

VARIANTS = [MoEFFNConfig, LatentMoEConfig, StableLatentMoEConfig]


def _build(cfg, d=64, seed=0, **kw):
    torch.manual_seed(seed)
    return FFNS.build(cfg, BuildContext(d, layer_idx=1, out_init_std=0.01), **kw)


@pytest.mark.parametrize("cfg_cls", VARIANTS)
@pytest.mark.parametrize("activation", ["situ_glu", "swiglu", "glu"])
def test_forward_backward_shapes(cfg_cls, activation):
    ffn = _build(cfg_cls(activation=activation))
    x = torch.randn(2, 5, 64, requires_grad=True)
    y = ffn(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    y.square().sum().backward()
    assert ffn.gate.weight.grad is not None and ffn.gate.weight.grad.abs().sum() > 0  # router learns via the weights
    assert ffn.experts.w1.grad is not None
    assert ffn.gate.tokens == 10


def test_k3_parameter_names():
    ffn = _build(
        StableLatentMoEConfig(num_experts=8, top_k=2, expert_hidden_dim=16, latent_dim=32, num_shared_experts=2)
    )
    shapes = {k: tuple(v.shape) for k, v in ffn.state_dict().items()}
    assert shapes == {
        "gate.weight": (8, 64),
        "gate.e_score_correction_bias": (8,),
        "routed_expert_down_proj.weight": (32, 64),
        "experts.w1": (8, 16, 32),
        "experts.w3": (8, 16, 32),
        "experts.w2": (8, 32, 16),
        "routed_expert_norm.weight": (32,),
        "routed_expert_up_proj.weight": (64, 32),
        "shared_experts.gate_proj.weight": (32, 64),
        "shared_experts.up_proj.weight": (32, 64),
        "shared_experts.down_proj.weight": (64, 32),
    }
    assert ffn.routed_expert_norm.eps == 1e-5
    full = _build(MoEFFNConfig(num_shared_experts=0))
    assert full.shared_experts is None
    assert not any(k.startswith(("routed_expert", "shared_experts")) for k in full.state_dict())


def test_k3_sized_stable_latent_moe_on_meta():
    """Spec 1.1/1.3: 896 experts, top-16, m 3072, d 7168, latent 3584, 2 shared -> one GLU of 6144."""
    cfg = StableLatentMoEConfig(
        num_experts=896, top_k=16, expert_hidden_dim=3072, latent_dim=3584, num_shared_experts=2
    )
    with torch.device("meta"):
        ffn = FFNS.build(cfg, BuildContext(7168, layer_idx=1, out_init_std=0.02))
    shapes = {k: tuple(v.shape) for k, v in ffn.state_dict().items()}
    assert shapes == {
        "gate.weight": (896, 7168),
        "gate.e_score_correction_bias": (896,),
        "routed_expert_down_proj.weight": (3584, 7168),
        "experts.w1": (896, 3072, 3584),
        "experts.w3": (896, 3072, 3584),
        "experts.w2": (896, 3584, 3072),
        "routed_expert_norm.weight": (3584,),
        "routed_expert_up_proj.weight": (7168, 3584),
        "shared_experts.gate_proj.weight": (6144, 7168),
        "shared_experts.up_proj.weight": (6144, 7168),
        "shared_experts.down_proj.weight": (7168, 6144),
    }
    assert ffn.experts.expert_params() == 33_030_144
    n_params = sum(p.numel() for p in ffn.parameters())
    bias = ffn.gate.e_score_correction_bias.numel()  # a parameter in the K3 reference, a buffer here
    assert n_params + bias == 29_784_936_832
    assert ffn.active_params() + bias == 718_410_112


@pytest.mark.parametrize("c", [0.1, 3.0, 100.0])
def test_stable_latent_moe_is_invariant_to_expert_output_scale(c):
    """Scaling every routed expert output by c > 0 leaves y - Shared(x) unchanged (RMSNorm, eps -> 0)."""
    ffn = _build(StableLatentMoEConfig()).eval()
    ffn.routed_expert_norm.eps = 0.0
    x = torch.randn(3, 7, 64, dtype=torch.float32)
    with torch.no_grad():
        routed = ffn(x) - ffn.shared_experts(x)
        ffn.experts.w2.mul_(c)
        routed_c = ffn(x) - ffn.shared_experts(x)
    torch.testing.assert_close(routed_c, routed, rtol=1e-5, atol=1e-6)


def test_plain_latent_moe_is_not_scale_invariant():
    ffn = _build(LatentMoEConfig()).eval()
    x = torch.randn(2, 4, 64)
    with torch.no_grad():
        a = ffn.routed(x)
        ffn.experts.w2.mul_(3.0)
        torch.testing.assert_close(ffn.routed(x), 3.0 * a, rtol=1e-5, atol=1e-7)


def test_router_reads_full_width_x():
    ffn = _build(LatentMoEConfig())
    assert ffn.gate.weight.shape == (8, 64) and ffn.experts.d_in == 32


def test_active_params_and_decoder_accounting():
    root = validate(strip_hydra(compose(["model=tiny", "ffn=stable_latent_moe", "balancer=none"])))
    from components.model import Decoder

    model = Decoder(root.decoder_config())
    ffn = model.layers[0].ffn
    cfg = root.ffn
    d, dl, m = 64, 32, cfg.expert_hidden_dim
    expected = 8 * d + 2 * d * dl + dl + cfg.top_k * 3 * dl * m + 3 * d * m * cfg.num_shared_experts
    assert ffn.active_params() == expected
    inactive = len(model.layers) * (cfg.num_experts - cfg.top_k) * 3 * dl * m
    head = model.lm_head.weight.numel() if model.lm_head.weight is model.embed.weight else 0  # tied: counted once
    assert model.active_params() == model.num_params(exclude_embedding=True) + head - inactive


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["ffn=moe", "ffn.top_k=9"], "ffn.top_k"),
        (["ffn=moe", "ffn.top_k=0"], "ffn.top_k"),
        (["ffn=moe", "ffn.num_experts=0"], "ffn.num_experts"),
        (["ffn=latent_moe", "ffn.latent_dim=0"], "ffn.latent_dim"),
        (["ffn=stable_latent_moe", "ffn.router_activation=relu"], "ffn.router_activation"),
        (["ffn=moe", "ffn.capacity_factor=0"], "ffn.capacity_factor"),
        (["ffn=moe", "ffn.activation=gelu"], "ffn.activation"),
        (["ffn=moe", "ffn.dispatch=cuda"], "ffn.dispatch"),
        (["ffn=moe", "ffn.num_shared_experts=-1"], "ffn.num_shared_experts"),
    ],
)
def test_validation_names_full_keys(overrides, key):
    with pytest.raises(ConfigError) as err:
        validate(strip_hydra(compose(["model=tiny", *overrides])))
    assert err.value.key == key


def test_bf16_autocast_forward():
    ffn = _build(StableLatentMoEConfig())
    x = torch.randn(2, 8, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ffn(x)
    assert torch.isfinite(y.float()).all()
    torch.testing.assert_close(y.float(), ffn(x), rtol=5e-2, atol=5e-2)
