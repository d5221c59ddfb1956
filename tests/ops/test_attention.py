"""The matmul attention kernel against SDPA (the reference): exact in fp64, bf16-level in bf16."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from components.ops.attention import (
    QUERY_BLOCK,
    blocked_matmul_attention,
    causal_attention,
    causal_mask,
    resolve_attention_kernel,
)
from components.registry import ConfigError

B, H, D, DV = 2, 3, 24, 16


def _inputs(T: int, S: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, S, DV, generator=g, dtype=torch.float64)
    return tuple(x.to(dtype).requires_grad_() for x in (q, k, v))


def _doc_mask(T: int) -> torch.Tensor:
    ids = torch.tensor([[0] * 5 + [1] * (T - 5), [0] * T])  # [B, T]: two documents in row 0
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return ((ids[:, :, None] == ids[:, None, :]) & causal).unsqueeze(1)  # [B, 1, T, T]


def _run(kernel: str, inputs: tuple[torch.Tensor, ...], doc_mask=None, scale=None):
    q, k, v = inputs
    return _with_grads(causal_attention(q, k, v, scale=scale, doc_mask=doc_mask, kernel=kernel), inputs)


def _with_grads(o: torch.Tensor, inputs: tuple[torch.Tensor, ...]):
    # (o, grads of q, k, v) for a cotangent that weights o's channels differently
    return o, torch.autograd.grad(o, inputs, torch.ones_like(o).mul_(torch.linspace(-1, 1, o.shape[-1])))


def _assert_fp64_equal(result, reference) -> None:
    (o, grads), (o_ref, grads_ref) = result, reference
    torch.testing.assert_close(o, o_ref, atol=1e-12, rtol=1e-12)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("T,S", [(12, 12), (1, 9), (4, 11)])
def test_matmul_kernel_matches_sdpa_in_fp64(T, S):
    inputs = _inputs(T, S, torch.float64)
    _assert_fp64_equal(_run("matmul", inputs, scale=0.3), _run("sdpa", inputs, scale=0.3))


@pytest.mark.parametrize("block", [4, 5])
@pytest.mark.parametrize("T,S,documents", [(12, 12, False), (12, 12, True), (10, 13, False)])
def test_query_blocks_match_sdpa_in_fp64(T, S, documents, block):
    """Blocks of query rows over their visible keys only (ragged last block, queries after cached keys,
    document masks) give SDPA's values and gradients."""
    inputs = _inputs(T, S, torch.float64, seed=3)
    mask = _doc_mask(T) if documents else causal_mask(T, S, torch.device("cpu"))
    blocked = _with_grads(blocked_matmul_attention(*inputs, 0.3, mask, block=block), inputs)
    _assert_fp64_equal(blocked, _run("sdpa", inputs, doc_mask=mask if documents else None, scale=0.3))


def test_matmul_kernel_runs_query_blocks_beyond_one_block(monkeypatch):
    """Past ``QUERY_BLOCK`` queries the matmul kernel computes one block of rows at a time, each over keys
    up to its last query, and still equals SDPA."""
    import components.ops.attention as op

    key_lengths = []
    real = op.matmul_attention
    monkeypatch.setattr(op, "matmul_attention", lambda q, k, *a: key_lengths.append(k.shape[-2]) or real(q, k, *a))
    T = QUERY_BLOCK + 3
    inputs = _inputs(T, T, torch.float64, seed=4)
    reference = _run("sdpa", inputs)
    result = _run("matmul", inputs)
    assert key_lengths == [QUERY_BLOCK, T]
    _assert_fp64_equal(result, reference)


def test_matmul_kernel_matches_sdpa_with_documents():
    inputs = _inputs(12, 12, torch.float64, seed=1)
    mask = _doc_mask(12)
    result = _run("matmul", inputs, doc_mask=mask)
    _assert_fp64_equal(result, _run("sdpa", inputs, doc_mask=mask))
    o = result[0]
    # the first token of row 0's second document sees only itself: its output is its own value
    torch.testing.assert_close(o[0, :, 5], inputs[2][0, :, 5], atol=1e-12, rtol=0)


def test_bf16_matmul_kernel_error_is_bf16_level():
    """In bf16 the matmul kernel rounds the scores once; its error against fp64 stays within 2x SDPA's
    (which computes bf16 inputs in fp32 on the CPU; measured 1.0-1.3x), forward and backward."""
    exact = _run("sdpa", _inputs(64, 64, torch.float64, seed=2))
    low = _inputs(64, 64, torch.bfloat16, seed=2)

    def rms(a, b):
        return (a.double() - b).pow(2).mean().sqrt().item()

    matmul_out, sdpa_out = _run("matmul", low), _run("sdpa", low)
    assert rms(matmul_out[0], exact[0]) < 2 * rms(sdpa_out[0], exact[0])
    for a, s, e in zip(matmul_out[1], sdpa_out[1], exact[1]):
        assert rms(a, e) < 2 * rms(s, e)
        assert rms(a, e) < 1e-2 * e.pow(2).mean().sqrt().item()  # bf16 level: well under 1% of the gradient


def test_auto_picks_matmul_for_low_precision_on_the_cpu():
    q = torch.zeros(1, 1, 2, 4)
    assert resolve_attention_kernel("auto", q) == "sdpa"
    assert resolve_attention_kernel("auto", q.bfloat16()) == "matmul"
    assert resolve_attention_kernel("auto", q.half()) == "matmul"
    assert resolve_attention_kernel("sdpa", q.bfloat16()) == "sdpa"
    with pytest.raises(ValueError, match="flash"):
        resolve_attention_kernel("flash", q)


@pytest.mark.parametrize("name", ["gqa", "mla"])
def test_an_unknown_kernel_is_a_config_error_naming_the_key(name):
    from components.registry import MIXERS

    extra = {"n_kv_heads": 2} if name == "gqa" else {}
    cfg = MIXERS.get(name).config_cls(attention_kernel="flash", **extra)
    model = OmegaConf.create({"d_model": 64})
    with pytest.raises(ConfigError, match=r"mixer\.attention_kernel.*auto, sdpa, matmul"):
        cfg.validate(model, "mixer")


@pytest.mark.parametrize("name", ["gqa", "mla"])
def test_the_mixers_run_the_configured_kernel(name, monkeypatch):
    """``attention_kernel`` reaches the op: ``matmul`` (and ``auto`` under bf16 autocast on the CPU) runs the
    matmul form, ``sdpa`` (and ``auto`` in fp32) SDPA; in fp64 the two give the same layer output."""
    import components.ops.attention as op
    from components.nn.build_context import BuildContext
    from components.registry import MIXERS

    calls = []
    real = op.matmul_attention
    monkeypatch.setattr(op, "matmul_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    extra = {"n_kv_heads": 2} if name == "gqa" else {}
    x = torch.randn(2, 7, 32, dtype=torch.float64)

    def run(kernel, dtype=torch.float64, autocast=False):
        torch.manual_seed(0)
        cfg = MIXERS.get(name).config_cls(attention_kernel=kernel, **extra)
        mixer = MIXERS.build(cfg, BuildContext(32)).to(dtype)
        calls.clear()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = mixer(x.to(dtype))
        return out, len(calls)

    out_matmul, n = run("matmul")
    assert n == 1
    out_sdpa, n = run("sdpa")
    assert n == 0
    torch.testing.assert_close(out_matmul, out_sdpa, atol=1e-12, rtol=1e-12)
    assert run("auto", torch.float32)[1] == 0
    assert run("auto", torch.float32, autocast=True)[1] == 1
