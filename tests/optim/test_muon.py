"""Muon: Newton-Schulz properties, equality with torch.optim.Muon and an fp64 Moonlight reference,
per-head and per-expert blocks, the AdamW half, the parameter partition, and a step for every component."""

from __future__ import annotations

import math

import pytest
import torch

from components.model import Decoder
from components.nn.matrix_layout import MatrixLayout
from components.optim.muon import NS_COEFFICIENTS, Muon, newton_schulz, orthogonalized_update, orthogonalized_updates
from components.optim.param_groups import muon_partition
from components.registry import OPTIMIZERS
from tests.helpers import compose_root, group_options

LR, WD, MU = 0.02, 0.1, 0.95


def moonlight_reference_step(w: torch.Tensor, g: torch.Tensor, buf: torch.Tensor) -> None:
    """The Moonlight update written out plainly, in float64, one matrix at a time."""
    buf.mul_(MU).add_(g)
    u = g + MU * buf  # Nesterov
    x = u.T if u.shape[0] > u.shape[1] else u
    x = x / x.norm()
    a, b, c = NS_COEFFICIENTS
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    o = x.T if u.shape[0] > u.shape[1] else x
    w.mul_(1 - LR * WD).sub_(LR * 0.2 * math.sqrt(max(w.shape)) * o)


def run_muon(
    params: list[torch.Tensor], grads: list[list[torch.Tensor]], layouts=None, ns_dtype: str = "bf16"
) -> list[torch.Tensor]:
    """Muon's steps from ``params`` under ``grads``; Newton-Schulz in bf16 (torch.optim.Muon's) unless told."""
    params = [torch.nn.Parameter(p.clone()) for p in params]
    group = {"params": params, "use_muon": True}
    if layouts is not None:
        group["layouts"] = layouts
    opt = Muon([group], lr=LR, weight_decay=WD, momentum=MU, ns_dtype=ns_dtype)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("shape", [(64, 32), (128, 128), (32, 256)])
def test_newton_schulz_singular_values_and_update_rms(shape):
    torch.manual_seed(0)
    n = min(shape)
    u, _ = torch.linalg.qr(torch.randn(shape[0], n))
    v, _ = torch.linalg.qr(torch.randn(shape[1], n))
    g = u @ torch.diag(torch.logspace(0, -2, n)) @ v.T  # condition number 100
    o = newton_schulz(g).float()
    s = torch.linalg.svdvals(o)
    # NS5 does not converge to exactly 1; it lands every direction in roughly [0.68, 1.2]
    assert s.min() > 0.65 and s.max() < 1.25, (s.min(), s.max())
    rms = (0.2 * math.sqrt(max(shape)) * o).pow(2).mean().sqrt()
    assert 0.15 < rms < 0.21, rms  # RMS-matched to AdamW's typical 0.2
    if shape[0] != shape[1]:  # a tall matrix is iterated as its wide transpose: the same numbers
        assert torch.equal(newton_schulz(g.T), newton_schulz(g).T)


@pytest.mark.parametrize("shape", [(48, 32), (32, 80)])
def test_plain_matrices_match_torch_muon_and_fp64_moonlight(shape):
    torch.manual_seed(1)
    w0 = torch.randn(*shape) * 0.05
    grads = [[torch.randn(*shape)] for _ in range(4)]
    ours = run_muon([w0], grads)[0]

    w_torch = torch.nn.Parameter(w0.clone())
    opt = torch.optim.Muon(
        [w_torch], lr=LR, weight_decay=WD, momentum=MU, nesterov=True, adjust_lr_fn="match_rms_adamw"
    )
    for (g,) in grads:
        w_torch.grad = g.clone()
        opt.step()

    w_ref, buf = w0.double().clone(), torch.zeros(shape, dtype=torch.float64)
    for (g,) in grads:
        moonlight_reference_step(w_ref, g.double(), buf)

    moved = (w_ref.float() - w0).abs().max()
    assert torch.allclose(ours, w_torch.detach(), atol=1e-6), (ours - w_torch).abs().max()
    # bf16 Newton-Schulz vs fp64: within bf16 rounding of the update
    assert (ours - w_ref.float()).abs().max() < 0.02 * moved
    assert not torch.equal(ours, w0)


def test_fp32_newton_schulz_is_closer_to_fp64_moonlight_than_bf16():
    torch.manual_seed(1)
    shape = (48, 32)
    w0 = torch.randn(*shape) * 0.05
    grads = [[torch.randn(*shape)] for _ in range(4)]
    w_ref, buf = w0.double().clone(), torch.zeros(shape, dtype=torch.float64)
    for (g,) in grads:
        moonlight_reference_step(w_ref, g.double(), buf)
    moved = (w_ref.float() - w0).abs().max()
    err = {d: (run_muon([w0], grads, ns_dtype=d)[0] - w_ref.float()).abs().max() for d in ("bf16", "fp32")}
    assert err["fp32"] < 1e-4 * moved  # fp32 round-off only
    assert err["fp32"] < err["bf16"] / 20, err


@pytest.mark.parametrize("native,expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_iterates_in_bf16_only_where_bf16_products_are_native(monkeypatch, native, expected):
    import components.optim.muon as muon

    monkeypatch.setattr(muon, "native_bf16", lambda device: native)
    assert muon.ns_dtype_for("auto", torch.device("cpu")) == expected
    assert muon.ns_dtype_for("bf16", torch.device("cpu")) == torch.bfloat16
    assert muon.ns_dtype_for("fp32", torch.device("cpu")) == torch.float32
    seen = []
    real = muon.newton_schulz
    monkeypatch.setattr(
        muon, "newton_schulz", lambda x, steps, dtype: seen.append(dtype) or real(x, steps, dtype=dtype)
    )
    torch.manual_seed(0)
    run_muon([torch.randn(16, 8)], [[torch.randn(16, 8)]], ns_dtype="auto")
    assert seen == [expected]  # the optimizer's step iterates in the resolved dtype


def test_ns_dtype_is_checked_when_the_config_is_validated():
    from components.registry import ConfigError

    with pytest.raises(ConfigError) as err:
        compose_root("model=tiny", "optimizer=muon", "optimizer.ns_dtype=fp16")
    assert "optimizer.ns_dtype" in str(err.value) and "auto, bf16, fp32" in str(err.value)


@pytest.mark.parametrize("axis", [0, 1])
def test_per_head_equals_muon_on_each_block(axis):
    torch.manual_seed(2)
    heads, rows, cols = 4, 8, 24
    shape = (heads * rows, cols) if axis == 0 else (cols, heads * rows)
    w0 = torch.randn(*shape) * 0.05
    grads = [[torch.randn(*shape)] for _ in range(3)]
    whole = run_muon([w0], grads, layouts=[MatrixLayout(heads, axis)])[0]
    split = lambda t: list(t.chunk(heads, dim=axis))  # noqa: E731
    blocks = run_muon(split(w0), [split(g) for (g,) in grads])
    assert torch.allclose(whole, torch.cat(blocks, dim=axis), atol=1e-6)
    # and it is a different update from whole-matrix Muon
    assert not torch.allclose(whole, run_muon([w0], grads)[0], atol=1e-4)


def test_stacked_experts_equal_muon_per_expert():
    torch.manual_seed(3)
    w0 = torch.randn(3, 16, 40) * 0.05
    grads = [[torch.randn(3, 16, 40)] for _ in range(3)]
    stacked = run_muon([w0], grads, layouts=[MatrixLayout(stacked=True)])[0]
    each = run_muon(list(w0.unbind(0)), [list(g.unbind(0)) for (g,) in grads])
    assert torch.allclose(stacked, torch.stack(each), atol=1e-6)


def test_adamw_half_matches_torch_adamw():
    torch.manual_seed(4)
    a = torch.nn.Parameter(torch.randn(10, 7))
    b = torch.nn.Parameter(a.detach().clone())
    ours = Muon([{"params": [a]}], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    ref = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(5):
        g = torch.randn(10, 7)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert torch.allclose(a, b, atol=1e-6)


def test_partition_follows_moonlight():
    root = compose_root(
        "model=tiny",
        "mixer=kda",
        "ffn=moe",
        "+mixer@mixers.global=mla",
        "+model.mixer_plan.at={-1:global}",
        "model.tie_embeddings=false",
    )
    model = Decoder(root.decoder_config())
    muon, adamw = muon_partition(model, per_head=True)
    muon_names = {n: layout for n, _, layout in muon}
    adamw_names = {n for n, _ in adamw}
    assert {"embed.weight", "lm_head.weight"} <= adamw_names
    for n, p in model.named_parameters():
        if p.ndim < 2 or "conv1d" in n:
            assert n in adamw_names, n  # norms, A_log, dt_bias, depthwise kernels [P, 1, W]
    kda_q = next(n for n in muon_names if n.endswith("mixer.q_proj.weight"))
    assert muon_names[kda_q].heads == root.mixer.n_heads
    assert any(
        n.endswith("kv_b_proj.weight") and lay.heads == root.mixers["global"].n_heads for n, lay in muon_names.items()
    )
    experts = [lay for n, lay in muon_names.items() if ".experts.w" in n]
    assert experts and all(lay.stacked for lay in experts)
    whole, _ = muon_partition(model, per_head=False)
    assert all(lay.heads == 1 for _, _, lay in whole) and [n for n, _, _ in whole] == list(muon_names)


def test_per_head_scope_splits_exactly_the_query_key_value_projections():
    """K3's scope (qkv): MLA q_b_proj / kv_b_proj and KDA / attention q, k, v_proj split per head; output
    projections, gates and the decay projection stay whole. Scope all also splits those."""
    root = compose_root(
        "model=tiny",
        "mixer=kda",
        "+mixer@mixers.global=mla",
        "+model.mixer_plan.at={-1:global}",
        "+mixer@mixers.gqa=gqa",
        "+model.mixer_plan.at={0:gqa}",
        "mixers.global.output_gate=true",
    )
    model = Decoder(root.decoder_config())

    def split(scope: str) -> set[str]:
        muon, _ = muon_partition(model, per_head=True, scope=scope)
        return {n.split("mixer.")[-1] + f"@{n.split('.')[1]}" for n, _, lay in muon if lay.heads > 1}

    # layers: 0 gqa, 1 kda (tiny has 2 layers; the last is MLA by the at: -1 pin, layer 0 by at: 0)
    layer_kind = {
        int(n.split(".")[1]): type(m.mixer).__name__
        for n, m in model.named_modules()
        if n.count(".") == 1 and n.startswith("layers.")
    }
    qkv = split("qkv")
    expected = set()
    for i, kind in layer_kind.items():
        names = {
            "Attention": ["q_proj", "k_proj", "v_proj"],
            "KDA": ["q_proj", "k_proj", "v_proj"],
            "MLA": ["q_b_proj", "kv_b_proj"],
        }[kind]
        expected |= {f"{n}.weight@{i}" for n in names}
    assert qkv == expected, (qkv, expected)
    extra = split("all") - qkv
    assert extra and all(n.split(".")[0] in ("o_proj", "g_proj", "f_b_proj", "g_b_proj") for n in extra), extra
    with pytest.raises(ValueError, match="per-head scope"):
        muon_partition(model, per_head=True, scope="heads")


MIXERS = group_options("mixer")
FFNS = group_options("ffn")


@pytest.mark.parametrize("mixer", MIXERS)
@pytest.mark.parametrize("ffn", FFNS)
def test_muon_trains_every_mixer_and_ffn(mixer, ffn):
    torch.manual_seed(0)
    root = compose_root(
        "model=tiny", f"mixer={mixer}", f"ffn={ffn}", "optimizer=muon", "optimizer.per_head=true", "optimizer.lr=1e-2"
    )
    model = Decoder(root.decoder_config())
    opt = OPTIMIZERS.build(root.optimizer, model)
    ids = torch.randint(0, 256, (2, 33))
    losses = []
    for _ in range(6):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_batched_orthogonalisation_equals_one_parameter_at_a_time():
    """One step orthogonalises every parameter's blocks of the same shape in one batched Newton-Schulz;
    each result must be the one the parameter gets on its own (heads, experts, plain, tall and wide)."""
    gen = torch.Generator().manual_seed(0)
    items = [
        (torch.randn(128, 64, generator=gen), MatrixLayout(4, 0, False)),  # 4 heads of [32, 64]
        (torch.randn(64, 128, generator=gen), MatrixLayout(2, 1, False)),  # 2 heads of [64, 64]
        (torch.randn(32, 64, generator=gen), MatrixLayout(1, 0, False)),  # plain [32, 64], shares a shape
        (torch.randn(8, 64, 64, generator=gen), MatrixLayout(1, 0, True)),  # 8 experts of [64, 64]
        (torch.randn(96, 32, generator=gen), MatrixLayout(1, 0, False)),  # tall, alone in its shape
    ]
    batched = orthogonalized_updates(items, ns_steps=5)
    for (update, layout), (ortho, scale) in zip(items, batched):
        ref, ref_scale = orthogonalized_update(update, layout, 5)
        assert scale == ref_scale and ortho.shape == update.shape
        torch.testing.assert_close(ortho, ref, atol=1e-3, rtol=0)  # batching only regroups the same products


def test_a_state_from_before_ns_dtype_loads_with_its_default():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 8))
    opt = Muon([{"params": [w], "use_muon": True}], lr=LR, ns_dtype="fp32")
    w.grad = torch.randn(16, 8)
    opt.step()
    old = opt.state_dict()
    for group in old["param_groups"]:
        del group["ns_dtype"]  # as saved before the option existed
    fresh = Muon([{"params": [w], "use_muon": True}], lr=LR, ns_dtype="fp32")
    fresh.load_state_dict(old)
    assert [g["ns_dtype"] for g in fresh.param_groups] == ["auto"]
    w.grad = torch.randn(16, 8)
    fresh.step()  # steps with it
