"""Multi-query associative recall (MQAR), as defined by Zoology (Arora et al., 2023).

Each sequence starts with ``num_kv_pairs`` key-value pairs ``k1 v1 k2 v2 ...`` (keys from the lower
half of the vocabulary, values from the upper half, no repeated key or value in a sequence), followed
by queries: every key appears once more, at a power-law distributed distance, and the model must
predict its value as the next token. Positions that are not queries hold random tokens. Only the
value after each query is scored; the metric is recall accuracy. Everything is generated from the
seed, so train and validation batches are reproducible and never overlap in stream.

Segments, as Zoology runs the task: ``train_segments`` and ``test_segments`` list (sequence length,
number of key-value pairs, number of examples). Training then draws from a fixed set of that many
examples per segment, reshuffled every epoch, each example right-padded to ``seq_len`` (padding is never
scored; causal models never see it before a scored position). Every test segment is validated at its
own length and reported on its own (``accuracy/T<len>_P<pairs>``) beside the overall accuracy. Without
segments, training is an unlimited stream at (``seq_len``, ``num_kv_pairs``) and validation is one
segment of ``num_val_examples``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from components.data.base import IGNORE_INDEX, DatasetConfig, NoValidationStream, TokenDataset, batch_generator
from components.data.metrics import ACCURACY
from components.registry import DATASETS, ConfigError

VAL_STREAM = 1
TRAIN_SEGMENT_STREAM = 1_000  # + segment number: the fixed training examples of each segment
VAL_SEGMENT_STREAM = 2_000  # + segment number
SHUFFLE_STREAM = 3_000  # the order of an epoch over the fixed training examples
GENERATION_CHUNK = 2_048  # examples generated at once (bounds the memory of the key/value draws)


@dataclass
class MQARSegment:
    seq_len: int = 64
    num_kv_pairs: int = 4
    num_examples: int = 1024

    @property
    def name(self) -> str:
        return f"T{self.seq_len}_P{self.num_kv_pairs}"


@dataclass
class MQARConfig(DatasetConfig):
    name: str = "mqar"
    vocab_size: int = 8192
    seq_len: int = 64
    num_kv_pairs: int = 4
    batch_size: int = 64
    # exponent of the power law of query distances (Zoology's default: 0.01)
    power_a: float = 0.01
    # fill non-query positions with random tokens (else with 0)
    random_non_queries: bool = True
    num_val_examples: int = 1024
    # Zoology's segments (see the module docstring); null: the single (seq_len, num_kv_pairs) setting
    train_segments: Optional[list[MQARSegment]] = None
    test_segments: Optional[list[MQARSegment]] = None

    def validate(self, model: Any, key: str) -> None:
        self._check_setting(self.seq_len, self.num_kv_pairs, key, "")
        if self.batch_size < 1 or self.num_val_examples < 1:
            raise ConfigError(f"{key}.batch_size", "batch_size and num_val_examples must be positive")
        if self.power_a <= 0:
            raise ConfigError(f"{key}.power_a", f"must be positive, got {self.power_a}")
        for group in ("train_segments", "test_segments"):
            segments = getattr(self, group)
            if segments is not None and not segments:
                raise ConfigError(
                    f"{key}.{group}", "an empty list; give at least one {seq_len, num_kv_pairs, num_examples} or null"
                )
            for i, seg in enumerate(segments or []):
                self._check_setting(seg.seq_len, seg.num_kv_pairs, key, f"{group}[{i}].")
                if seg.num_examples < 1:
                    raise ConfigError(f"{key}.{group}[{i}].num_examples", f"must be positive, got {seg.num_examples}")
            names = [seg.name for seg in segments or []]
            if len(set(names)) != len(names):
                raise ConfigError(f"{key}.{group}", f"two segments share a (seq_len, num_kv_pairs) setting: {names}")
        for i, seg in enumerate(self.train_segments or []):
            if seg.seq_len > self.seq_len:
                raise ConfigError(
                    f"{key}.train_segments[{i}].seq_len",
                    f"{seg.seq_len} is longer than the training length "
                    f"{key}.seq_len={self.seq_len}, which every training example is padded to; raise {key}.seq_len",
                )

    def _check_setting(self, seq_len: int, pairs: int, key: str, where: str) -> None:
        if pairs < 1:
            raise ConfigError(f"{key}.{where}num_kv_pairs", f"must be positive, got {pairs}")
        if seq_len < 4 * pairs:
            raise ConfigError(
                f"{key}.{where}seq_len",
                f"needs room for {pairs} pairs and their queries: at least 4 * num_kv_pairs = {4 * pairs}, got "
                f"{seq_len}",
            )
        if self.vocab_size // 2 - 1 < pairs or self.vocab_size - self.vocab_size // 2 < pairs:
            raise ConfigError(
                f"{key}.vocab_size", f"too small for {pairs} distinct keys and values, got {self.vocab_size}"
            )

    def test_settings(self) -> list[MQARSegment]:
        """The validation segments (the single setting when none are listed)."""
        if self.test_segments:
            return list(self.test_segments)
        return [MQARSegment(self.seq_len, self.num_kv_pairs, self.num_val_examples)]


def mqar_examples(cfg: MQARConfig, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` examples: inputs and targets ``[n, seq_len]`` (targets -100 except after each query)."""
    P, V, T = cfg.num_kv_pairs, cfg.vocab_size, cfg.seq_len
    key_vocab = V // 2
    # distinct keys from 1..key_vocab-1 and distinct values from key_vocab..V-1 per example
    # the P largest of uniform draws: a uniformly random subset in random order (topk, not a full sort)
    keys = torch.rand(n, key_vocab - 1, generator=g).topk(P, dim=1).indices + 1  # [n, P]
    values = torch.rand(n, V - key_vocab, generator=g).topk(P, dim=1).indices + key_vocab  # [n, P]
    context = torch.stack([keys, values], dim=2).reshape(n, 2 * P)  # k1 v1 k2 v2 ...

    # queries at even offsets of the remaining T + 1 - 2P tokens, distances drawn from a power law
    space = (T + 1 - 2 * P) // 2
    probs = cfg.power_a * torch.arange(1, space + 1, dtype=torch.float64) ** (cfg.power_a - 1)
    gaps = torch.multinomial(probs.expand(n, space), P, replacement=False, generator=g)  # [n, P]
    query_len = T + 1 - 2 * P
    queries = torch.zeros(n, query_len, dtype=torch.long)
    queries.scatter_(1, 2 * gaps, keys)
    queries.scatter_(1, 2 * gaps + 1, values)
    sequence = torch.cat([context, queries], dim=1)  # [n, T + 1]

    labels = torch.full((n, query_len), IGNORE_INDEX, dtype=torch.long)
    labels.scatter_(1, 2 * gaps + 1, values)
    labels = torch.cat([torch.full((n, 2 * P), IGNORE_INDEX, dtype=torch.long), labels], dim=1)

    inputs = sequence[:, :-1].clone()
    targets = labels[:, 1:]
    if cfg.random_non_queries:
        filler = torch.randint(0, V, inputs.shape, generator=g)
        blank = inputs == 0
        inputs[blank] = filler[blank]
    return inputs, targets


def segment_examples(
    cfg: MQARConfig, seg: MQARSegment, seed: int, stream: int, pad_to: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``seg.num_examples`` examples of one segment, generated in chunks, right-padded to ``pad_to``
    (inputs with 0, targets with -100); int32 to halve their memory."""
    setting = replace(cfg, seq_len=seg.seq_len, num_kv_pairs=seg.num_kv_pairs, train_segments=None, test_segments=None)
    inputs = torch.zeros(seg.num_examples, pad_to, dtype=torch.int32)  # [N, T]
    targets = torch.full((seg.num_examples, pad_to), IGNORE_INDEX, dtype=torch.int32)  # [N, T]
    for chunk, first in enumerate(range(0, seg.num_examples, GENERATION_CHUNK)):
        n = min(GENERATION_CHUNK, seg.num_examples - first)
        x, y = mqar_examples(setting, n, batch_generator(seed, chunk, stream=stream))
        inputs[first : first + n, : seg.seq_len] = x
        targets[first : first + n, : seg.seq_len] = y
    return inputs, targets


@DATASETS.register("mqar", MQARConfig)
class MQAR(TokenDataset):
    """Synthetic multi-query associative recall (Zoology); reports recall accuracy, per test segment."""

    metrics = ACCURACY

    def __init__(self, cfg: MQARConfig, seed: int):
        self.cfg = cfg
        self.seed = seed
        self.vocab_size = cfg.vocab_size
        self.seq_len = cfg.seq_len
        self.batch_size = cfg.batch_size
        self.val_segments = cfg.test_settings()
        # validation batches never mix segments: batch j belongs to segment self._val_index[j][0]
        self._val_index: list[tuple[int, int]] = []
        self._val: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, seg in enumerate(self.val_segments):
            if cfg.test_segments:
                self._val.append(segment_examples(cfg, seg, seed, VAL_SEGMENT_STREAM + i, seg.seq_len))
            else:  # the single setting: the examples earlier versions validated on
                self._val.append(mqar_examples(cfg, cfg.num_val_examples, batch_generator(seed, 0, stream=VAL_STREAM)))
            self._val_index += [(i, b) for b in range(math.ceil(seg.num_examples / self.batch_size))]
        self._train: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        if cfg.train_segments:
            parts = [
                segment_examples(cfg, seg, seed, TRAIN_SEGMENT_STREAM + i, cfg.seq_len)
                for i, seg in enumerate(cfg.train_segments)
            ]
            self._train = (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
        self._epoch_order: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._epoch_order:
            self._epoch_order = {
                epoch: torch.randperm(
                    len(self._train[0]), generator=batch_generator(self.seed, epoch, stream=SHUFFLE_STREAM)
                )
            }
        return self._epoch_order[epoch]

    def train_batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._train is None:
            return mqar_examples(self.cfg, self.batch_size, batch_generator(self.seed, index))
        n = len(self._train[0])
        positions = torch.arange(
            index * self.batch_size, (index + 1) * self.batch_size
        )  # in the endless sequence of epochs
        rows = torch.stack([self._order(int(p) // n)[int(p) % n] for p in positions])
        return self._train[0][rows].long(), self._train[1][rows].long()

    def num_val_batches(self) -> int:
        return len(self._val_index)

    def val_batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        seg, b = self._val_index[index]
        rows = slice(b * self.batch_size, (b + 1) * self.batch_size)
        return self._val[seg][0][rows].long(), self._val[seg][1][rows].long()

    def metric_sums(self, logits, targets, token_loss, index=0):
        sums = super().metric_sums(logits, targets, token_loss, index)
        mask = targets != IGNORE_INDEX
        correct = ((logits.argmax(-1) == targets) & mask).sum()
        sums["correct"] = correct
        if len(self.val_segments) > 1:  # every batch returns every key: zeros for the segments it is not
            own = self._val_index[index][0]
            for i, seg in enumerate(self.val_segments):
                sums[f"correct/{seg.name}"] = correct if i == own else torch.zeros_like(correct)
                sums[f"scored/{seg.name}"] = mask.sum() if i == own else torch.zeros_like(correct)
        return sums

    def finish_metrics(self, sums):
        out = super().finish_metrics(sums)
        out["accuracy"] = sums["correct"] / max(sums["tokens"], 1)
        if len(self.val_segments) > 1:
            for seg in self.val_segments:
                out[f"accuracy/{seg.name}"] = sums[f"correct/{seg.name}"] / max(sums[f"scored/{seg.name}"], 1)
        return out

    def validation_stream(self):
        raise NoValidationStream(
            "has no validation token stream to cut longer windows from (MQAR: list longer settings in "
            "data.test_segments instead)"
        )

    def describe(self) -> str:
        c = self.cfg
        if not (c.train_segments or c.test_segments):
            return f"MQAR: vocab {c.vocab_size}, {c.num_kv_pairs} key-value pairs, length {c.seq_len}"
        train = (
            ", ".join(f"{s.name} x{s.num_examples:,}" for s in c.train_segments)
            if c.train_segments
            else f"T{c.seq_len}_P{c.num_kv_pairs} stream"
        )
        return f"MQAR: vocab {c.vocab_size}; train {train}; test {', '.join(s.name for s in self.val_segments)}"
