"""Model-level cache for incremental decoding.

``model(ids, cache=cache)`` processes only the new tokens. Each mixer owns the layout of its own
per-layer state (attention: K/V; latent attention: the latent; linear attention: a recurrent state and
conv inputs) and creates it on first use through ``mixer.new_cache(batch_size)``; this object only
holds the per-layer states and the number of tokens seen so far.
"""

from __future__ import annotations

from typing import Any

import torch


class DecoderCache:
    def __init__(self, n_layers: int):
        self.layers: list[Any] = [None] * n_layers
        self.seq_len = 0  # tokens already processed (the position of the next new token)

    def layer(self, index: int, mixer: torch.nn.Module, batch_size: int) -> Any:
        if self.layers[index] is None:
            self.layers[index] = mixer.new_cache(batch_size)
        return self.layers[index]

    def nbytes(self) -> int:
        """Bytes held by all per-layer states."""
        total = 0
        for state in self.layers:
            if state is None:
                continue
            for value in vars(state).values():
                if isinstance(value, torch.Tensor):
                    total += value.numel() * value.element_size()
        return total
