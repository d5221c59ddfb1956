"""Multi-query associative recall (MQAR), as defined by Zoology (Arora et al., 2023).

Each sequence starts with ``num_kv_pairs`` key-value pairs ``k1 v1 k2 v2 ...`` (keys from the lower
half of the vocabulary, values from the upper half, no repeated key or value in a sequence), followed
by queries: every key appears once more, at a power-law distributed distance, and the model must
predict its value as the next token. Positions that are not queries hold random tokens. Only the
value after each query is scored; the metric is recall accuracy. Everything is generated from the
seed, so train and validation batches are reproducible and never overlap in stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from components.data.base import DatasetConfig, IGNORE_INDEX, TokenDataset, batch_generator
from components.registry import DATASETS, ConfigError

VAL_STREAM = 1


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

    def validate(self, model: Any, key: str) -> None:
        if self.num_kv_pairs < 1:
            raise ConfigError(f"{key}.num_kv_pairs", f"must be positive, got {self.num_kv_pairs}")
        if self.seq_len < 4 * self.num_kv_pairs:
            raise ConfigError(f"{key}.seq_len", f"needs room for {self.num_kv_pairs} pairs and their queries: at least 4 * num_kv_pairs = {4 * self.num_kv_pairs}, got {self.seq_len}")
        if self.vocab_size // 2 - 1 < self.num_kv_pairs or self.vocab_size - self.vocab_size // 2 < self.num_kv_pairs:
            raise ConfigError(f"{key}.vocab_size", f"too small for {self.num_kv_pairs} distinct keys and values, got {self.vocab_size}")
        if self.batch_size < 1 or self.num_val_examples < 1:
            raise ConfigError(f"{key}.batch_size", "batch_size and num_val_examples must be positive")
        if self.power_a <= 0:
            raise ConfigError(f"{key}.power_a", f"must be positive, got {self.power_a}")


def mqar_examples(cfg: MQARConfig, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` examples: inputs and targets ``[n, seq_len]`` (targets -100 except after each query)."""
    P, V, T = cfg.num_kv_pairs, cfg.vocab_size, cfg.seq_len
    key_vocab = V // 2
    # distinct keys from 1..key_vocab-1 and distinct values from key_vocab..V-1 per example
    keys = torch.rand(n, key_vocab - 1, generator=g).argsort(dim=1)[:, :P] + 1  # [n, P]
    values = torch.rand(n, V - key_vocab, generator=g).argsort(dim=1)[:, :P] + key_vocab  # [n, P]
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


@DATASETS.register("mqar", MQARConfig)
class MQAR(TokenDataset):
    """Synthetic multi-query associative recall (Zoology); reports recall accuracy."""

    metric = "accuracy"

    def __init__(self, cfg: MQARConfig, seed: int):
        self.cfg = cfg
        self.seed = seed
        self.vocab_size = cfg.vocab_size
        self.seq_len = cfg.seq_len
        self.batch_size = cfg.batch_size
        self._val = mqar_examples(cfg, cfg.num_val_examples, batch_generator(seed, 0, stream=VAL_STREAM))

    def train_batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return mqar_examples(self.cfg, self.batch_size, batch_generator(self.seed, index))

    def num_val_batches(self) -> int:
        return math.ceil(self.cfg.num_val_examples / self.batch_size)

    def val_batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self._val[0][rows], self._val[1][rows]

    def metric_sums(self, logits, targets, token_loss, index=0):
        sums = super().metric_sums(logits, targets, token_loss, index)
        mask = targets != IGNORE_INDEX
        sums["correct"] = ((logits.argmax(-1) == targets) & mask).sum()
        return sums

    def finish_metrics(self, sums):
        out = super().finish_metrics(sums)
        out["accuracy"] = sums["correct"] / max(sums["tokens"], 1)
        return out

    def describe(self) -> str:
        c = self.cfg
        return f"MQAR: vocab {c.vocab_size}, {c.num_kv_pairs} key-value pairs, length {c.seq_len}"
