"""The residual-scheme contract: a module that owns the depth stream.

The decoder never writes ``x + f(x)`` itself. For each layer ``l`` it asks the scheme for the input of
sublayer ``s`` (``s = 2l`` for the mixer, ``2l + 1`` for the FFN) passed through that sublayer's pre-norm,
applies the sublayer, and hands the output back:

    state = scheme.start(embedding)
    x = scheme.read(state, s, norm);  state = scheme.write(state, s, sublayer(x))   # for every s
    y = scheme.finish(state, final_norm)                                            # the output

``read`` and ``finish`` take the norm (or None for the raw read) so a scheme may fuse it with its read
(AttnRes recomputes both in backward). ``state`` is whatever the scheme needs (a tensor, a tuple of
sources); the decoder only passes it along.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from components.nn.build_context import BuildContext
from components.nn.weight_decay import HasNoWeightDecay


@dataclass(frozen=True)
class CheckpointName:
    """Where one of a scheme's tensors sits in an exported checkpoint: ``key`` below the decoder's
    prefix (``model.``), stored with ``shape`` (None: the tensor's own shape)."""

    key: str
    shape: Optional[tuple[int, ...]] = None


class ResidualScheme(HasNoWeightDecay):
    """Base class of every registered residual scheme (``RESIDUALS.register``).

    Constructor: ``Scheme(cfg, ctx)`` with ``ctx`` a ``components.nn.build_context.BuildContext`` (the
    scheme reads ``d_model``, ``n_layers`` and ``norm_eps``; it is built once for the whole depth).
    """

    def __init__(self, cfg: Any, ctx: BuildContext):
        super().__init__()
        self.cfg = cfg
        self.d_model = ctx.d_model
        self.n_layers = ctx.n_layers
        # set by the depth-weight callback around validation; schemes without depth weights ignore it
        self.record_weights = False

    def start(self, x0: torch.Tensor) -> Any:
        """The stream's state after the embedding ``x0 [B, T, d]``."""
        raise NotImplementedError

    def read(self, state: Any, sublayer: int, norm: Optional[nn.Module] = None) -> torch.Tensor:
        """The (normed) input of sublayer ``sublayer``: ``[B, T, d]``."""
        raise NotImplementedError

    def write(self, state: Any, sublayer: int, out: torch.Tensor) -> Any:
        """The state after sublayer ``sublayer`` produced ``out [B, T, d]``."""
        raise NotImplementedError

    def finish(self, state: Any, norm: Optional[nn.Module] = None) -> torch.Tensor:
        """The (normed) output of the stack: ``[B, T, d]``."""
        raise NotImplementedError

    # -- diagnostics and accounting --------------------------------------------------------------
    def sources_per_read(self) -> Optional[list[tuple[Any, int]]]:
        """(sublayer index or "final", number of sources) for every read, if the scheme mixes sources
        (AttnRes); None for a plain running sum."""
        return None

    def flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token of the depth reads (``components/flop_count.py``); 0 for a running sum."""
        reads = self.sources_per_read()
        if reads is None:
            return 0.0
        # per read of S sources: S query logits and the weighted sum, d multiply-adds each
        return 2.0 * 2 * self.d_model * sum(sources for _, sources in reads)

    def depth_weights(self) -> Optional[dict[str, Any]]:
        """Mean depth-mixing weights recorded while ``record_weights`` was on; None when there are none."""
        return None

    def reset_depth_weights(self) -> None:
        """Forget recorded depth weights."""

    # -- export ---------------------------------------------------------------------------------
    def checkpoint_names(self) -> dict[str, CheckpointName]:
        """``{state-dict key below residual.: CheckpointName}`` for every tensor the scheme owns, so an
        export (``components/hf/key_map.py``) can name them; a scheme without parameters has none."""
        return {}
