"""MLA mixer (docs/k3.md §3.2-3.5, 10.10 item 5-6): K3 shapes, expanded == absorbed, latent-only cache,
causality, U^V folding (ungated) vs the gate, an independent loop reference, and the model-level path."""

import math

import pytest
import torch

from components.mixers.mla import MLA, MLACache, MLAConfig
from components.nn.build_context import BuildContext
from components.registry import ConfigError

D = 40  # deliberately not a multiple of any head dim
SMALL = dict(n_heads=3, q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10)
TIGHT = dict(rtol=0, atol=1e-12)


def _mla(seed=0, dtype=torch.float64, **overrides):
    """A small MLA with weights large enough for peaked softmaxes and non-unit norm gains."""
    torch.manual_seed(seed)
    m = MLA(MLAConfig(**{**SMALL, **overrides}), BuildContext(D, layer_idx=0, init_std=0.3, out_init_std=0.3))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))  # the gains must be applied, and in the right place
    return m.to(dtype)


def _x(B=2, T=9, seed=1, dtype=torch.float64):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


# ------------------------------------------------------------------------------------------------
# Independent reference: docs/k3.md §3.2 steps 1-6 written per head with explicit sums
# ------------------------------------------------------------------------------------------------
def _k3_rmsnorm(x, gain, eps):
    # K3: statistics in (at least) fp32, cast back, then the gain
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * gain


def _rope_pairs(x, positions, theta):
    """Rotate-half RoPE on ``x`` ``[..., T, d]``: pair (i, i + d/2) rotated by ``p * theta^(-2i/d)`` (fp64)."""
    d = x.shape[-1]
    half = d // 2
    out = x.clone()
    for i in range(half):
        ang = positions.to(torch.float64) * theta ** (-2.0 * i / d)  # [T]
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        a, b = x[..., i], x[..., i + half]
        out[..., i] = a * cos - b * sin
        out[..., i + half] = b * cos + a * sin
    return out


def reference_mla(m, x, offset=0):
    """Returns (y [B, T, d], o_lat [B, T, H, kv_lora]) straight from the spec's equations."""
    cfg = m.cfg
    B, T, _ = x.shape
    H, n, rd, vd, r = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    eps = cfg.lora_norm_eps
    P = dict(m.named_parameters())
    # 1. queries
    if cfg.q_lora_rank is not None:
        q = _k3_rmsnorm(x @ P["q_a_proj.weight"].T, P["q_a_layernorm.weight"], eps) @ P["q_b_proj.weight"].T
    else:
        q = x @ P["q_proj.weight"].T
    q = q.view(B, T, H, n + rd)
    # 2. latent and shared key part
    ckv = x @ P["kv_a_proj_with_mqa.weight"].T
    c = _k3_rmsnorm(ckv[..., :r], P["kv_a_layernorm.weight"], eps)  # [B, T, r]
    kr = ckv[..., r:]  # [B, T, rd]
    qr = q[..., n:]
    if cfg.rope:
        pos = torch.arange(offset, offset + T)
        kr = _rope_pairs(kr, pos, cfg.rope_theta)
        qr = _rope_pairs(qr.transpose(1, 2), pos, cfg.rope_theta).transpose(1, 2)
    Wkvb = P["kv_b_proj.weight"]
    heads, lat = [], []
    for h in range(H):
        UK = Wkvb[h * (n + vd) : h * (n + vd) + n]  # [n, r]
        UV = Wkvb[h * (n + vd) + n : (h + 1) * (n + vd)]  # [vd, r]
        o_h = torch.zeros(B, T, vd, dtype=x.dtype)
        l_h = torch.zeros(B, T, r, dtype=x.dtype)
        for t in range(T):
            # 5. logit over s <= t: content part through U^K_h plus the shared part
            scores = torch.stack(
                [(q[:, t, h, :n] * (c[:, s] @ UK.T)).sum(-1) + (qr[:, t, h] * kr[:, s]).sum(-1) for s in range(t + 1)],
                dim=-1,
            ) / math.sqrt(n + rd)  # [B, t+1]
            a = torch.softmax(scores, dim=-1)
            for s in range(t + 1):
                o_h[:, t] += a[:, s, None] * (c[:, s] @ UV.T)
                l_h[:, t] += a[:, s, None] * c[:, s]
        heads.append(o_h)
        lat.append(l_h)
    o = torch.cat(heads, dim=-1)  # [B, T, H*vd]
    # 6. gate on the concatenated head outputs, then o_proj
    if cfg.output_gate:
        o = o * torch.sigmoid(x @ P["g_proj.weight"].T)
    return o @ P["o_proj.weight"].T, torch.stack(lat, dim=2)


# ------------------------------------------------------------------------------------------------
# K3 shapes and numbers
# ------------------------------------------------------------------------------------------------
K3 = dict(
    n_heads=96,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    output_gate=True,
    rope=False,
)


def _k3_meta(**overrides):
    with torch.device("meta"):
        return MLA(MLAConfig(**{**K3, **overrides}), BuildContext(7168, layer_idx=3))


def test_k3_parameter_names_shapes_and_count():
    m = _k3_meta()
    expected = {
        "q_a_proj.weight": (1536, 7168),
        "q_a_layernorm.weight": (1536,),
        "q_b_proj.weight": (96 * 192, 1536),
        "kv_a_proj_with_mqa.weight": (512 + 64, 7168),
        "kv_a_layernorm.weight": (512,),
        "kv_b_proj.weight": (96 * (128 + 128), 512),
        "o_proj.weight": (7168, 96 * 128),
        "g_proj.weight": (96 * 128, 7168),
    }
    assert {k: tuple(p.shape) for k, p in m.named_parameters()} == expected
    count = 7168 * 1536 + 1536 + 1536 * (96 * 192) + 7168 * 576 + 512 + 512 * (96 * 256) + 12288 * 7168 + 7168 * 12288
    assert count == 232_196_096
    assert sum(p.numel() for p in m.parameters()) == 232_196_096
    assert m.q_a_layernorm.eps == m.kv_a_layernorm.eps == 1e-6
    assert m.scale == pytest.approx(1 / math.sqrt(192)) and m.scale == pytest.approx(0.0721688, abs=1e-7)
    # docs/k3.md §3.3 cost table and 3.5 cache
    assert m.cache_numbers_per_token() == 576
    assert m.prefill_macs_per_key() == 30_720
    assert m.decode_macs_per_key() == 104_448
    assert m.flops_per_token(4096) == 2 * 30_720 * 4097 / 2


def test_k3_variants_without_q_lora_and_gate():
    m = _k3_meta(q_lora_rank=None, output_gate=False)
    names = {k: tuple(p.shape) for k, p in m.named_parameters()}
    assert names["q_proj.weight"] == (96 * 192, 7168)
    assert not any(k.startswith(("q_a_", "q_b_", "g_proj")) for k in names)


def test_validate():
    class Root:
        class model:
            d_model = 64

    MLAConfig().validate(Root, "mixer")
    MLAConfig(n_heads=3, q_lora_rank=None).validate(Root, "mixer")  # head dims need not divide d_model
    with pytest.raises(ConfigError) as err:
        MLAConfig(qk_rope_head_dim=7, rope=True).validate(Root, "mixers.mla")
    assert err.value.key == "mixers.mla.qk_rope_head_dim"
    MLAConfig(qk_rope_head_dim=7, rope=False).validate(Root, "mixer")  # odd is fine without rotation
    for field in ("n_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        with pytest.raises(ConfigError) as err:
            MLAConfig(**{field: 0}).validate(Root, "mixer")
        assert err.value.key == f"mixer.{field}"


# ------------------------------------------------------------------------------------------------
# Equivalences (fp64)
# ------------------------------------------------------------------------------------------------
VARIANTS = [
    dict(output_gate=g, rope=r, q_lora_rank=q) for g in (True, False) for r in (False, True) for q in (24, None)
]
IDS = [f"gate{int(v['output_gate'])}-rope{int(v['rope'])}-qlora{int(v['q_lora_rank'] is not None)}" for v in VARIANTS]


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_expanded_equals_absorbed(variant):
    m = _mla(**variant)
    x = _x()
    with torch.no_grad():
        torch.testing.assert_close(m(x, order="absorbed"), m(x, order="expanded"), **TIGHT)


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_matches_loop_reference(variant):
    m = _mla(**variant)
    x = _x(T=7)
    with torch.no_grad():
        ref, _ = reference_mla(m, x)
        # the module's RoPE tables are fp32 (as in K3), the reference rotates in fp64
        tol = dict(rtol=1e-6, atol=1e-6) if variant["rope"] else dict(rtol=1e-10, atol=1e-10)
        for order in ("expanded", "absorbed"):
            torch.testing.assert_close(m(x, order=order), ref, **tol)


def test_expanded_equals_absorbed_fp32():
    m = _mla(dtype=torch.float32)
    x = _x(dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(m(x, order="absorbed"), m(x, order="expanded"), rtol=1e-4, atol=1e-5)


def _run_cached(m, x, chunks, order):
    """Feed ``x`` through a fresh cache in chunks of the given sizes; returns the concatenated outputs."""
    state = m.new_cache(x.shape[0])
    outs, pos = [], 0
    for n in chunks:
        outs.append(m(x[:, pos : pos + n], state=state, offset=pos, order=order))
        pos += n
    return torch.cat(outs, dim=1), state


@pytest.mark.parametrize("order", ["expanded", "absorbed", None])
@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("chunks", [[5, 1, 1, 1, 1], [4, 3, 1, 1]], ids=["prefill+steps", "prefill+prefill+steps"])
def test_cache_matches_full_pass(order, rope, chunks):
    m = _mla(rope=rope)
    x = _x(T=sum(chunks))
    with torch.no_grad():
        full = m(x)  # no cache: expanded
        cached, state = _run_cached(m, x, chunks, order)
    torch.testing.assert_close(cached, full, **TIGHT)
    assert state.seq_len == x.shape[1]


def test_default_order_selection(monkeypatch):
    """No cache: expanded; with a cache: absorbed, unless ``absorbed_decode`` is off."""
    calls = []
    for absorbed_decode, with_cache, expected in [
        (True, False, "expanded"),
        (True, True, "absorbed"),
        (False, True, "expanded"),
    ]:
        m = _mla(absorbed_decode=absorbed_decode)
        for name in ("_expanded", "_absorbed"):
            orig = getattr(m, name)
            monkeypatch.setattr(m, name, lambda *a, _o=orig, _n=name: calls.append(_n) or _o(*a))
        calls.clear()
        with torch.no_grad():
            m(_x(T=3), state=m.new_cache(2) if with_cache else None)
        assert calls == [f"_{expected}"]
    with pytest.raises(ValueError):
        m(_x(T=3), order="latent")


@pytest.mark.parametrize("order", ["expanded", "absorbed"])
def test_causal(order):
    m = _mla(rope=True)
    x = _x(T=8)
    t = 4
    y = x.clone()
    y[:, t + 1 :] += torch.randn_like(y[:, t + 1 :])
    with torch.no_grad():
        a, b = m(x, order=order), m(y, order=order)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], **TIGHT)
    assert (a[:, t + 1] - b[:, t + 1]).abs().max() > 1e-3


def test_cache_holds_only_latent_and_shared_key():
    m = _mla(rope=True)
    B, T = 2, 7
    with torch.no_grad():
        _, state = _run_cached(m, _x(B=B, T=T), [4, 1, 2], None)
    assert isinstance(state, MLACache)
    tensors = {k: v for k, v in vars(state).items() if isinstance(v, torch.Tensor)}
    assert set(tensors) == {"c", "kr"}
    assert state.c.shape == (B, T, SMALL["kv_lora_rank"]) and state.kr.shape == (B, T, SMALL["qk_rope_head_dim"])
    numbers = sum(v.numel() for v in tensors.values()) / (B * T)
    assert numbers == m.cache_numbers_per_token() == SMALL["kv_lora_rank"] + SMALL["qk_rope_head_dim"]


# ------------------------------------------------------------------------------------------------
# Folding U^V into o_proj: exact without the gate, impossible with it (docs/k3.md §3.3, 10.10 item 6)
# ------------------------------------------------------------------------------------------------
def _folded_wo(m):
    """``W_o U^V`` per head: ``[d, H, kv_lora]``."""
    _, uv = m.up_projections()  # [H, v, r]
    wo = m.o_proj.weight.view(-1, m.n_heads, m.v_head_dim)  # [d, H, v]
    return torch.einsum("dhv,hvr->dhr", wo, uv)


def test_ungated_uv_folds_into_o_proj():
    m = _mla(output_gate=False)
    x = _x()
    with torch.no_grad():
        _, o_lat = reference_mla(m, x)  # [B, T, H, r]
        folded = torch.einsum("bthr,dhr->btd", o_lat, _folded_wo(m))
        torch.testing.assert_close(folded, m(x), rtol=1e-10, atol=1e-10)


def test_gated_uv_does_not_fold():
    m = _mla(output_gate=True)
    x = _x(B=4, T=32)
    with torch.no_grad():
        y = m(x)
        _, o_lat = reference_mla(m, x)
        folded = torch.einsum("bthr,dhr->btd", o_lat, _folded_wo(m))
        assert (folded - y).abs().max() > 1e-2
        # stronger: no static matrix maps the latent outputs to y (least squares over 128 tokens, 60 features)
        feats = o_lat.reshape(-1, m.n_heads * m.kv_lora_rank)
        for gated, target in [(True, y), (False, folded)]:
            sol = torch.linalg.lstsq(feats, target.reshape(-1, D)).solution
            rel = (feats @ sol - target.reshape(-1, D)).norm() / target.norm()
            assert (rel > 1e-2) if gated else (rel < 1e-10), (gated, rel)


def test_gradients_reach_every_parameter():
    m = _mla(dtype=torch.float32, rope=True)
    m(_x(dtype=torch.float32)).square().mean().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


# ------------------------------------------------------------------------------------------------
# Model-level path: config system -> Decoder -> cached decoding
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides",
    [[], ["mixer.rope=true", "mixer.n_heads=3", "mixer.q_lora_rank=null"]],
    ids=["default", "rope-3heads-noqlora"],
)
def test_model_prefill_decode(overrides):
    from components.model import Decoder
    from runtime.compose import compose, strip_hydra
    from runtime.validation import validate

    root = validate(strip_hydra(compose(["model=tiny", "mixer=mla", *overrides])))
    assert isinstance(root.mixer, MLAConfig)
    torch.manual_seed(0)
    m = Decoder(root.decoder_config()).double().eval()
    assert all(isinstance(layer.mixer, MLA) for layer in m.layers)
    B, T = 2, 8
    ids = torch.randint(0, root.model.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = m(ids)
        assert full.shape == (B, T, root.model.vocab_size)
        cache = m.new_cache()
        steps = [m(ids[:, :5], cache=cache)] + [m(ids[:, t : t + 1], cache=cache) for t in range(5, T)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TIGHT)
    per_token = root.mixer.kv_lora_rank + root.mixer.qk_rope_head_dim
    assert cache.nbytes() == root.model.n_layers * B * T * per_token * 8  # fp64


def test_model_config_rejects_odd_rope_dim():
    from runtime.compose import compose, strip_hydra
    from runtime.validation import validate

    with pytest.raises(ConfigError) as err:
        validate(strip_hydra(compose(["model=tiny", "mixer=mla", "mixer.rope=true", "mixer.qk_rope_head_dim=15"])))
    assert err.value.key == "mixer.qk_rope_head_dim"
