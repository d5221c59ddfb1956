"""The decoder: embedding -> layers (mixer + FFN, each pre-normed) -> residual scheme -> norm -> head.

Which mixer and FFN each layer holds comes from the layer plan; how sublayer outputs are combined over
depth is the residual scheme's business (plain sum, or attention over depth). The decoder is built from
its own config (``components.config.DecoderConfig``) and calls its components only through their
contracts (``components/{mixers,ffn,residual}/base.py``).

Document masking: ``segments`` (``components.nn.segments.Segments``) reaches every mixer, which keeps
the documents of a row apart. FFNs and residual schemes work per token (the schemes mix over depth
only), so they need nothing.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from torch import nn

from components.config import DecoderConfig
from components.decode_cache import DecoderCache
from components.ffn.base import FFN
from components.flop_count import training_flops_per_token
from components.layer_plan import LayerSpec
from components.mixers.base import Mixer
from components.mtp import MTPDepth, mtp_losses, mtp_spec
from components.nn.build_context import BuildContext
from components.nn.recompute import checkpointed
from components.nn.rmsnorm import RMSNorm
from components.nn.segments import Segments
from components.registry import FFNS, MIXERS, RESIDUALS
from components.residual.base import ResidualScheme


class DecoderLayer(nn.Module):
    def __init__(self, spec: LayerSpec, ctx: BuildContext):
        super().__init__()
        self.index = spec.index
        self.spec = spec  # slots and component configs of this layer
        self.mixer_norm = RMSNorm(ctx.d_model, ctx.norm_eps)
        self.mixer: Mixer = MIXERS.build(spec.mixer, ctx)
        self.ffn_norm = RMSNorm(ctx.d_model, ctx.norm_eps)
        self.ffn: FFN = FFNS.build(spec.ffn, ctx)
        # recompute this layer's forward in backward instead of saving its activations (training only);
        # a plain attribute, so parameter and state-dict names stay the same
        self.activation_checkpointing = False

    def forward(
        self,
        state: Any,
        residual: ResidualScheme,
        mixer_state: Any = None,
        offset: int = 0,
        segments: Optional[Segments] = None,
    ) -> Any:
        """Both sublayers on the residual scheme's ``state`` (one call, so wrappers such as FSDP2 that
        hook a module's forward see the whole layer). With ``activation_checkpointing`` the two sublayers
        run checkpointed inside this call: FSDP2's hooks stay outside, so the parameters it gathers for
        backward are there when the layer is recomputed. ``segments``: documents of the rows (or None)."""
        if self.activation_checkpointing and self.training and torch.is_grad_enabled() and mixer_state is None:
            return checkpointed(self._sublayers, state, residual, offset, None, segments)
        return self._sublayers(state, residual, offset, mixer_state, segments)

    def _sublayers(
        self,
        state: Any,
        residual: ResidualScheme,
        offset: int = 0,
        mixer_state: Any = None,
        segments: Optional[Segments] = None,
    ) -> Any:
        s = 2 * self.index
        x = residual.read(state, s, self.mixer_norm)
        # segments only when there are some: a mixer written before document masking still runs without
        mixed = (
            self.mixer(x, state=mixer_state, offset=offset)
            if segments is None
            else self.mixer(x, state=mixer_state, offset=offset, segments=segments)
        )
        state = residual.write(state, s, mixed)
        x = residual.read(state, s + 1, self.ffn_norm)
        return residual.write(state, s + 1, self.ffn(x))


class Decoder(nn.Module):
    """``model(input_ids [B, T]) -> logits [B, T, vocab]``; ``cache=`` for incremental decoding."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        m = cfg.model
        self.config = cfg
        self.d_model = m.d_model
        self.vocab_size = m.vocab_size
        self.plan: list[LayerSpec] = cfg.layers
        ctx = BuildContext.for_model(m)
        self.embed = nn.Embedding(m.vocab_size, m.d_model)
        nn.init.normal_(self.embed.weight, std=m.init_std)
        self.layers = nn.ModuleList(DecoderLayer(spec, ctx.at_layer(spec.index)) for spec in self.plan)
        self.residual: ResidualScheme = RESIDUALS.build(cfg.residual, ctx)
        self.norm = RMSNorm(m.d_model, m.norm_eps)
        # training-only multi-token prediction depths (empty unless model.mtp_depth > 0)
        self.mtp = nn.ModuleList(
            MTPDepth(spec, ctx.at_layer(spec.index))
            for spec in (mtp_spec(self.plan[-1], m.n_layers, k) for k in range(1, m.mtp_depth + 1))
        )
        self.lm_head = nn.Linear(m.d_model, m.vocab_size, bias=False)
        if m.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        else:
            nn.init.normal_(self.lm_head.weight, std=m.init_std)

    def set_activation_checkpointing(self, enabled: bool = True) -> None:
        """Recompute every decoder layer's forward in backward (training): activations of a layer are
        no longer kept between forward and backward, for about one more forward of compute. Loss,
        gradients and router statistics are those of the plain model (``components/nn/recompute.py``)."""
        for layer in self.layers:
            layer.activation_checkpointing = enabled

    def new_cache(self) -> DecoderCache:
        return DecoderCache(len(self.layers))

    def hidden_states(
        self, input_ids: torch.Tensor, cache: Optional[DecoderCache] = None, segments: Optional[Segments] = None
    ) -> torch.Tensor:
        """Final-normed hidden states ``[B, T, d]``. ``segments``: the documents of each row (document
        masking: no token sees another document); None: one document per row."""
        B, T = input_ids.shape
        if segments is not None and tuple(segments.shape) != (B, T):
            raise ValueError(f"segments are {tuple(segments.shape)}, input_ids {(B, T)}")
        offset = cache.seq_len if cache is not None else 0
        state = self.residual.start(self.embed(input_ids))  # embedding: [B, T, d]
        for layer in self.layers:
            mixer_state = cache.layer(layer.index, layer.mixer, B) if cache is not None else None
            state = layer(state, self.residual, mixer_state, offset, segments)
        if cache is not None:
            cache.seq_len += T
        return self.residual.finish(state, self.norm)

    def forward(
        self, input_ids: torch.Tensor, cache: Optional[DecoderCache] = None, segments: Optional[Segments] = None
    ) -> torch.Tensor:
        return self.lm_head(self.hidden_states(input_ids, cache, segments))

    def mtp_losses(
        self, hidden: torch.Tensor, input_ids: torch.Tensor, targets: torch.Tensor, segments: Optional[Segments] = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per MTP depth: (summed cross-entropy, scored tokens) on targets shifted by the depth;
        ``hidden`` is ``hidden_states(input_ids, segments=segments)`` (components/mtp.py). Empty without MTP."""
        return mtp_losses(self.mtp, self.embed, self.norm, self.lm_head, hidden, input_ids, targets, segments)

    # -- accounting -------------------------------------------------------------------------------
    def mtp_params(self) -> int:
        """Parameters of the training-only MTP depths (not part of the released model)."""
        return sum(p.numel() for p in self.mtp.parameters())

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # tied weights are counted once
        if exclude_embedding:
            n -= self.embed.weight.numel()
        return n

    def active_params(self) -> int:
        """Weights one token multiplies by in matrix products (embedding lookup excluded, head included)."""
        total = sum(p.numel() for p in self.parameters()) - self.embed.weight.numel()
        if self.lm_head.weight is self.embed.weight:
            total += self.lm_head.weight.numel()
        for block in [*self.layers, *self.mtp]:
            total -= block.ffn.num_params() - block.ffn.active_params()
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at a sequence length (the parts: ``components/flop_count.py``)."""
        return sum(training_flops_per_token(self, seq_len).values())

    def decode_state_numbers(self) -> dict[str, int]:
        """Numbers the decoding state of one sequence holds, all layers: ``per_token`` for the growing
        caches (K/V, MLA latents) and ``fixed`` for the fixed-size states (KDA's S and convolution
        windows); a T-token sequence holds per_token * T + fixed (Zoology's state-size axis)."""
        return {
            "per_token": sum(layer.mixer.cache_numbers_per_token() for layer in self.layers),
            "fixed": sum(layer.mixer.state_numbers() for layer in self.layers),
        }

    def compile_unfriendly(self) -> list[str]:
        """Class names of the components that declare ``compile_friendly = False``."""
        parts = [c for layer in self.layers for c in (layer.mixer, layer.ffn) if not c.compile_friendly]
        return sorted({type(c).__name__ for c in parts})


@contextmanager
def _no_random_normal() -> Iterator[None]:
    original = torch.Tensor.normal_
    torch.Tensor.normal_ = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.normal_ = original  # type: ignore[method-assign]


def build_on_meta(cfg: DecoderConfig) -> Decoder:
    """``Decoder(cfg)`` with every parameter and buffer on the meta device: shapes and counts without
    allocating weights. Random initialisation means nothing there, and torch's meta ``normal_`` costs
    seconds the first time a process uses it (it loads Python decompositions), which every pre-flight
    check and model report would pay; so ``normal_`` is a no-op while the model is built."""
    with torch.device("meta"), _no_random_normal():
        return Decoder(cfg)
