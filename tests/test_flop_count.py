"""The analytic FLOP accounting (``components/flop_count.py``) against PyTorch's own count of a forward
and backward pass (``torch.utils.flop_counter.FlopCounterMode``), for every registered mixer and FFN
form at two sizes.

What the counter sees and the accounting does not, or the other way round (the known exclusions):
- the counter does not know the CPU's fused attention op; its formula is registered below (every
  (query, key) pair of the square, like the counter's own GPU formulas);
- it counts a causal attention's whole square, while the accounting counts the (T + 1) / 2 keys a causal
  query sees on average: the comparison scales the square by (T + 1) / (2 T);
- its formula for the backward of a depthwise (grouped) convolution counts it as a dense one, so
  convolutions are compared by their forward pass times three;
- MoE experts run here with ``ffn.dispatch=loop`` (one ``F.linear`` per expert): the counter has no
  formula for ``grouped_mm`` on the CPU;
- KDA: the accounting counts the chunked algorithm's products; the CPU reference also forms per-channel
  decay products that the kernels fold into their inputs, so its forward pass does more work (the
  accounting is 60-100% of it), and its backward recomputes the chunk products (not compared);
- AttnRes reads are elementwise products and sums the counter does not see; their part is checked
  against the scheme's reads directly.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from components import registry
from components.flop_count import TRAINING_PASSES, forward_flops_per_token, parameter_counts, training_flops_per_token
from components.model import Decoder
from tests.helpers import compose_root

aten = torch.ops.aten
T = 64  # one KDA chunk: the CPU reference pads a shorter sequence to a whole chunk
SIZES = {"small": ["model.d_model=64"], "wider": ["model.d_model=96", "model.n_layers=3"]}
MOE_FORMS = {"moe", "latent_moe", "stable_latent_moe"}
WEIGHT_OPS = {"mm", "addmm", "bmm", "baddbmm"}


def _sdpa_forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    b, h, s_q, d = query_shape
    s_k, d_v = key_shape[2], value_shape[3]
    return 2 * b * h * s_q * s_k * (d + d_v)


def _sdpa_backward(grad_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * _sdpa_forward(query_shape, key_shape, value_shape)


CPU_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_forward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward,
}


def _model(*overrides: str) -> Decoder:
    root = compose_root("model=tiny", "data=corpus", "model.tie_embeddings=false", *overrides)
    torch.manual_seed(0)
    return Decoder(root.decoder_config())


def _counted(model: Decoder, batch: int = 2, by_module: bool = False) -> dict[str, float]:
    """Per training token: ``{op name: FLOPs}`` of one forward and backward pass."""
    ids = torch.randint(0, model.embed.weight.shape[0], (batch, T))
    counter = FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION)
    with counter:
        model(ids).sum().backward()
    counts = counter.get_flop_counts()["Global"]
    return {str(op).removeprefix("aten.").split(".")[0]: flops / (batch * T) for op, flops in counts.items()}


def _mixing_ops(counted: dict[str, float], exclude: float) -> float:
    """The counted products that are not weight products (``exclude``), attention included."""
    return (
        sum(v for k, v in counted.items() if k in WEIGHT_OPS)
        - exclude
        + counted.get("_scaled_dot_product_flash_attention_for_cpu", 0.0)
        + counted.get("_scaled_dot_product_flash_attention_for_cpu_backward", 0.0)
    )


def _check_weights(model: Decoder, counted: dict[str, float]) -> float:
    """Weight products (and convolutions) counted equal the accounting's; returns the counted ones."""
    parts = training_flops_per_token(model, T)
    conv = TRAINING_PASSES * counted.get("convolution", 0.0)
    matrix_products = parts["weights"] + parts["router"] + parts["head"] - conv
    assert counted.get("mm", 0.0) + counted.get("addmm", 0.0) == pytest.approx(matrix_products, rel=1e-12)
    return matrix_products


@pytest.mark.parametrize("size", sorted(SIZES))
@pytest.mark.parametrize("mixer", registry.MIXERS.names())
def test_mixer_flops_match_the_counter(mixer, size, monkeypatch):
    # KDA's short convolutions as PyTorch convolutions, which the counter sees (the native CPU op is opaque to it)
    import components.mixers.kda as kda_mixer

    monkeypatch.setattr(kda_mixer, "short_conv_native_available", lambda: False)
    model = _model(f"mixer={mixer}", "ffn=dense", *SIZES[size])
    counted = _counted(model)
    assert (
        set(counted)
        - WEIGHT_OPS
        - {"convolution", "convolution_backward"}
        - {str(op).split(".")[-1] for op in CPU_ATTENTION}
        == set()
    )
    weight_products = _check_weights(model, counted)
    mixing = training_flops_per_token(model, T)["mixing"]
    square = _mixing_ops(counted, weight_products)
    assert mixing > 0
    if mixer == "kda":
        # forward passes only: the CPU reference's backward also recomputes its chunk products. The chunked core
        # as the batched PyTorch form, whose products the counter sees (the native CPU kernel's are opaque to it)
        import components.ops.kda as kda_ops

        monkeypatch.setattr(kda_ops, "native_available", lambda: False)
        ids = torch.randint(0, model.embed.weight.shape[0], (2, T))
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            model(ids)
        counts = counter.get_flop_counts()["Global"]
        reference = sum(v for op, v in counts.items() if str(op).split(".")[1] in {"bmm", "baddbmm"}) / (2 * T)
        assert 0.6 * reference <= forward_flops_per_token(model, T)["mixing"] <= reference
    else:
        assert mixing == pytest.approx(square * (T + 1) / (2 * T), rel=1e-12)


@pytest.mark.parametrize("size", sorted(SIZES))
@pytest.mark.parametrize("ffn", registry.FFNS.names())
def test_ffn_flops_match_the_counter(ffn, size):
    extra = ["ffn.dispatch=loop", "ffn.num_experts=8", "ffn.top_k=2"] if ffn in MOE_FORMS else []
    model = _model("mixer=mla", f"ffn={ffn}", *extra, *SIZES[size])
    counted = _counted(model, batch=4)
    _check_weights(model, counted)
    parts = forward_flops_per_token(model, T)
    assert (parts["router"] > 0) == (ffn in MOE_FORMS)


def test_mtp_depths_are_counted_on_the_positions_they_predict():
    model = _model("mixer=mla", "ffn=dense", "model.mtp_depth=2")
    # the counter, the MTP losses included, against the accounting of every part but the mixing
    ids = torch.randint(0, model.embed.weight.shape[0], (2, T))
    counter = FlopCounterMode(display=False)
    with counter:
        hidden = model.hidden_states(ids)
        losses = model.mtp_losses(hidden, ids, ids)
        (model.lm_head(hidden).sum() + sum(loss for loss, _ in losses)).backward()
    counts = counter.get_flop_counts()["Global"]
    mm = sum(v for op, v in counts.items() if str(op).split(".")[1] in {"mm", "addmm"}) / (2 * T)
    parts = training_flops_per_token(model, T)
    mtp_mixing = sum(
        TRAINING_PASSES * (T - k) / T * depth.mixer.flops_per_token(T - k) for k, depth in enumerate(model.mtp, 1)
    )
    expected = parts["weights"] + parts["router"] + parts["head"] + parts["mtp"] - mtp_mixing
    assert mm == pytest.approx(expected, rel=1e-12)
    assert parts["mtp"] > 0


@pytest.mark.parametrize("residual", ["full_attnres", "block_attnres"])
def test_attnres_reads_are_counted_per_source(residual):
    model = _model(f"residual={residual}")
    reads = model.residual.sources_per_read()
    d = model.embed.weight.shape[1]
    assert forward_flops_per_token(model, T)["attnres"] == 4 * d * sum(sources for _, sources in reads)
    assert forward_flops_per_token(_model("residual=plain"), T)["attnres"] == 0


def test_parameter_counts_add_up():
    model = _model("mixer=kda", "ffn=moe", "model.mtp_depth=1", "model.tie_embeddings=true")
    counts = parameter_counts(model)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["non_embedding"] == counts["total"] - model.embed.weight.numel()
    assert 0 < counts["mtp"] < counts["non_embedding"] and counts["active"] < counts["total"]
