"""The token-mean loss of a whole data-parallel micro-batch, from each rank's share of it.

Ranks may score different numbers of tokens (padding, ignored targets, tasks that score only answer
positions). Dividing each rank's summed loss by its own count and letting DDP/FSDP average gradients
over ranks would weight every rank equally rather than every token. Each rank divides its summed loss by
the global count instead (one all-reduce of two numbers), so the gradients of all ranks add up to exactly
the gradient of the global token mean, as one process with the same batch. How the strategy combines them:

* DDP averages gradients over ranks: the loss is multiplied by the world size, which the average divides out;
* FSDP2 (runtime/strategies.py::shard_fsdp2) sums them, with no division at all: under expert parallelism an
  expert's gradient already holds the contributions of every rank of its expert-parallel group (they arrive
  by all-to-all) and is reduced over the other mesh dimension only, so no one division factor fits every
  parameter; the sum does. ``shard_fsdp2`` calls ``sum_gradients_over_ranks()``.
"""

from __future__ import annotations

import torch

from components.distributed import all_reduce_sum_, world_size

# whether the strategy sums gradients over ranks (FSDP2 here) rather than averaging them (DDP)
_GRADIENTS_SUMMED = False


def sum_gradients_over_ranks(summed: bool = True) -> None:
    """Declare that this process's strategy sums gradients over ranks (``False``: averages them, DDP's way)."""
    global _GRADIENTS_SUMMED
    _GRADIENTS_SUMMED = summed


def global_token_mean(loss_sum: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to backpropagate on this rank, global token-mean loss to log) for a summed token loss
    ``loss_sum`` over ``count`` scored tokens of this rank."""
    world = world_size()
    if world == 1:
        mean = loss_sum / count.clamp(min=1)
        return mean, mean.detach()
    totals = all_reduce_sum_(torch.stack([loss_sum.detach(), count.to(loss_sum.dtype)]))  # [sum, count] over ranks
    global_count = totals[1].clamp(min=1)
    scale = 1 if _GRADIENTS_SUMMED else world
    return loss_sum * scale / global_count, totals[0] / global_count
