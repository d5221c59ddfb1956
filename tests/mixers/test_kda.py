"""KDA mixer: K3 parameter names/shapes/count, gate forms, equality with a plain transcription of the
layer equations (docs/k3.md §2.2), chunked vs recurrent paths, and cached decoding."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from components.mixers.kda import KDACache, KDAConfig, KimiDeltaAttention
from components.nn.build_context import BuildContext
from components.registry import ConfigError


def make(d_model=48, dtype=torch.float64, **kw) -> KimiDeltaAttention:
    torch.manual_seed(0)
    cfg = KDAConfig(**{"n_heads": 3, "head_dim": 8, "backend": "torch", **kw})
    m = KimiDeltaAttention(cfg, BuildContext(d_model)).to(dtype)
    with torch.no_grad():
        m.o_norm.weight.add_(0.1 * torch.randn_like(m.o_norm.weight))
        m.A_log.add_(0.3 * torch.randn_like(m.A_log))
    return m


K3_SHAPES = {
    "q_proj.weight": (12288, 7168),
    "k_proj.weight": (12288, 7168),
    "v_proj.weight": (12288, 7168),
    "q_conv1d.weight": (12288, 1, 4),
    "k_conv1d.weight": (12288, 1, 4),
    "v_conv1d.weight": (12288, 1, 4),
    "f_a_proj.weight": (128, 7168),
    "f_b_proj.weight": (12288, 128),
    "dt_bias": (12288,),
    "A_log": (96,),
    "b_proj.weight": (96, 7168),
    "g_proj.weight": (12288, 7168),
    "o_norm.weight": (128,),
    "o_proj.weight": (7168, 12288),
}


def test_k3_parameter_names_shapes_and_count():
    with torch.device("meta"):
        m = KimiDeltaAttention(
            KDAConfig(n_heads=96, head_dim=128, conv_size=4, gate_lower_bound=-5.0, full_rank_gate=True),
            BuildContext(7168),
        )
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes == K3_SHAPES
    assert sum(p.numel() for p in m.parameters()) == 443_740_384  # docs/k3.md §1.3
    assert m.A_log.dtype == m.dt_bias.dtype == torch.float32


def test_low_rank_gate_names():
    m = make(full_rank_gate=False)
    names = {n for n, _ in m.named_parameters()}
    assert {"g_a_proj.weight", "g_b_proj.weight"} <= names and "g_proj.weight" not in names


def reference_layer(m: KimiDeltaAttention, x: torch.Tensor) -> torch.Tensor:
    """Spec 2.2 steps 1-8, token by token, written independently of the module."""
    B, T, d = x.shape
    H, K, W = m.n_heads, m.head_dim, m.cfg.conv_size

    def conv_silu(z, w):  # z [B, T, P], w [P, 1, W]
        out = torch.zeros_like(z)
        for t in range(T):
            for j in range(W):
                src = t - (W - 1) + j
                if src >= 0:
                    out[:, t] += w[:, 0, j] * z[:, src]
        return F.silu(out)

    q = conv_silu(x @ m.q_proj.weight.T, m.q_conv1d.weight).view(B, T, H, K)
    k = conv_silu(x @ m.k_proj.weight.T, m.k_conv1d.weight).view(B, T, H, K)
    v = conv_silu(x @ m.v_proj.weight.T, m.v_conv1d.weight).view(B, T, H, K)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    f = ((x @ m.f_a_proj.weight.T) @ m.f_b_proj.weight.T).view(B, T, H, K) + m.dt_bias.view(H, K).to(x.dtype)
    a = m.A_log.exp().view(H, 1).to(x.dtype)
    L = m.cfg.gate_lower_bound
    g = -a * F.softplus(f) if L is None else L * torch.sigmoid(a * f)
    beta = torch.sigmoid(x @ m.b_proj.weight.T)  # [B, T, H]
    S = torch.zeros(B, H, K, K, dtype=x.dtype)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]  # decay rows (key channels)
        pred = torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        u = beta[:, t, :, None] * (v[:, t] - pred)
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t] * K**-0.5))
    o = torch.stack(outs, 1)  # [B, T, H, V]
    o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + m.cfg.norm_eps) * m.o_norm.weight
    gate = x @ m.g_proj.weight.T if m.cfg.full_rank_gate else (x @ m.g_a_proj.weight.T) @ m.g_b_proj.weight.T
    o = o * torch.sigmoid(gate.view(B, T, H, K))
    return o.reshape(B, T, H * K) @ m.o_proj.weight.T


@pytest.mark.parametrize("bound", [-5.0, None])
@pytest.mark.parametrize("full_rank", [True, False])
def test_matches_transcription_of_the_equations(bound, full_rank):
    m = make(gate_lower_bound=bound, full_rank_gate=full_rank)
    x = torch.randn(2, 37, 48, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(m(x), reference_layer(m, x), rtol=1e-9, atol=1e-10)


def test_gate_ranges():
    m = make(gate_lower_bound=-5.0)
    from components.ops.kda import kda_gate

    f = 100 * torch.randn(4, 3, 8)
    g = kda_gate(f, m.A_log.float(), m.dt_bias.float(), -5.0)
    assert (g >= -5).all() and (g <= 0).all()  # saturates to the bound in fp32
    assert (g.exp() >= torch.exp(torch.tensor(-5.0))).all()


@pytest.mark.parametrize("bound", [-5.0, None])
def test_chunked_prefill_continuation_and_decode(bound):
    m = make(gate_lower_bound=bound, chunk_size=16)
    x = torch.randn(2, 50, 48, dtype=torch.float64)
    with torch.no_grad():
        full = m(x)
        cache = KDACache()
        parts = [m(x[:, :20], state=cache), m(x[:, 20:41], state=cache)]  # two chunked prefills
        parts += [m(x[:, t : t + 1], state=cache) for t in range(41, 50)]  # token-by-token decoding
        torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-9, atol=1e-10)
    assert cache.state.shape == (2, 3, 8, 8) and cache.state.dtype == torch.float64
    assert cache.conv_q.shape == (2, 3, 24)


def test_gradients_reach_every_parameter():
    m = make(dtype=torch.float32)
    m(torch.randn(2, 20, 48)).square().mean().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize(
    "field,value",
    [("gate_lower_bound", 1.0), ("backend", "cuda"), ("chunk_size", 24), ("head_dim", 0)],
)
def test_validation(field, value):
    cfg = KDAConfig(**{field: value})
    with pytest.raises(ConfigError) as err:
        cfg.validate(None, "mixer")
    assert err.value.key == f"mixer.{field}"


# -- fla's limits and the bounded-gate path --------------------------------------------------------------
def test_a_head_size_fla_rejects_is_refused_before_training(capsys, tmp_path):
    from runtime.train_command import main
    from tests.helpers import compose_root

    with pytest.raises(ConfigError) as err:
        compose_root("model=tiny", "mixer=kda", "mixer.backend=fla", "mixer.head_dim=512")
    assert err.value.key == "mixer.head_dim" and "256" in str(err.value) and "fla" in str(err.value)
    # train.py's command line: exit status 2, the key named, nothing written
    argv = ["model=tiny", "mixer=kda", "mixer.backend=fla", "mixer.head_dim=512", f"output_root={tmp_path}"]
    assert main(argv) == 2
    stderr = capsys.readouterr().err
    assert "mixer.head_dim" in stderr and "256" in stderr
    assert not any(tmp_path.iterdir())


def test_the_head_size_limit_is_fla_s():
    # the limit KDAConfig enforces is the one the installed fla-core asserts
    import importlib.util
    import re

    from components.mixers.kda import FLA_MAX_HEAD_DIM

    spec = importlib.util.find_spec("fla")
    if spec is None:
        pytest.skip("fla-core not installed")
    source = (Path(spec.origin).parent / "ops" / "kda" / "chunk.py").read_text()
    assert re.findall(r"assert K <= (\d+)", source) == [str(FLA_MAX_HEAD_DIM)]


def _fla_spy(monkeypatch):
    """The fla path on a CPU (CUDA faked, fla's kernels their torch stand-ins), recording each chunk_kda call's
    keyword arguments."""
    from components.mixers import kda
    from tests.kernel_fakes import fake_cuda, torch_kernels

    fake_cuda(monkeypatch)
    torch_kernels(monkeypatch)
    chunk, recurrent = kda.fla_kda_kernels()
    calls = []

    def spy_chunk(*args, **kwargs):
        calls.append(kwargs)
        return chunk(*args, **kwargs)

    monkeypatch.setattr(kda, "fla_kda_kernels", lambda: (spy_chunk, recurrent))
    return calls


def test_auto_runs_heads_fla_rejects_on_torch_and_says_why_once(monkeypatch, caplog):
    from components.mixers import kda

    calls = _fla_spy(monkeypatch)
    monkeypatch.setattr(kda, "_logged", set())
    with caplog.at_level("WARNING", logger="components.mixers.kda"):
        layers = [make(dtype=torch.float32, backend="auto", n_heads=1, head_dim=512) for _ in range(2)]
    x = torch.randn(1, 20, 48)
    for layer in layers:
        assert not layer.use_fla(x)
        layer(x).square().mean().backward()  # trains, on the torch kernel
    assert calls == []
    reasons = [r.getMessage() for r in caplog.records if r.name == "components.mixers.kda"]
    assert len(reasons) == 1 and "512" in reasons[0] and "256" in reasons[0] and "torch" in reasons[0]
    assert make(dtype=torch.float32, backend="auto", head_dim=256).use_fla(x)  # at the limit: fla


@pytest.mark.parametrize("bound, safe", [(-5.0, True), (-3.0, True), (None, False)])
def test_fla_takes_its_bounded_gate_path_where_the_gate_is_bounded(monkeypatch, bound, safe):
    calls = _fla_spy(monkeypatch)
    m = make(dtype=torch.float32, backend="fla", gate_lower_bound=bound)
    x = torch.randn(2, 20, 48)
    m(x)
    from components.nn.segments import Segments

    m(x, segments=Segments(torch.tensor([[0] * 8 + [1] * 12, [0] * 20])))  # fla's variable-length form
    assert [c.get("safe_gate") for c in calls] == [safe, safe]


def test_fla_backend_needs_cuda():
    m = make(backend="fla", dtype=torch.float32)
    with pytest.raises(RuntimeError, match="CUDA"):
        m(torch.randn(1, 4, 48))


@pytest.mark.gpu
def test_fla_backend_matches_torch_on_gpu():
    torch.manual_seed(0)
    m = make(dtype=torch.float32).cuda()
    x = torch.randn(2, 300, 48, device="cuda", requires_grad=True)
    m.cfg.backend = "torch"
    y_ref = m(x.bfloat16().float())
    (y_ref.square().sum()).backward()
    g_ref = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    m.cfg.backend = "fla"
    y = m(x.bfloat16().float())
    (y.square().sum()).backward()
    torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, g_ref[n], rtol=5e-2, atol=5e-2)


def test_runs_under_bf16_autocast():
    m = make(dtype=torch.float32)
    x = torch.randn(2, 70, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    y.float().square().mean().backward()
    assert torch.isfinite(y).all() and m.q_proj.weight.grad is not None


@pytest.mark.parametrize(
    "a_log_init, gate, expect_zero",
    [("zero", -5.0, True), ("log_uniform", -5.0, False), ("auto", -5.0, True), ("auto", None, False)],
)
def test_a_log_and_dt_bias_initialisation_options(a_log_init, gate, expect_zero):
    torch.manual_seed(0)
    layer = KimiDeltaAttention(
        KDAConfig(n_heads=8, head_dim=16, gate_lower_bound=gate, a_log_init=a_log_init), BuildContext(64)
    )
    if expect_zero:
        assert torch.equal(layer.A_log, torch.zeros_like(layer.A_log))
    else:  # log U[1, 16]
        assert bool((layer.A_log >= 0).all() and (layer.A_log <= math.log(16)).all()) and layer.A_log.std() > 0
    dt = torch.nn.functional.softplus(layer.dt_bias)  # the default stores dt's inverse softplus
    assert bool((dt >= 1e-3 - 1e-6).all() and (dt <= 0.1 + 1e-6).all())
    zero = KimiDeltaAttention(
        KDAConfig(n_heads=8, head_dim=16, gate_lower_bound=gate, dt_bias_init="zero"), BuildContext(64)
    )
    assert torch.equal(zero.dt_bias, torch.zeros_like(zero.dt_bias))


@pytest.mark.parametrize("T", [2, 9])
@pytest.mark.parametrize("with_prefix", [False, True])
def test_shifted_convolution_equals_conv1d_with_gradients(T, with_prefix):
    """The shifted multiply-add form compiled layers run (contiguous [W, P] taps, zero-padded shifts) is the
    causal depthwise convolution: values and both gradients equal conv1d's in fp64, with and without a
    cached prefix, for windows shorter and longer than the kernel."""
    from components.mixers.kda import shifted_depthwise_conv

    gen = torch.Generator().manual_seed(0)
    B, P, W = 2, 6, 4
    x = torch.randn(B, T, P, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(P, 1, W, generator=gen, dtype=torch.float64, requires_grad=True)
    prefix = torch.randn(B, W - 1, P, generator=gen, dtype=torch.float64) if with_prefix else x.new_zeros(B, W - 1, P)
    dy = torch.randn(B, T, P, generator=gen, dtype=torch.float64)
    xp = torch.cat([prefix, x], dim=1)  # [B, W-1+T, P]
    ref = F.conv1d(xp.transpose(1, 2), w, groups=P).transpose(1, 2)
    ref_grads = torch.autograd.grad(ref, (x, w), dy)
    # the padded form applies only to a zero prefix and windows of at least W tokens
    y = shifted_depthwise_conv(x, w, None if not with_prefix and T >= W else xp)
    grads = torch.autograd.grad(y, (x, w), dy)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("full_rank_gate", [True, False])
def test_stacked_input_projections_equal_the_separate_ones(monkeypatch, full_rank_gate):
    # windows of FUSED_PROJECTION_MIN_ROWS tokens or more run the input projections as one stacked product:
    # the same layer output and parameter grads as six separate products
    import components.mixers.kda as kda_mixer

    m = make(full_rank_gate=full_rank_gate)
    x = torch.randn(2, 40, 48, dtype=torch.float64, requires_grad=True)

    def run():
        y = m(x)
        return (y, *torch.autograd.grad(y.square().sum(), [x, *m.parameters()]))

    monkeypatch.setattr(kda_mixer, "FUSED_PROJECTION_MIN_ROWS", 1)
    stacked = run()
    monkeypatch.setattr(kda_mixer, "FUSED_PROJECTION_MIN_ROWS", 10**9)
    separate = run()
    for a, b in zip(stacked, separate):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
