"""The sequence-mixer contract: what the decoder, the optimizer, the reports and the trainer may call.

A mixer maps the pre-normed sublayer input ``x [B, T, d]`` to ``[B, T, d]``, causally: output t
depends on inputs 0..t only. For incremental decoding it owns the layout of its per-layer cache: the
decoder asks ``new_cache(batch_size)`` once and passes that object back on every later call, with
``offset`` the absolute position of the first of the T new tokens.

Document masking: ``segments`` (``components.nn.segments.Segments``, or None) says which positions of
each row belong to the same document (training windows cut from a stream of documents). With it, output
t depends only on inputs of t's own document at or before t: attention is masked to the document,
recurrent states and convolution windows restart at each document start. ``segments=None`` means one
document per row (the behaviour without document masking, unchanged). The decoder passes ``segments``
only when it has some (``segments=None`` is not passed), and never together with a decoding ``state``;
a mixer may refuse that combination with ``ValueError``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from components.nn.segments import Segments
from components.nn.sublayer import Sublayer


class Mixer(Sublayer):
    """Base class of every registered mixer (``MIXERS.register``).

    Constructor: ``Mixer(cfg, ctx)`` with ``ctx`` a ``components.nn.build_context.BuildContext``
    (``d_model``, ``layer_idx``, ``init_std``, ``out_init_std``: the init scale of the projection that
    writes the residual stream, None: ``init_std``; ``norm_eps``).
    """

    def forward(
        self, x: torch.Tensor, state: Any = None, offset: int = 0, segments: Optional[Segments] = None
    ) -> torch.Tensor:
        """``x [B, T, d]`` -> ``[B, T, d]``; ``state`` (from ``new_cache``) is updated in place;
        ``segments`` (``[B, T]`` documents, or None: one per row) keeps the documents apart."""
        raise NotImplementedError

    def new_cache(self, batch_size: int) -> Any:
        """An empty per-layer decoding state for ``batch_size`` sequences."""
        raise NotImplementedError

    def max_seq_len(self) -> Optional[int]:
        """The longest sequence this mixer can process (a table of learned positions, a fixed window
        buffer); None: any length. Evaluation refuses longer lengths by name (analysis.evaluate)."""
        return None

    # -- accounting (analysis.model_report, throughput MFU) ------------------------------------------
    def flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token that are not products with weight matrices (attention scores, the
        recurrence), averaged over a causal sequence of ``seq_len`` tokens; 2 FLOPs per multiply-add."""
        return 0.0

    def cache_numbers_per_token(self) -> int:
        """Numbers the decoding cache grows by per token (K/V, latents); 0 for fixed-size states."""
        return 0

    def recurrent_state_numbers(self) -> int:
        """Numbers of a fixed-size recurrent state held per sequence (KDA's S [H, K, V]); 0 if none."""
        return 0

    def state_numbers(self) -> int:
        """All fixed-size numbers held per sequence (recurrent state plus e.g. convolution windows)."""
        return self.recurrent_state_numbers()

    def decode_macs(self) -> Optional[dict[str, int]]:
        """Multiply-adds per (query, cached position) pair in training (prefill) order and in decoding
        order, for mixers whose two orders differ (MLA's absorbed decoding); None otherwise."""
        return None
