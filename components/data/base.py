"""The contract every dataset follows, and the deterministic batch schedule behind exact resumes.

A dataset produces *global* micro-batches ``(input_ids, targets)`` of ``[batch_size, seq_len]`` int64,
where batch ``i`` is a pure function of ``(seed, i)``. A data-parallel rank takes its slice of the rows,
so any number of ranks sees the same global batch, and a resumed run continues at batch
``steps_done * accumulate`` without replaying anything. Targets of ``-100`` are ignored by the loss.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterator, Optional

import numpy as np
import torch

from components.base import ConfigError
from components.config import ComponentConfig
from components.data.metrics import LOSS, ByteAccounting, MetricContract
from components.data.text.prepared import PreparedFolder, PreparedFolderError
from components.objective import IGNORE_INDEX

if TYPE_CHECKING:
    from components.data.text.tokenizers import TextTokenizer


class NoTextTokenizer(ValueError):
    """The data has no tokenizer turning text into its tokens; the message says why."""


class NoValidationStream(ValueError):
    """The data has no flat validation token stream; the message says why (and what to use instead)."""


def batch_generator(seed: int, index: int, stream: int = 0) -> torch.Generator:
    """A generator seeded by (seed, batch index, stream): independent of every other batch."""
    g = torch.Generator()
    # within the seed range torch takes (a seed of about 9,200 and more would overflow it); smaller values unchanged
    g.manual_seed(((seed * 1_000_003 + stream) * 1_000_000_007 + index) % 2**63)
    return g


def check_split_length(tokens: int, seq_len: int, key: str, what: str) -> None:
    """A split feeds windows of ``seq_len`` inputs and their next-token targets, and needs one token beyond a
    window to draw a start from: ConfigError on ``key`` when ``what`` (its description) holds too few."""
    if tokens <= seq_len + 1:
        raise ConfigError(key, f"{what} holds {tokens} tokens, fewer than seq_len + 2 = {seq_len + 2}")


class DatasetConfig(ComponentConfig):
    """Fields every dataset config has (its dataclass declares them): the runtime splits
    ``batch_size`` rows over data-parallel ranks and the model takes its vocabulary from ``vocab_size``."""

    vocab_size: int
    seq_len: int
    batch_size: int

    @classmethod
    def complete(cls, node: Any, key: str) -> None:
        """Fill fields that the data's own files decide (a prepared folder's vocabulary and dtype) into the
        composed config ``node`` before it is resolved, so ``model.vocab_size`` follows them; raise
        ``ConfigError`` when a set field contradicts the files. Called once per run, before validation."""

    def text_tokenizer(self) -> "TextTokenizer":
        """How this data's text is tokenized and detokenized (generation, export, harness tasks); raises
        ``NoTextTokenizer`` saying why when nothing turns text into its tokens."""
        raise NoTextTokenizer(
            f"the run's data ({self.name}) has no tokenizer (bare token files or synthetic data): "
            "nothing turns text into its tokens"
        )


def prepared_tokenizer(folder: Any) -> "TextTokenizer":
    """The tokenizer a prepared folder (``prepare.py``) records; ``NoTextTokenizer`` when it does not open."""
    try:
        return PreparedFolder.open(folder).tokenizer
    except PreparedFolderError as err:
        raise NoTextTokenizer(str(err)) from None


class TokenDataset:
    """Base class: subclasses set ``vocab_size`` and implement ``train_batch`` and ``val_batches``."""

    vocab_size: int
    seq_len: int
    batch_size: int
    # which metrics validation reports, the primary one, and whether higher is better
    metrics: MetricContract = LOSS
    # bytes per token id for bits per byte (None: the data scores no bits per byte)
    byte_accounting: Optional[ByteAccounting] = None
    # the end-of-document token (None: the data has no document boundaries)
    eod_id: Optional[int] = None
    # the model masks attention and restarts recurrent state at each document start (``eod_id`` begins one)
    document_masking: bool = False

    def train_batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def num_val_batches(self) -> int:
        raise NotImplementedError

    def val_batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def val_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(self.num_val_batches()):
            yield self.val_batch(i)

    def validation_stream(self) -> np.ndarray:
        """The flat validation token stream ``[N]`` that longer windows are cut from (``analysis.evaluate
        --lengths``); raises ``NoValidationStream`` saying why when the data has none."""
        raise NoValidationStream("has no validation token stream to cut longer windows from")

    # Sums that validation accumulates over batches (and ranks) before ``finish_metrics``; ``index`` is the
    # validation batch's number. Every batch returns the same keys.
    def metric_sums(
        self, logits: torch.Tensor, targets: torch.Tensor, token_loss: torch.Tensor, index: int = 0
    ) -> dict[str, torch.Tensor]:
        mask = targets != IGNORE_INDEX
        sums = {"loss_sum": (token_loss * mask).sum(), "tokens": mask.sum()}
        if self.byte_accounting is not None:
            sums.update(self.byte_accounting.sums(targets, token_loss))
        return sums

    def finish_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        loss = sums["loss_sum"] / max(sums["tokens"], 1)
        out = {"loss": loss, "ppl": math.exp(min(loss, 50.0))}
        if self.byte_accounting is not None:
            out["bpb"] = self.byte_accounting.finish(sums)
        return out

    def describe(self) -> str:
        return type(self).__name__

    def baselines(self) -> dict[str, float]:
        """Reference numbers printed beside the model's (e.g. compressors' bits per byte)."""
        return {}


class TokenStreamDataset(TokenDataset):
    """Windows of a flat token stream: random training windows, consecutive validation windows.

    Subclasses set ``train`` and ``val`` (1-D integer arrays, e.g. memmaps), ``seq_len``,
    ``batch_size``, ``seed`` and ``num_val_windows``.
    """

    train: np.ndarray
    val: np.ndarray
    seed: int
    num_val_windows: int

    def _windows(self, tokens: np.ndarray, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.from_numpy(
            np.stack([tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        )  # [B, T+1]
        self.check_tokens(rows)
        return rows[:, :-1], rows[:, 1:]

    def validation_stream(self) -> np.ndarray:
        return self.val

    def check_tokens(self, rows: torch.Tensor) -> None:
        """Hook for datasets whose files may hold ids outside the vocabulary."""

    def train_batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = batch_generator(self.seed, index)
        starts = torch.randint(0, len(self.train) - self.seq_len - 1, (self.batch_size,), generator=g).numpy()
        return self._windows(self.train, starts)

    def num_val_batches(self) -> int:
        return math.ceil(self.num_val_windows / self.batch_size)

    def val_batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        first = index * self.batch_size
        starts = np.arange(first, min(first + self.batch_size, self.num_val_windows)) * self.seq_len
        return self._windows(self.val, starts)
