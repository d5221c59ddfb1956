"""Attention Residuals (docs/k3.md §7): each sublayer reads a softmax mix of earlier depth sources.

Instead of the running sum ``x + f(norm(x))``, the input of sublayer ``s`` is ``R(sources; w_s, gamma_s)``
(``components.ops.attnres.attnres_read``): per token, RMS-normalised sources are scored against a
learned pseudo-query ``w_s`` (folded with the key-norm gain ``gamma_s``), softmaxed over the sources,
and the RAW sources are mixed with those weights. A final read with its own query aggregates depth before
the output norm. Zero-initialised queries make every read the uniform mean of its sources.

``full_attnres`` (docs/k3.md §7.1): the sources of sublayer ``s`` are ``[embedding, out_0, ..., out_{s-1}]``;
the final read sees all ``2 * n_layers + 1``. Memory: the state keeps every sublayer output, so it grows
by one ``[B, T, d]`` tensor per sublayer (``2L + 1`` tensors at the end, O(L * B * T * d)), and the reads
cost O(L^2) in total.

``block_attnres`` (docs/k3.md §7.2 / 7.3, K3's exact wiring): sublayers are grouped into blocks of B sublayers
(``block_size`` decoder layers = 2 * block_size sublayers, or ``block_size`` sublayers with
``block_unit=sublayers``). Inside a block plain summation builds a partial sum; a completed block is kept
as one summary. A read attends over ``[embedding, block summaries..., partial]``. At a block start
(``s % B == 0``) the read still sees the just-finished block as the partial; it is sealed right after
that read and the new partial starts from that sublayer's output. Sublayer 0's input is the embedding
itself. B = 1 sublayer is exactly ``full_attnres``; B >= 2L reads ``[embedding, partial]`` everywhere.
Memory: the state holds at most ``n_blocks + 1`` tensors (``n_blocks = (2L - 1) // B + 1`` summaries,
embedding included, plus the partial), never one per sublayer. K3 (93 layers, block 12 layers): 8
summaries + partial, final read 9.

K3 checkpoints hold each pseudo-query as a ``Linear(d, 1)`` weight ``[1, d]``; here it is a ``[d]`` vector.
The sources keep the embedding's dtype (a bf16 sublayer output under autocast is cast up, as the plain
residual sum would promote it).

Training memory (``recompute=true``, the default): each read and the pre-norm after it run under
activation checkpointing, which saves only references to the read's sources and recomputes the read and
the norm in backward. The mixed input and the softmax weights are never stored, so the saved activations
are those of a plain residual (its stream tensor per sublayer is here the partial sum or, for full
AttnRes, the sublayer output) plus the block summaries, which are partial sums saved anyway: memory grows
with the number of blocks, not with the reads (``benchmarks/residual.py``). The price is one more read per
sublayer in backward. ``recompute=false`` keeps every read's output (one more ``[B, T, d]`` per sublayer).
On the CPU the read and its pre-norm are one native op (``components.ops.attnres.attnres_read_and_norm``)
whose backward recomputes the read from the sources: the memory of ``recompute=true`` without the second
read, whichever ``recompute`` says.
Full AttnRes keeps every sublayer output live (O(L) state: decoding, pipeline stages) and costs O(L^2)
read compute; blocks bound both.

Depth-weight diagnostics: with ``record_weights = True`` (a validation callback sets it) every read
accumulates its softmax weights averaged over batch and positions; ``depth_weights()`` returns the
sublayers x sources matrix averaged over the recorded batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from components.config import ComponentConfig
from components.nn.build_context import BuildContext
from components.nn.rmsnorm import RMSNorm
from components.ops.attnres import attnres_read, attnres_read_and_norm, fused_norm_applies
from components.ops.backend import allowed_backends
from components.registry import RESIDUALS, ConfigError
from components.residual.base import CheckpointName, ResidualScheme

ReadKey = Union[int, str]  # sublayer index, or "final"


class _AttnResConfigBase(ComponentConfig):
    backend: str
    eps: float

    def kernel_backends(self) -> dict[str, str]:
        return {"backend": self.backend}

    def validate(self, model: Any, key: str) -> None:
        allowed = allowed_backends("attnres")
        if self.backend not in allowed:
            raise ConfigError(f"{key}.backend", f"must be one of {', '.join(allowed)}, got '{self.backend}'")
        if not self.eps > 0:
            raise ConfigError(f"{key}.eps", f"must be positive, got {self.eps}")


@dataclass
class FullAttnResConfig(_AttnResConfigBase):
    name: str = "full_attnres"
    # torch | fla (fused Triton kernel, CUDA only) | auto (fla where it applies)
    backend: str = "torch"
    # epsilon of the key RMSNorm inside each read (K3: 1e-5); independent of model.norm_eps
    eps: float = 1e-5
    # training: recompute each read and its pre-norm in backward instead of saving the mixed input
    recompute: bool = True


BLOCK_UNITS = ("layers", "sublayers")


@dataclass
class BlockAttnResConfig(_AttnResConfigBase):
    name: str = "block_attnres"
    # block length, counted in block_unit (K3: 12 layers; 2 suits the small CPU models). Longer than
    # the model means one block.
    block_size: int = 2
    # layers (a decoder layer = its attention and FFN sublayers) or sublayers; 1 sublayer = full AttnRes
    block_unit: str = "layers"
    backend: str = "torch"
    eps: float = 1e-5
    recompute: bool = True

    def validate(self, model: Any, key: str) -> None:
        if self.block_size < 1:
            raise ConfigError(f"{key}.block_size", f"must be >= 1 ({self.block_unit} per block), got {self.block_size}")
        if self.block_unit not in BLOCK_UNITS:
            raise ConfigError(f"{key}.block_unit", f"must be one of {', '.join(BLOCK_UNITS)}, got '{self.block_unit}'")
        super().validate(model, key)

    def sublayers_per_block(self) -> int:
        return self.block_size * (2 if self.block_unit == "layers" else 1)


def sublayer_label(s: ReadKey) -> str:
    """``L3.attn`` / ``L3.mlp`` for sublayer 6 / 7; ``final`` for the output read."""
    if s == "final":
        return "final"
    return f"L{s // 2}.{'attn' if s % 2 == 0 else 'mlp'}"


class _AttnResBase(ResidualScheme):
    """Parameters, the read, and depth-weight recording shared by the two schemes."""

    def __init__(self, cfg: Any, ctx: BuildContext):
        super().__init__(cfg, ctx)
        d_model, n_layers = ctx.d_model, ctx.n_layers
        self.eps = cfg.eps
        self.backend = cfg.backend

        def query() -> nn.Parameter:
            # zero pseudo-query: every read starts as the uniform mean of its sources
            return nn.Parameter(torch.zeros(d_model))

        # per decoder layer (K3 names); the gains are only folded into the queries, never applied alone
        self.self_attention_res_proj = nn.ParameterList(query() for _ in range(n_layers))
        self.self_attention_res_norm = nn.ModuleList(RMSNorm(d_model, self.eps) for _ in range(n_layers))
        self.mlp_res_proj = nn.ParameterList(query() for _ in range(n_layers))
        self.mlp_res_norm = nn.ModuleList(RMSNorm(d_model, self.eps) for _ in range(n_layers))
        self.output_attn_res_proj = query()
        self.output_attn_res_norm = RMSNorm(d_model, self.eps)

        self._weight_sums: dict[ReadKey, torch.Tensor] = {}
        self._weight_counts: dict[ReadKey, int] = {}

    # -- parameters ---------------------------------------------------------------------------
    def _queries(self) -> list[nn.Parameter]:
        return [*self.self_attention_res_proj, *self.mlp_res_proj, self.output_attn_res_proj]

    def no_weight_decay(self) -> set[str]:
        # decaying a pseudo-query pulls the depth mix back to uniform
        per_layer = ("self_attention_res_proj", "mlp_res_proj")
        return {f"{group}.{i}" for group in per_layer for i in range(self.n_layers)} | {"output_attn_res_proj"}

    def checkpoint_names(self) -> dict[str, CheckpointName]:
        # the release's names; each pseudo-query is the weight of a Linear(d, 1) there: [1, d]
        row = (1, self.d_model)
        names = {}
        for group in ("self_attention_res", "mlp_res"):
            for i in range(self.n_layers):
                names[f"{group}_proj.{i}"] = CheckpointName(f"layers.{i}.{group}_proj.weight", row)
                names[f"{group}_norm.{i}.weight"] = CheckpointName(f"layers.{i}.{group}_norm.weight")
        names["output_attn_res_proj"] = CheckpointName("output_attn_res_proj.weight", row)
        names["output_attn_res_norm.weight"] = CheckpointName("output_attn_res_norm.weight")
        return names

    def _params_for(self, key: ReadKey) -> tuple[nn.Parameter, torch.Tensor]:
        if key == "final":
            return self.output_attn_res_proj, self.output_attn_res_norm.weight
        layer = key // 2
        if key % 2 == 0:
            return self.self_attention_res_proj[layer], self.self_attention_res_norm[layer].weight
        return self.mlp_res_proj[layer], self.mlp_res_norm[layer].weight

    # -- the read -----------------------------------------------------------------------------
    def _read(self, sources: list[torch.Tensor], key: ReadKey, norm: Optional[nn.Module] = None) -> torch.Tensor:
        """``norm(R(sources; w_key, gamma_key))``; sources oldest first, each ``[B, T, d]``."""
        query, gain = self._params_for(key)
        if self.record_weights:
            h, weights = attnres_read(sources, query, gain, self.eps, return_weights=True, backend=self.backend)
            self._record(key, weights)  # weights: [S, B, T]
            return h if norm is None else norm(h)
        if isinstance(norm, RMSNorm) and fused_norm_applies(sources[0], norm.weight, self.backend):
            # read and norm as one native op, which keeps only the sources and recomputes the read in backward
            return attnres_read_and_norm(sources, query, gain, self.eps, norm.weight, norm.eps)
        if self.cfg.recompute and norm is not None and torch.is_grad_enabled():
            # save only the sources (references: they are saved or live anyway) and recompute read + norm in
            # backward: the mixed input is never kept, so saved activations stay those of a plain residual
            return checkpoint(self._read_and_norm, query, gain, norm, *sources, use_reentrant=False)
        return self._read_and_norm(query, gain, norm, *sources)

    def _read_and_norm(
        self, query: torch.Tensor, gain: torch.Tensor, norm: Optional[nn.Module], *sources: torch.Tensor
    ) -> torch.Tensor:
        # a list, not a stack: autograd then keeps references to the sources instead of a copy per read
        h = attnres_read(list(sources), query, gain, self.eps, backend=self.backend)
        return h if norm is None else norm(h)

    # -- depth-weight diagnostics ---------------------------------------------------------------
    def _record(self, key: ReadKey, weights: torch.Tensor) -> None:
        mean = weights.detach().flatten(1).to(torch.float64).mean(dim=1)  # [S]
        if key in self._weight_sums:
            self._weight_sums[key] = self._weight_sums[key] + mean
            self._weight_counts[key] += 1
        else:
            self._weight_sums[key] = mean
            self._weight_counts[key] = 1

    def reset_depth_weights(self) -> None:
        self._weight_sums = {}
        self._weight_counts = {}

    def source_labels(self) -> list[str]:
        """Column labels of the ``depth_weights`` matrix."""
        raise NotImplementedError

    def _columns(self, n_sources: int) -> list[int]:
        """Column of each of the ``n_sources`` sources of one read."""
        raise NotImplementedError

    def depth_weights(self) -> Optional[dict[str, Any]]:
        """Mean depth weights of every read, averaged over the recorded batches; None before any.

        ``{"sources": [column labels], "rows": [{"sublayer": "L0.attn", "weights": [...]}, ..., {"sublayer":
        "final", ...}]}``: one row per sublayer in depth order, then the final read; each row has one entry
        per column, NaN where that read has no such source. Rows sum to 1 over their present sources.
        """
        if not self._weight_sums:
            return None
        labels = self.source_labels()
        order = [k for k in range(2 * self.n_layers) if k in self._weight_sums]
        if "final" in self._weight_sums:
            order.append("final")
        rows = []
        for key in order:
            mean = (self._weight_sums[key] / self._weight_counts[key]).tolist()
            row = [math.nan] * len(labels)
            for col, w in zip(self._columns(len(mean)), mean):
                row[col] = w
            rows.append({"sublayer": sublayer_label(key), "weights": row})
        return {"sources": labels, "rows": rows}

    # -- accounting -------------------------------------------------------------------------------
    def _count(self, key: ReadKey) -> int:
        raise NotImplementedError

    def sources_per_read(self) -> list[tuple[ReadKey, int]]:
        """(sublayer index or "final", number of sources) for every read, in depth order."""
        return [(s, self._count(s)) for s in range(2 * self.n_layers)] + [("final", self._count("final"))]


@RESIDUALS.register("full_attnres", FullAttnResConfig)
class FullAttnRes(_AttnResBase):
    """Full AttnRes: every sublayer reads a softmax mix of the embedding and all earlier sublayer outputs."""

    # state: tuple of sources (embedding, out_0, out_1, ...), each [B, T, d]

    def start(self, x0: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x0,)

    def read(self, state: tuple[torch.Tensor, ...], sublayer: int, norm: Optional[nn.Module] = None) -> torch.Tensor:
        if len(state) != sublayer + 1:
            raise RuntimeError(
                f"full_attnres: read of sublayer {sublayer} with {len(state)} sources (expected {sublayer + 1})"
            )
        # sublayer 0 has one source: weight exactly 1, so h is the embedding (the query still joins the graph)
        return self._read(list(state), sublayer, norm)

    def write(self, state: tuple[torch.Tensor, ...], sublayer: int, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # under autocast a sublayer may return bf16 while the stream (the embedding) is fp32; a read needs
        # one dtype across its sources, and a plain residual would have promoted the sum to fp32 anyway
        return (*state, out.to(state[0].dtype))

    def finish(self, state: tuple[torch.Tensor, ...], norm: Optional[nn.Module] = None) -> torch.Tensor:
        return self._read(list(state), "final", norm)

    def _count(self, key: ReadKey) -> int:
        return 2 * self.n_layers + 1 if key == "final" else key + 1

    def source_labels(self) -> list[str]:
        return ["embedding"] + [sublayer_label(s) for s in range(2 * self.n_layers)]

    def _columns(self, n_sources: int) -> list[int]:
        return list(range(n_sources))


class BlockState(NamedTuple):
    blocks: tuple[torch.Tensor, ...]  # completed block summaries, oldest first (embedding first), [B, T, d] each
    partial: torch.Tensor  # running sum of the current block (the embedding before layer 0), [B, T, d]


@RESIDUALS.register("block_attnres", BlockAttnResConfig)
class BlockAttnRes(_AttnResBase):
    """Block AttnRes (K3): reads attend over the embedding, completed block sums and the current partial sum."""

    def __init__(self, cfg: BlockAttnResConfig, ctx: BuildContext):
        super().__init__(cfg, ctx)
        self.block_sublayers = cfg.sublayers_per_block()
        # summaries kept at the final read: the embedding plus every block started before the last one
        self.n_blocks = (2 * ctx.n_layers - 1) // self.block_sublayers + 1

    def start(self, x0: torch.Tensor) -> BlockState:
        return BlockState((), x0)

    def read(self, state: BlockState, sublayer: int, norm: Optional[nn.Module] = None) -> torch.Tensor:
        # before layer 0 there is no block yet: a one-source read (weight exactly 1) of the embedding,
        # so h is the embedding and the layer-0 query still joins the graph (DDP without unused params)
        return self._read([*state.blocks, state.partial], sublayer, norm)

    def write(self, state: BlockState, sublayer: int, out: torch.Tensor) -> BlockState:
        if sublayer % self.block_sublayers == 0:
            # block start: seal the finished partial (the embedding at sublayer 0) after this sublayer's
            # read, and start the new partial from its output
            # (cast: under autocast the sublayer may return bf16 while the stream is fp32)
            return BlockState((*state.blocks, state.partial), out.to(state.partial.dtype))
        return BlockState(state.blocks, state.partial + out)

    def finish(self, state: BlockState, norm: Optional[nn.Module] = None) -> torch.Tensor:
        return self._read([*state.blocks, state.partial], "final", norm)

    def _count(self, key: ReadKey) -> int:
        if key == "final":
            return self.n_blocks + 1
        # seals at sublayers 0, B, 2B, ... strictly before this read, plus the partial
        return 1 if key == 0 else (key - 1) // self.block_sublayers + 2

    def source_labels(self) -> list[str]:
        return ["embedding"] + [f"block {i}" for i in range(1, self.n_blocks)] + ["partial"]

    def _columns(self, n_sources: int) -> list[int]:
        if n_sources == 1:
            return [0]  # layer 0's attention: the embedding alone
        # completed blocks in order; the partial always in the last column
        return list(range(n_sources - 1)) + [self.n_blocks]
