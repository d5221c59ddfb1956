"""The training objective: next-token cross-entropy, the one definition every loss and score uses.

Training and MTP sum it over the scored positions and divide by their count (the data-parallel token
mean); validation, length evaluation and the harness log-likelihoods read it per token. Targets equal
to ``IGNORE_INDEX`` are not scored: padding, positions outside an evaluation bucket, MQAR's unscored
tokens. With document masking the model sees each token's own document only (``document_segments``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from components.nn.segments import Segments

IGNORE_INDEX = -100


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "none") -> torch.Tensor:
    """Cross-entropy in fp32 whatever the activation dtype. ``logits [..., V]``, ``targets [...]`` ->
    per-token losses shaped like ``targets`` (0 where ignored), or their sum with ``reduction="sum"``."""
    loss = F.cross_entropy(
        logits.float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX, reduction=reduction
    )
    return loss.view_as(targets) if reduction == "none" else loss


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``logits [B, T, V]``, ``targets [B, T]`` -> per-token losses ``[B, T]`` (0 at ignored targets)."""
    return cross_entropy(logits, targets)


def scored_loss_sum(
    head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, scored tokens) of ``head`` on ``hidden [B, T, d]`` against ``targets [B, T]``. Only
    the scored positions are projected: on sparse tasks (MQAR) the output layer is most of the work."""
    mask = targets != IGNORE_INDEX
    logits = head(hidden[mask])  # [N, vocab]
    return cross_entropy(logits, targets[mask], reduction="sum"), mask.sum()


def document_segments(x: torch.Tensor, eod_id: Optional[int], document_masking: bool) -> Optional[Segments]:
    """With document masking: the documents of ``x [B, T]`` (the end-of-document token begins the next)."""
    return Segments.from_eod(x, eod_id) if document_masking else None
