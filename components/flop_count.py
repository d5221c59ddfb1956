"""Exact parameter and FLOP accounting of a composed decoder, the quantities a scaling fit is made of.

FLOPs are counted as 2 per multiply-add, per training token, for one forward pass; a training step is
taken as 3 forward passes (the backward pass of a product costs two more: the input's and the weight's
gradients). Parts:

- ``weights``: products with the decoder layers' weight matrices and convolution filters (every
  tensor of two or more dimensions one token multiplies by: routed experts it is not sent to, the
  router and the norms' gain vectors excluded);
- ``router``: the MoE routers' score products;
- ``mixing``: the sequence mixers' work that is not a product with weights (attention scores and
  weighted sums, KDA's chunked recurrence; ``Mixer.flops_per_token``);
- ``attnres``: the residual scheme's depth reads (``ResidualScheme.flops_per_token``);
- ``head``: the output projection onto the vocabulary;
- ``mtp``: the training-only multi-token-prediction depths, all of the above for each, its input
  projection and its pass through the head (depth k scores the T - k positions it can predict).

Not counted (elementwise or lookups, a few percent at most at the sandbox's sizes): the embedding
lookup, norms, activations, softmax, gates and decays, rotary embeddings, the loss.
"""

from __future__ import annotations

from typing import Any

from torch import nn

FLOP_PARTS = ("weights", "router", "mixing", "attnres", "head", "mtp")
TRAINING_PASSES = 3  # forward + backward (input and weight gradients)


def _matrix_numbers(module: nn.Module, skip: tuple[nn.Module, ...] = ()) -> int:
    skipped = {id(p) for m in skip if m is not None for p in m.parameters()}
    return sum(p.numel() for p in module.parameters() if p.ndim >= 2 and id(p) not in skipped)


def _block_forward(block: Any, seq_len: int) -> dict[str, float]:
    """One decoder layer (or MTP block) per token: its weight products, router and mixing."""
    ffn = block.ffn
    router = ffn.router()
    weights = _matrix_numbers(block.mixer) + _matrix_numbers(ffn, skip=(router,)) - ffn.unchosen_expert_params()
    return {
        "weights": 2.0 * weights,
        "router": 2.0 * _matrix_numbers(router) if router is not None else 0.0,
        "mixing": float(block.mixer.flops_per_token(seq_len)),
    }


def forward_flops_per_token(model: Any, seq_len: int) -> dict[str, float]:
    """``{part: forward FLOPs per training token}`` of a ``components.model.Decoder`` at ``seq_len``."""
    parts = dict.fromkeys(FLOP_PARTS, 0.0)
    for layer in model.layers:
        for part, flops in _block_forward(layer, seq_len).items():
            parts[part] += flops
    parts["attnres"] = float(model.residual.flops_per_token(seq_len))
    head = 2.0 * model.lm_head.weight.numel()
    parts["head"] = head
    for k, depth in enumerate(model.mtp, start=1):
        share = max(seq_len - k, 0) / seq_len  # depth k runs on the T - k positions it can predict
        block = sum(_block_forward(depth, seq_len - k).values()) + 2.0 * depth.proj.weight.numel()
        parts["mtp"] += share * (block + head)
    return parts


def training_flops_per_token(model: Any, seq_len: int) -> dict[str, float]:
    """``{part: training FLOPs per token}``: the forward parts times ``TRAINING_PASSES``."""
    return {part: TRAINING_PASSES * flops for part, flops in forward_flops_per_token(model, seq_len).items()}


def parameter_counts(model: Any) -> dict[str, int]:
    """Stored parameters: ``total``, ``embedding``, ``non_embedding`` (total less the embedding; a tied
    head is part of the embedding), ``active`` (what one token multiplies by, head included, embedding
    lookup and unchosen experts excluded), ``mtp`` (the training-only depths, inside the others)."""
    total = model.num_params()
    embedding = model.embed.weight.numel()
    return {
        "total": total,
        "embedding": embedding,
        "non_embedding": total - embedding,
        "active": model.active_params(),
        "mtp": model.mtp_params(),
    }


def compute_record(model: Any, seq_len: int, train_tokens: int) -> dict[str, Any]:
    """What a run's ``summary.json`` records of its size and compute (``compute`` there)."""
    per_token = training_flops_per_token(model, seq_len)
    return {
        "params": parameter_counts(model),
        "seq_len": seq_len,
        "train_tokens": train_tokens,
        "flops_per_token": sum(per_token.values()),
        "train_flops": sum(per_token.values()) * train_tokens,
        "train_flops_by_part": {part: flops * train_tokens for part, flops in per_token.items()},
    }
