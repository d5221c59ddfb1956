"""The token-mean loss of a whole data-parallel micro-batch, from each rank's share of it.

Ranks may score different numbers of tokens (padding, ignored targets, tasks that score only answer
positions). Dividing each rank's summed loss by its own count and letting DDP/FSDP average gradients
over ranks would weight every rank equally rather than every token. Dividing by the global count (one
all-reduce of two numbers) and multiplying by the world size -- which the gradient average divides
out again -- gives exactly the gradient of the global token mean, as one process with the same batch.
"""

from __future__ import annotations

import torch

from components.distributed import all_reduce_sum_, world_size


def global_token_mean(loss_sum: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to backpropagate on this rank, global token-mean loss to log) for a summed token loss
    ``loss_sum`` over ``count`` scored tokens of this rank."""
    world = world_size()
    if world == 1:
        mean = loss_sum / count.clamp(min=1)
        return mean, mean.detach()
    totals = all_reduce_sum_(torch.stack([loss_sum.detach(), count.to(loss_sum.dtype)]))  # [sum, count] over ranks
    global_count = totals[1].clamp(min=1)
    return loss_sum * world / global_count, totals[0] / global_count
