"""Multi-token prediction (MTP, DeepSeek-V3 style; K3's pretraining had one such layer).

Depth k (1..D) predicts the token k+1 positions ahead. At position i it combines its input hidden state
``h^{k-1}_i`` (depth 1: the backbone's) with the embedding of the token k positions ahead:

    h'_i  = W_k [RMSNorm(h^{k-1}_i) ; RMSNorm(Emb(x_{i+k}))]        W_k: 2d -> d
    h^k   = Block_k(h'_{0..T-k-1})                                   causal, plain pre-norm residual
    logits = Head(FinalNorm(h^k))      -> targets x_{i+k+1}

and the training loss adds ``mtp_weight`` times the mean over depths of those cross-entropies. The
embedding, final norm and head are the backbone's (shared); each depth owns its two norms, its
projection and one decoder layer built like the backbone's last layer (K3: MLA with a Stable LatentMoE
FFN).

Which hidden state MTP reads: the backbone's output as the head sees it, after the residual scheme's
final read (with AttnRes: the attention over all depth summaries) and the final norm. That is the one
representation every residual scheme hands to the head, so MTP works unchanged for plain and AttnRes
models; the depth stream's summaries stay private to the backbone, and the MTP block adds to its own
plain residual, as DeepSeek-V3's MTP block does. With document masking, depth k keeps position i inside
the document of the token it reads ahead. MTP layers are training-only: generation and cached
decoding never run them, and parameter counts of the released model exclude them.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from components.layer_plan import LayerSpec
from components.nn.build_context import BuildContext
from components.nn.rmsnorm import RMSNorm
from components.nn.segments import Segments
from components.objective import scored_loss_sum
from components.registry import FFNS, MIXERS


class MTPDepth(nn.Module):
    """One MTP depth: two input norms, the 2d -> d projection, and one decoder block."""

    def __init__(self, spec: LayerSpec, ctx: BuildContext):
        super().__init__()
        d_model, norm_eps, init_std = ctx.d_model, ctx.norm_eps, ctx.init_std
        self.hidden_norm = RMSNorm(d_model, norm_eps)
        self.embed_norm = RMSNorm(d_model, norm_eps)
        self.proj = nn.Linear(2 * d_model, d_model, bias=False)
        nn.init.normal_(self.proj.weight, std=init_std)
        self.mixer_norm = RMSNorm(d_model, norm_eps)
        self.mixer = MIXERS.build(spec.mixer, ctx)
        self.ffn_norm = RMSNorm(d_model, norm_eps)
        self.ffn = FFNS.build(spec.ffn, ctx)

    def forward(
        self, hidden: torch.Tensor, ahead_embedding: torch.Tensor, segments: Optional[Segments] = None
    ) -> torch.Tensor:
        """``hidden``, ``ahead_embedding``: ``[B, L, d]`` -> this depth's hidden states ``[B, L, d]``."""
        x = self.proj(torch.cat([self.hidden_norm(hidden), self.embed_norm(ahead_embedding)], dim=-1))  # [B, L, d]
        x = x + (
            self.mixer(self.mixer_norm(x)) if segments is None else self.mixer(self.mixer_norm(x), segments=segments)
        )
        return x + self.ffn(self.ffn_norm(x))


def mtp_spec(last: LayerSpec, n_layers: int, depth: int) -> LayerSpec:
    """Depth ``depth`` (1-based) is built like the backbone's last layer, numbered after it."""
    return dataclasses.replace(last, index=n_layers + depth - 1)


def mtp_losses(
    depths: nn.ModuleList,
    embed: nn.Embedding,
    final_norm: nn.Module,
    head: nn.Module,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    segments: Optional[Segments] = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per depth k: (summed cross-entropy, scored tokens) of predicting ``targets`` shifted by k.

    ``hidden [B, T, d]``: the backbone's hidden states as its head reads them; ``input_ids``, ``targets``
    ``[B, T]`` with ``targets[:, i] = input_ids[:, i + 1]`` (or IGNORE_INDEX). With document ``segments``
    the block at depth k keeps position i to the document of the token it reads ahead, x_{i+k}."""
    out = []
    h = hidden
    T = input_ids.shape[1]
    for k, depth in enumerate(depths, start=1):
        if T - k < 1:
            break
        ahead = None if segments is None else Segments(segments.ids[:, k:])
        h = depth(h[:, : T - k], embed(input_ids[:, k:]), ahead)  # position i sees x_{i+k}: [B, T-k, d]
        out.append(scored_loss_sum(head, final_norm(h), targets[:, k:]))  # targets x_{i+k+1}
    return out
