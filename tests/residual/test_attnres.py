"""AttnRes residual schemes (docs/k3.md §7.1-7.3, 10.10 item 10): wiring, source counts, memory, decoder,
diagnostics."""

from __future__ import annotations

import copy
import json
import math
import types
import weakref

import pytest
import torch

import components.residual.attnres as attnres_mod
from components.model import Decoder
from components.nn.build_context import BuildContext
from components.ops.attnres import attnres_read_reference
from components.optim.param_groups import adamw_param_groups, unique_trainable
from components.registry import ConfigError
from components.residual.attnres import BlockAttnRes, BlockAttnResConfig, FullAttnRes, FullAttnResConfig
from runtime.callbacks.depth_weight_recorder import DepthWeights
from tests import helpers
from tests.helpers import build_model, compose_root

EPS = 1e-5
TIGHT = dict(rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- helpers


def make_scheme(
    kind: str,
    d: int,
    n_layers: int,
    block_size: int = 2,
    random_params: bool = True,
    seed: int = 0,
    unit: str = "layers",
):
    if kind == "full":
        scheme = FullAttnRes(FullAttnResConfig(), BuildContext(d, n_layers=n_layers, norm_eps=EPS))
    else:
        scheme = BlockAttnRes(
            BlockAttnResConfig(block_size=block_size, block_unit=unit), BuildContext(d, n_layers=n_layers, norm_eps=EPS)
        )
    scheme = scheme.double()
    if random_params:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in scheme._queries():
                p.copy_(0.5 * torch.randn(d, generator=g, dtype=torch.float64))
            for name, p in scheme.named_parameters():
                if "_norm" in name:
                    p.copy_(1.0 + 0.2 * torch.randn(d, generator=g, dtype=torch.float64))
    return scheme


def dummy_sublayers(n_sublayers: int, d: int, seed: int = 1):
    """Distinct nonlinear maps [B, T, d] -> [B, T, d] standing in for mixers and FFNs."""
    g = torch.Generator().manual_seed(seed)
    mats = [torch.randn(d, d, generator=g, dtype=torch.float64) / math.sqrt(d) for _ in range(n_sublayers)]
    scales = [0.5 + torch.rand((), generator=g, dtype=torch.float64) for _ in range(n_sublayers)]
    return [lambda h, W=W, c=c: c * torch.tanh(h @ W) for W, c in zip(mats, scales)]


def run_scheme(scheme, x0, subs):
    """Drive a scheme as the decoder does; returns (input of every sublayer, final read)."""
    reads = []
    state = scheme.start(x0)
    for s, f in enumerate(subs):
        h = scheme.read(state, s)
        reads.append(h)
        state = scheme.write(state, s, f(h))
    return reads, scheme.finish(state)


def q_and_gain(scheme, key):
    if key == "final":
        return scheme.output_attn_res_proj, scheme.output_attn_res_norm.weight
    l = key // 2
    if key % 2 == 0:
        return scheme.self_attention_res_proj[l], scheme.self_attention_res_norm[l].weight
    return scheme.mlp_res_proj[l], scheme.mlp_res_norm[l].weight


def block_reference(scheme, x0, subs, block_size):
    """Spec 7.3 pseudo-code, transcribed per layer. Returns (reads, final, sources of every read)."""
    n_layers = len(subs) // 2

    def R(srcs, key):
        q, gain = q_and_gain(scheme, key)
        return attnres_read_reference(srcs, q, gain, EPS)

    blocks, p = [], x0
    reads, sources = [], []
    for l in range(n_layers):
        start = l % block_size == 0
        srcs = blocks + [p]
        h = R(srcs, 2 * l) if blocks else p  # layer 0: h = embedding
        reads.append(h)
        sources.append(srcs)
        if start:
            blocks.append(p)  # seal after the pre-attention read
        a = subs[2 * l](h)
        p = a if start else p + a  # a new block's partial starts with this attention output
        srcs = blocks + [p]
        h = R(srcs, 2 * l + 1)
        reads.append(h)
        sources.append(srcs)
        p = p + subs[2 * l + 1](h)
    sources.append(blocks + [p])
    return reads, R(blocks + [p], "final"), sources


def full_reference(scheme, x0, subs):
    """Spec 7.1: sublayer s reads [embedding, out_0, ..., out_{s-1}]; the final read sees all of them."""
    u = [x0]
    reads, sources = [], []
    for s, f in enumerate(subs):
        q, gain = q_and_gain(scheme, s)
        h = attnres_read_reference(u, q, gain, EPS)
        reads.append(h)
        sources.append(list(u))
        u.append(f(h))
    q, gain = q_and_gain(scheme, "final")
    sources.append(list(u))
    return reads, attnres_read_reference(u, q, gain, EPS), sources


def inputs(B=2, T=5, d=16, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, d, generator=g, dtype=torch.float64)


# ---------------------------------------------------------------- wiring against the spec


@pytest.mark.parametrize("n_layers,block_size", [(5, 1), (5, 2), (6, 3), (7, 3), (4, 4), (3, 10)])
def test_block_wiring_equals_spec_transcription(n_layers, block_size):
    d = 16
    scheme = make_scheme("block", d, n_layers, block_size)
    x0, subs = inputs(d=d), dummy_sublayers(2 * n_layers, d)
    reads, y = run_scheme(scheme, x0, subs)
    ref_reads, ref_y, _ = block_reference(scheme, x0, subs, block_size)
    for s, (h, r) in enumerate(zip(reads, ref_reads)):
        torch.testing.assert_close(h, r, **TIGHT, msg=lambda m: f"sublayer {s}: {m}")
    torch.testing.assert_close(y, ref_y, **TIGHT)
    torch.testing.assert_close(reads[0], x0, rtol=0, atol=0)  # layer 0's attention sees the embedding itself


@pytest.mark.parametrize("n_layers", [1, 4])
def test_full_wiring_equals_spec_transcription(n_layers):
    d = 16
    scheme = make_scheme("full", d, n_layers)
    x0, subs = inputs(d=d), dummy_sublayers(2 * n_layers, d)
    reads, y = run_scheme(scheme, x0, subs)
    ref_reads, ref_y, _ = full_reference(scheme, x0, subs)
    for h, r in zip(reads, ref_reads):
        torch.testing.assert_close(h, r, **TIGHT)
    torch.testing.assert_close(y, ref_y, **TIGHT)


def test_block_of_one_sublayer_equals_full():
    d, n_layers = 16, 3
    x0, subs = inputs(d=d), dummy_sublayers(2 * n_layers, d)
    full = make_scheme("full", d, n_layers)
    block = make_scheme("block", d, n_layers, block_size=1, unit="sublayers")
    block.load_state_dict(full.state_dict())
    full_reads, full_y = run_scheme(full, x0, subs)
    block_reads, block_y = run_scheme(block, x0, subs)
    for b, f in zip(block_reads, full_reads):
        torch.testing.assert_close(b, f, **TIGHT)
    torch.testing.assert_close(block_y, full_y, **TIGHT)
    assert block.sources_per_read() == full.sources_per_read()
    # a block of one LAYER (two sublayers) is not full AttnRes: they part after layer 0
    layer_block = make_scheme("block", d, n_layers, block_size=1)
    layer_block.load_state_dict(full.state_dict())
    layer_reads, layer_y = run_scheme(layer_block, x0, subs)
    torch.testing.assert_close(layer_reads[1], full_reads[1], **TIGHT)
    assert not torch.allclose(layer_reads[2], full_reads[2])
    assert not torch.allclose(layer_y, full_y)


@pytest.mark.parametrize("block_size,unit", [(3, "layers"), (50, "layers"), (6, "sublayers"), (7, "sublayers")])
def test_block_longer_than_the_model_reads_embedding_and_one_partial(block_size, unit):
    d, n_layers = 16, 3
    x0, subs = inputs(d=d), dummy_sublayers(2 * n_layers, d)
    scheme = make_scheme("block", d, n_layers, block_size=block_size, unit=unit)
    assert scheme.sources_per_read() == [(0, 1)] + [(s, 2) for s in range(1, 2 * n_layers)] + [("final", 2)]
    reads, y = run_scheme(scheme, x0, subs)
    partial = torch.zeros_like(x0)
    for s, f in enumerate(subs):
        if s > 0:
            q, gain = q_and_gain(scheme, s)
            torch.testing.assert_close(reads[s], attnres_read_reference([x0, partial], q, gain, EPS), **TIGHT)
        partial = partial + f(reads[s])
    q, gain = q_and_gain(scheme, "final")
    torch.testing.assert_close(y, attnres_read_reference([x0, partial], q, gain, EPS), **TIGHT)


@pytest.mark.parametrize("kind,block_size", [("full", None), ("block", 1), ("block", 2), ("block", 50)])
def test_zero_queries_give_the_mean_of_the_sources_at_every_read(kind, block_size):
    d, n_layers = 16, 5
    scheme = make_scheme(kind, d, n_layers, block_size or 2, random_params=False)
    with torch.no_grad():  # gains stay random: a zero query makes every score 0 whatever the gain
        for name, p in scheme.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    x0, subs = inputs(d=d), dummy_sublayers(2 * n_layers, d)
    scheme.record_weights = True
    reads, y = run_scheme(scheme, x0, subs)
    if kind == "full":
        _, _, sources = full_reference(scheme, x0, subs)
    else:
        _, _, sources = block_reference(scheme, x0, subs, block_size)
    for h, srcs in zip([*reads, y], sources):
        torch.testing.assert_close(h, torch.stack(srcs).mean(dim=0), **TIGHT)
    for row in scheme.depth_weights()["rows"]:
        present = [w for w in row["weights"] if not math.isnan(w)]
        assert present == pytest.approx([1 / len(present)] * len(present), abs=1e-15)


@pytest.mark.parametrize("kind", ["full", "block"])
def test_large_aligned_query_returns_that_raw_source(kind):
    """Sources along orthogonal directions with per-token scales; a large query along one of them picks it."""
    d, B, T = 16, 2, 4
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0]  # orthonormal columns

    def along(i):
        return (0.5 + torch.rand(B, T, 1, generator=g, dtype=torch.float64)) * basis[:, i]  # [B, T, d]

    scheme = make_scheme(kind, d, n_layers=2, random_params=False)
    x0, out0 = along(0), along(1)
    state = scheme.write(scheme.start(x0), 0, out0)  # mlp read of layer 0 sees [embedding, out_0]
    for target, src in ((0, x0), (1, out0)):
        with torch.no_grad():
            scheme.mlp_res_proj[0].copy_(60.0 * basis[:, target])
        torch.testing.assert_close(scheme.read(state, 1), src, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- source counts (docs/k3.md §7.3, 10.1 SRC)


def k3_expected_counts(n_layers=93, block_size=12):
    """Counts read off the docs/k3.md §7.3 loop: blocks + [p], with layer 0's attention seeing p alone."""
    counts, n_blocks = [], 0
    for l in range(n_layers):
        counts.append((2 * l, n_blocks + 1))
        if l % block_size == 0:
            n_blocks += 1
        counts.append((2 * l + 1, n_blocks + 1))
    return counts + [("final", n_blocks + 1)]


def test_k3_source_counts_on_the_93_layer_plan(monkeypatch):
    d, n_layers = 8, 93
    scheme = BlockAttnRes(BlockAttnResConfig(block_size=12), BuildContext(d, n_layers=n_layers, norm_eps=EPS))
    seen = []
    real = attnres_mod.attnres_read

    def counting(sources, *args, **kwargs):
        seen.append(len(sources))
        return real(sources, *args, **kwargs)

    monkeypatch.setattr(attnres_mod, "attnres_read", counting)
    x0 = torch.randn(1, 2, d)
    g = torch.Generator().manual_seed(0)
    W = torch.randn(d, d, generator=g) / math.sqrt(d)
    with torch.no_grad():
        run_scheme(scheme, x0, [lambda h: torch.tanh(h @ W)] * (2 * n_layers))

    keys = [*range(2 * n_layers), "final"]
    measured = list(zip(keys, seen))
    assert measured == k3_expected_counts()
    assert scheme.sources_per_read() == measured
    by_key = dict(measured)
    assert by_key[0] == 1 and by_key[1] == 2  # layer 0: embedding alone, then embedding + attention output
    assert all(by_key[s] == 2 for s in range(2, 24))  # layers 1-11
    assert (by_key[24], by_key[25]) == (2, 3)  # layer 12: the finished block is still the partial for attn
    assert (by_key[168], by_key[169]) == (8, 9)  # layer 84 starts the last block
    assert all(by_key[s] == 9 for s in range(170, 186))  # layers 85-92
    assert by_key["final"] == 9  # embedding + 7 complete blocks + the 9-layer partial
    assert scheme.source_labels() == ["embedding", *[f"block {i}" for i in range(1, 8)], "partial"]


def test_full_source_counts_grow_by_one_per_sublayer():
    scheme = FullAttnRes(FullAttnResConfig(), BuildContext(8, n_layers=4, norm_eps=EPS))
    assert scheme.sources_per_read() == [(s, s + 1) for s in range(8)] + [("final", 9)]


# ---------------------------------------------------------------- memory (docs/k3.md §7.2)


@pytest.mark.parametrize("n_layers,block_size", [(9, 2), (9, 4), (6, 1), (4, 10)])
def test_block_state_holds_block_summaries_and_partial_only(n_layers, block_size):
    d = 8
    scheme = make_scheme("block", d, n_layers, block_size)
    subs = dummy_sublayers(2 * n_layers, d)
    n_blocks = (n_layers - 1) // block_size + 1
    outs = []
    with torch.no_grad():
        state = scheme.start(inputs(d=d))
        for s, f in enumerate(subs):
            out = f(scheme.read(state, s))
            outs.append(weakref.ref(out))
            state = scheme.write(state, s, out)
            assert len(state.blocks) + 1 <= n_blocks + 1
            del out
    assert len(state.blocks) == n_blocks
    # only the outputs that started a block (and are that block's partial, never added to in place) survive
    assert sum(r() is not None for r in outs) <= n_blocks


def test_full_state_keeps_every_sublayer_output():
    d, n_layers = 8, 3
    scheme = make_scheme("full", d, n_layers)
    outs = []
    with torch.no_grad():
        state = scheme.start(inputs(d=d))
        for s, f in enumerate(dummy_sublayers(2 * n_layers, d)):
            out = f(scheme.read(state, s))
            outs.append(weakref.ref(out))
            state = scheme.write(state, s, out)
            assert len(state) == s + 2
            del out
    assert all(r() is not None for r in outs)


# ---------------------------------------------------------------- the decoder

RESIDUALS = [
    ("full_attnres",),
    ("block_attnres", "residual.block_size=2"),
    ("block_attnres", "residual.block_size=1"),
    ("block_attnres", "residual.block_size=9"),
    ("block_attnres", "residual.block_size=3", "residual.block_unit=sublayers"),
]


def tiny_model(*overrides, seed=0):
    # non-zero queries and non-unit gains, so the wiring matters
    return helpers.tiny_model("model.n_layers=4", *overrides, seed=seed, gain_noise=0.2)


@pytest.mark.parametrize("overrides", RESIDUALS, ids=lambda o: "-".join(x.split("=")[-1] for x in o))
def test_decoder_gradients_reach_every_pseudo_query(overrides):
    torch.manual_seed(0)
    model = build_model("model=tiny", "model.n_layers=4", *(f"residual={overrides[0]}", *overrides[1:]))
    queries = model.residual._queries()
    assert all(float(q.detach().abs().max()) == 0.0 for q in queries)  # zero init, not touched by the decoder
    ids = torch.randint(0, model.vocab_size, (2, 12))
    model(ids).logsumexp(-1).mean().backward()
    for name, p in model.residual.named_parameters():
        assert p.grad is not None, name
    layer0_attn = model.residual.self_attention_res_proj[0]
    # layer 0's attention has a single source: its query is in the graph with an exactly zero gradient
    assert float(layer0_attn.grad.abs().max()) == 0.0
    for q in queries:
        if q is not layer0_attn:
            assert float(q.grad.abs().max()) > 0


@pytest.mark.parametrize("overrides", RESIDUALS, ids=lambda o: "-".join(x.split("=")[-1] for x in o))
def test_decoder_causal_and_prefill_decode_equals_full_pass(overrides):
    model = tiny_model(f"residual={overrides[0]}", *overrides[1:])
    T = 14
    ids = torch.randint(0, model.vocab_size, (2, T))
    full = model(ids)
    changed = ids.clone()
    changed[:, 8:] = torch.randint(0, model.vocab_size, (2, T - 8))
    torch.testing.assert_close(model(changed)[:, :8], full[:, :8], rtol=0, atol=1e-10)
    # AttnRes mixes over depth at each position: the mixers' caches are all a decode needs
    cache = model.new_cache()
    outs = [model(ids[:, :5], cache=cache)]
    outs += [model(ids[:, t : t + 1], cache=cache) for t in range(5, 9)]
    outs.append(model(ids[:, 9:], cache=cache))
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("residual", ["full_attnres", "block_attnres"])
def test_decoder_runs_under_bf16_autocast(residual):
    """bf16 sublayer outputs join an fp32 embedding stream (the CPU trainer's bf16-mixed precision)."""
    torch.manual_seed(0)
    model = build_model("model=tiny", "model.n_layers=3", f"residual={residual}")
    ids = torch.randint(0, model.vocab_size, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
    logits.float().logsumexp(-1).mean().backward()
    assert torch.isfinite(logits.float()).all()
    assert model.residual.output_attn_res_proj.grad is not None


def test_pseudo_queries_are_excluded_from_weight_decay():
    model = build_model("model=tiny", "residual=block_attnres")
    for m in (model, copy.deepcopy(model), copy.deepcopy(model).double()):
        decay_ids = {id(p) for p in adamw_param_groups(m, unique_trainable(m), 0.1)[0]["params"]}
        for q in m.residual._queries():
            assert id(q) not in decay_ids


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["residual=block_attnres", "residual.block_size=0"], "residual.block_size"),
        (["residual=block_attnres", "residual.backend=triton"], "residual.backend"),
        (["residual=full_attnres", "residual.backend=fla"], "residual.backend"),  # CPU trainer
        (["residual=full_attnres", "residual.eps=0"], "residual.eps"),
    ],
)
def test_invalid_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        compose_root("model=tiny", *overrides)
    assert err.value.key == key


def test_block_size_beyond_depth_is_one_block():
    root = compose_root("model=tiny", "residual=block_attnres", "residual.block_size=64")
    scheme = Decoder(root.decoder_config()).residual
    assert scheme.n_blocks == 1
    assert scheme.sources_per_read()[-1] == ("final", 2)  # embedding + one partial


# ---------------------------------------------------------------- depth-weight diagnostics


def test_depth_weights_rows_sum_to_one_and_average_over_batches():
    d, n_layers, bs = 16, 5, 2
    scheme = make_scheme("block", d, n_layers, bs)
    subs = dummy_sublayers(2 * n_layers, d)
    assert scheme.depth_weights() is None
    scheme.record_weights = True
    single = []
    for seed in (1, 2):
        run_scheme(scheme, inputs(d=d, seed=seed), subs)
        single.append(scheme.depth_weights())
        scheme.reset_depth_weights()
    for seed in (1, 2):
        run_scheme(scheme, inputs(d=d, seed=seed), subs)
    m = scheme.depth_weights()
    labels = [r["sublayer"] for r in m["rows"]]
    assert labels == [f"L{l}.{k}" for l in range(n_layers) for k in ("attn", "mlp")] + ["final"]
    assert m["sources"] == ["embedding", "block 1", "block 2", "partial"]
    counts = dict(scheme.sources_per_read())
    for key, row, a, b in zip([*range(2 * n_layers), "final"], m["rows"], single[0]["rows"], single[1]["rows"]):
        present = [w for w in row["weights"] if not math.isnan(w)]
        assert len(present) == counts[key]
        assert sum(present) == pytest.approx(1.0, abs=1e-12)
        assert not math.isnan(row["weights"][0])  # the embedding is a source of every read
        if key != 0:  # the partial sum sits in the last column, completed blocks in order before it
            assert not math.isnan(row["weights"][-1])
            assert all(not math.isnan(w) for w in row["weights"][: counts[key] - 1])
        # the mean over the recorded batches
        expected = [(x + y) / 2 for x, y in zip(a["weights"], b["weights"]) if not math.isnan(x)]
        assert present == pytest.approx(expected, abs=1e-12)
    assert m["rows"][0]["weights"][0] == 1.0  # L0.attn: the embedding alone
    scheme.reset_depth_weights()
    assert scheme.depth_weights() is None


def _fake_trainer(run_dir, step=7):
    logged = []
    logger = types.SimpleNamespace(log_metrics=lambda metrics, step: logged.append((step, dict(metrics))))
    trainer = types.SimpleNamespace(
        default_root_dir=str(run_dir),
        global_step=step,
        is_global_zero=True,
        sanity_checking=False,
        world_size=1,
        loggers=[logger],
    )
    return trainer, logged


def test_callback_logs_and_appends_json_and_the_plot_reads_it(tmp_path):
    from analysis.depth_weights import main as plot_main

    torch.manual_seed(0)
    model = build_model("model=tiny", "model.n_layers=3", "residual=block_attnres")
    module = types.SimpleNamespace(model=model, device=torch.device("cpu"))
    module.modules = model.modules
    cb = DepthWeights()
    ids = torch.randint(0, model.vocab_size, (2, 6))
    for step in (7, 9):
        trainer, logged = _fake_trainer(tmp_path, step)
        cb.on_validation_start(trainer, module)
        assert model.residual.record_weights
        with torch.no_grad():
            model(ids)
        cb.on_validation_end(trainer, module)
        assert not model.residual.record_weights
    history = json.loads((tmp_path / "depth_weights.json").read_text())
    assert [e["step"] for e in history] == [7, 9]
    entry = history[-1]
    assert entry["sources"] == ["embedding", "block 1", "partial"]
    assert [r["sublayer"] for r in entry["rows"]] == [
        "L0.attn",
        "L0.mlp",
        "L1.attn",
        "L1.mlp",
        "L2.attn",
        "L2.mlp",
        "final",
    ]
    assert entry["rows"][0]["weights"] == [1.0, None, None]
    assert [w is None for w in entry["rows"][1]["weights"]] == [False, True, False]  # L0.mlp: embedding, partial
    step, metrics = logged[-1]
    assert step == 9 and metrics["depth/L0.attn/embedding"] == 1.0
    assert metrics["depth/final/embedding"] + metrics["depth/final/block1"] + metrics[
        "depth/final/partial"
    ] == pytest.approx(1.0)

    out = tmp_path / "depth.png"
    assert plot_main([str(tmp_path), "--out", str(out), "--step", "7"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_main([str(tmp_path), "--step", "8"]) == 1  # no such validation


def test_callback_does_nothing_for_plain_residual(tmp_path):
    model = build_model("model=tiny")
    module = types.SimpleNamespace(model=model, device=torch.device("cpu"), modules=model.modules)
    trainer, logged = _fake_trainer(tmp_path)
    cb = DepthWeights()
    cb.on_validation_start(trainer, module)
    cb.on_validation_end(trainer, module)
    assert not (tmp_path / "depth_weights.json").exists() and not logged


@pytest.mark.parametrize("residual", [["residual=block_attnres", "residual.block_size=1"], ["residual=full_attnres"]])
def test_recomputed_reads_give_the_same_gradients(residual):
    grads = {}
    for recompute in (True, False):
        torch.manual_seed(0)
        model = build_model(
            "model=tiny", "model.n_layers=3", *residual, f"residual.recompute={str(recompute).lower()}"
        ).double()
        with torch.no_grad():
            for q in model.residual._queries():
                q.normal_(std=0.5)
        ids = torch.randint(0, model.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
        model(ids).logsumexp(-1).mean().backward()
        grads[recompute] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert grads[True].keys() == grads[False].keys()
    for n in grads[True]:
        torch.testing.assert_close(grads[True][n], grads[False][n], rtol=1e-10, atol=1e-12, msg=n)
