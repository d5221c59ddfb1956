"""LightningDataModule over a ``TokenDataset`` with a resumable batch position.

Training batch ``i`` is a pure function of ``(seed, i)``; the only state is how many micro-batches
have been consumed, which is saved in every checkpoint and restored before the loader starts, so a
resumed run sees exactly the batches an uninterrupted one would. Each data-parallel rank takes its
contiguous slice of the rows of every global batch.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from components.data.base import TokenDataset


class _RankSlice:
    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def __call__(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.world == 1:
            return batch
        rows = batch[0].shape[0]
        if rows % self.world:
            raise ValueError(f"data.batch_size={rows} is not divisible by the {self.world} data-parallel ranks")
        per = rows // self.world
        sl = slice(self.rank * per, (self.rank + 1) * per)
        return batch[0][sl], batch[1][sl]


class TrainStream(IterableDataset):
    """Endless training batches starting at ``position()`` (read when iteration starts)."""

    def __init__(self, dataset: TokenDataset, position: Any, rank_slice: _RankSlice):
        self.dataset, self.position, self.rank_slice = dataset, position, rank_slice

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for index in itertools.count(self.position()):
            yield self.rank_slice(self.dataset.train_batch(index))


class ValSet(IterableDataset):
    def __init__(self, dataset: TokenDataset, rank_slice: _RankSlice, limit: int | None):
        self.dataset, self.rank_slice, self.limit = dataset, rank_slice, limit

    def __len__(self) -> int:
        n = self.dataset.num_val_batches()
        return n if self.limit is None else min(n, self.limit)

    def __iter__(self):
        for i in range(len(self)):
            x, y = self.dataset.val_batch(i)
            if self.rank_slice.world > 1:
                # the last batch may be short; pad rows with ignored targets so every rank gets a slice
                rows = x.shape[0]
                pad = -rows % self.rank_slice.world
                if pad:
                    x = torch.cat([x, x[:pad]])
                    y = torch.cat([y, torch.full_like(y[:pad], -100)])
            yield self.rank_slice((x, y))


class TokenDataModule(L.LightningDataModule):
    def __init__(self, dataset: TokenDataset, accumulate: int, limit_val_batches: int | None = None):
        super().__init__()
        self.dataset = dataset
        self.accumulate = accumulate
        self.limit_val_batches = limit_val_batches
        self.start_batch = 0  # set from a checkpoint on resume

    def _rank_slice(self) -> _RankSlice:
        trainer = self.trainer
        if trainer is None:
            return _RankSlice(0, 1)
        return _RankSlice(trainer.global_rank, trainer.world_size)

    def _position(self) -> int:
        return self.start_batch

    # each loader gets its own generator: starting a loader draws a seed, and drawing it from the global
    # one would shift the model's random stream by a draw after a resume restores it
    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            TrainStream(self.dataset, self._position, self._rank_slice()), batch_size=None, generator=torch.Generator()
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            ValSet(self.dataset, self._rank_slice(), self.limit_val_batches),
            batch_size=None,
            generator=torch.Generator(),
        )

    # batches consumed = optimizer steps * accumulation: checkpoints are only written between steps
    def state_dict(self) -> dict[str, Any]:
        steps = self.trainer.global_step if self.trainer is not None else 0
        return {"batches_consumed": steps * self.accumulate}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.start_batch = int(state["batches_consumed"])
