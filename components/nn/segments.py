"""Document segments of a batch of packed token windows (document masking).

Training windows cut a flat token stream in which documents follow each other; with document masking a
token sees only its own document. ``Segments`` describes which positions of each ``[B, T]`` row belong to
the same document, and builds, once per batch, what the mixers need to keep documents apart:

* ``starts``: where a document begins (state resets of recurrent mixers);
* ``attention_mask()``: causal AND same document, for softmax attention;
* ``same_segment_as_shifted(s)``: whether token ``t - s`` is in ``t``'s document (short convolutions);
* ``packing(max_align, min_align)``: every document moved to start on a multiple of an alignment, so a
  chunked recurrence can reset its state at chunk boundaries (KDA's torch kernel);
* ``cu_seqlens()``: the rows flattened to one sequence, cut at every document and row start (fla's
  variable-length kernels).

The helpers are computed on first use and kept on the object, so the layers of one forward share them.
Inside a compiled region the elementwise helpers (starts, masks) are not stored (a graph never mutates
the object it was handed): they are cheap work the compiler fuses into the layer. The helpers with
data-dependent sizes (``packing``, ``cu_seqlens``) always run eagerly, and are kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from components.nn.eager_island import eager_island

__all__ = ["SegmentPacking", "Segments"]


@dataclass
class SegmentPacking:
    """Each row's documents laid out back to back, each starting on a multiple of ``align``.

    A document of length L takes ``ceil(L / align) * align`` packed positions; the gaps are zeros.
    ``index [B*T]`` maps token ``(b, t)`` to its position in the flattened packed ``[B * length]``;
    ``starts [B, length]`` is True at the packed position of every document's first token.
    """

    align: int
    length: int
    index: torch.Tensor  # [B*T] long
    starts: torch.Tensor  # [B, length] bool

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, *D]`` -> ``[B, length, *D]``, zeros between documents; differentiable."""
        B, T = x.shape[:2]
        rest = x.shape[2:]
        flat = x.new_zeros(B * self.length, *rest).index_copy(0, self.index, x.reshape(B * T, *rest))
        return flat.view(B, self.length, *rest)

    def unpack(self, y: torch.Tensor, T: int) -> torch.Tensor:
        """``y [B, length, *D]`` -> ``[B, T, *D]``: the inverse of ``pack``; differentiable."""
        B = y.shape[0]
        rest = y.shape[2:]
        return y.reshape(B * self.length, *rest).index_select(0, self.index).view(B, T, *rest)


class Segments:
    """Document segments of a ``[B, T]`` batch: positions of a row with equal ``ids`` are one document.

    ``ids [B, T]`` (long) is nondecreasing along each row; only equality matters.
    ``Segments.from_eod(input_ids, eod_id)``: the end-of-document token starts a new segment (it acts as
    the first token of the document after it).
    """

    def __init__(self, ids: torch.Tensor):
        if ids.dim() != 2:
            raise ValueError(f"segment ids must be [B, T], got shape {tuple(ids.shape)}")
        self.ids = ids
        self._cache: dict[Any, Any] = {}

    @classmethod
    def from_eod(cls, input_ids: torch.Tensor, eod_id: int) -> Segments:
        return cls(torch.cumsum(input_ids == eod_id, dim=1))

    @property
    def shape(self) -> torch.Size:
        return self.ids.shape

    def _cached(self, key: Any, build: Callable[[], Any]) -> Any:
        if torch.compiler.is_compiling():
            return build()
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    @property
    def starts(self) -> torch.Tensor:
        """``[B, T]`` bool, True where a document begins (always at t = 0)."""

        def build() -> torch.Tensor:
            starts = torch.ones_like(self.ids, dtype=torch.bool)
            starts[:, 1:] = self.ids[:, 1:] != self.ids[:, :-1]
            return starts

        return self._cached("starts", build)

    def same_segment_as_shifted(self, shift: int) -> torch.Tensor:
        """``[B, T, 1]`` bool: token ``t - shift`` exists and is in the document of token ``t``."""

        def build() -> torch.Tensor:
            same = torch.zeros_like(self.ids, dtype=torch.bool)
            if shift < self.ids.shape[1]:
                same[:, shift:] = self.ids[:, shift:] == self.ids[:, : self.ids.shape[1] - shift]
            return same.unsqueeze(-1)

        return self._cached(("shift", shift), build)

    def attention_mask(self) -> torch.Tensor:
        """``[B, 1, T, T]`` bool, True = query t may attend to key s: s <= t and the same document."""

        def build() -> torch.Tensor:
            T = self.ids.shape[1]
            causal = torch.ones(T, T, dtype=torch.bool, device=self.ids.device).tril()  # [T, T]
            same = self.ids[:, :, None] == self.ids[:, None, :]  # [B, T, T]
            return (same & causal).unsqueeze(1)

        return self._cached("attention_mask", build)

    @eager_island  # data-dependent size: built eagerly (and kept) even when called from a graph
    def cu_seqlens(self) -> torch.Tensor:
        """Boundaries ``[N + 1]`` (long) of the N documents of the rows flattened to one sequence of
        ``B * T`` tokens: every document start and every row start, then ``B * T``."""

        def build() -> torch.Tensor:
            flat = self.starts.flatten()  # [B*T], True at every row start too
            starts = flat.nonzero().squeeze(1)  # [N]
            end = torch.full((1,), flat.numel(), dtype=starts.dtype, device=starts.device)
            return torch.cat([starts, end])

        return self._cached("cu_seqlens", build)

    @eager_island  # data-dependent sizes and a host read: always eager
    def packing(self, max_align: int, min_align: int) -> SegmentPacking:
        """Documents aligned to chunk boundaries for a chunked recurrence of chunk size ``max_align``.

        The alignment (a power of two between ``min_align`` and ``max_align``) is halved while the packed
        length would exceed 1.5 x T, so short documents do not multiply the work. One host read.
        """

        def build() -> SegmentPacking:
            B, T = self.ids.shape
            device = self.ids.device
            starts = self.starts  # [B, T]
            seg = starts.long().cumsum(1) - 1  # [B, T] document number within the row
            pos = torch.arange(T, device=device).expand(B, T)  # [B, T]
            first = torch.where(starts, pos, 0).cummax(dim=1).values  # [B, T] start of t's document
            lengths = torch.zeros(B, T, dtype=torch.long, device=device).scatter_add_(1, seg, torch.ones_like(seg))
            aligns = [max_align]
            while aligns[-1] > min_align:
                aligns.append(aligns[-1] // 2)
            sizes = torch.stack([((lengths + a - 1) // a * a).sum(1).amax() for a in aligns]).tolist()
            choice = next((i for i, n in enumerate(sizes) if n <= 1.5 * T), len(aligns) - 1)
            align, length = aligns[choice], int(sizes[choice])
            padded = (lengths + align - 1) // align * align  # [B, T] packed size of each document
            offsets = padded.cumsum(1) - padded  # [B, T] packed start of each document
            dest = offsets.gather(1, seg) + (pos - first)  # [B, T] packed position of each token
            index = (dest + torch.arange(B, device=device)[:, None] * length).flatten()  # [B*T]
            packed_starts = torch.zeros(B * length, dtype=torch.bool, device=device)
            packed_starts[index[starts.flatten()]] = True
            return SegmentPacking(align, length, index, packed_starts.view(B, length))

        return self._cached(("packing", max_align, min_align), build)
