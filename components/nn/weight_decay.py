"""Weight-decay exclusion, declared by parameter name (collected by ``components/optim/param_groups.py``).

By name rather than by a mark on the Parameter object: sharding (FSDP2), dtype and device moves and
deepcopy all replace Parameter objects, and a name survives every one of them.
"""

from __future__ import annotations

from torch import nn


class HasNoWeightDecay(nn.Module):
    """A module that may keep some of its own parameters out of weight decay (names relative to it)."""

    def no_weight_decay(self) -> set[str]:
        """Names of this module's own parameters that are never decayed; empty by default."""
        return set()
