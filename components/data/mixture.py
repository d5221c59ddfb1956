"""A weighted mixture of prepared folders that share one tokenizer.

    python train.py data=mixture \\
        data.sources='{code: {path: data/code-bpe8k, weight: 3}, docs: {path: data/docs-bpe8k, weight: 1}}'

Each row of training batch ``i`` draws its source with probability proportional to the weights, then a
random window of that source, all from the generator of ``(seed, i)``: the sampling order is a pure
function of the seed and the batch index, so a resumed run continues exactly. Validation runs every
source's windows in turn and reports loss and bits per byte per source (``val/<source>/bpb``) and over
all of them. Sources must have been prepared with the same tokenizer (checked by its hash).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from components.data.base import DatasetConfig, TokenDataset, batch_generator, check_split_length, prepared_tokenizer
from components.data.compressor_baselines import compressed_bits_per_byte
from components.data.metrics import BITS_PER_BYTE
from components.data.text.prepared import PreparedFolder, PreparedFolderError, is_prepared
from components.data.text.stream import PreparedStream
from components.data.text.tokenizers import TextTokenizer
from components.registry import DATASETS, ConfigError

SOURCE_FIELDS = {
    "path": "a folder made by prepare.py",
    "weight": "relative sampling weight, normalised over the sources (default 1)",
}


@dataclass
class MixtureConfig(DatasetConfig):
    name: str = "mixture"
    # source name -> {path: prepared folder, weight: relative weight (default 1)}; untyped here so that
    # one override can set the whole mapping (a typed mapping would only merge into the empty default)
    sources: Any = None
    seq_len: int = 256
    batch_size: int = 16
    # evaluate each source on at most this many validation tokens (None: its whole validation split)
    val_tokens: Optional[int] = 262144
    # None: the sources' vocabulary size (meta.json); larger pads the embedding table
    vocab_size: Optional[int] = None
    # attention and recurrent state stop at document boundaries
    document_masking: bool = False

    def text_tokenizer(self) -> TextTokenizer:
        return prepared_tokenizer(next(iter(self.sources.values()))["path"])  # the sources share one

    @classmethod
    def complete(cls, node: Any, key: str) -> None:
        sources = node.get("sources")
        if not isinstance(sources, Mapping) or not sources:
            raise ConfigError(
                f"{key}.sources",
                "name at least one source: data.sources='{NAME: {path: FOLDER, weight: W}, ...}' (folders made by "
                "prepare.py)",
            )
        for name, src in sources.items():
            if not isinstance(src, Mapping):
                raise ConfigError(
                    f"{key}.sources.{name}", f"must be a mapping with {', '.join(SOURCE_FIELDS)}, got {src!r}"
                )
            for k in src:
                if k not in SOURCE_FIELDS:
                    raise ConfigError(
                        f"{key}.sources.{name}.{k}",
                        f"unknown key '{k}'; a source has: "
                        + "; ".join(f"{f} ({d})" for f, d in SOURCE_FIELDS.items()),
                    )
        folders = {name: _open(src.get("path"), f"{key}.sources.{name}.path") for name, src in sources.items()}
        first, folder = next(iter(folders.items()))
        for name, other in folders.items():
            if other.tokenizer_hash != folder.tokenizer_hash:
                raise ConfigError(
                    f"{key}.sources.{name}.path",
                    f"{other.path} was prepared with tokenizer {other.meta['tokenizer']['spec']} (hash "
                    f"{other.tokenizer_hash}), source '{first}' with {folder.meta['tokenizer']['spec']} (hash "
                    f"{folder.tokenizer_hash}); mixed sources must share one tokenizer",
                )
        vocab = node.get("vocab_size")
        if vocab is None:
            node.vocab_size = folder.vocab_size
        elif vocab < folder.vocab_size:
            raise ConfigError(
                f"{key}.vocab_size",
                f"{vocab} is below the {folder.vocab_size} ids of the sources' tokenizer; leave it unset",
            )

    def validate(self, model: Any, key: str) -> None:
        for name, src in self.sources.items():
            weight = src.get("weight", 1.0)
            if not (isinstance(weight, (int, float)) and weight > 0 and math.isfinite(weight)):
                raise ConfigError(f"{key}.sources.{name}.weight", f"must be a positive number, got {weight!r}")
            folder = _open(src["path"], f"{key}.sources.{name}.path")
            for split in ("train", "val"):
                n = folder.meta["splits"][split]["tokens"]
                check_split_length(n, self.seq_len, f"{key}.sources.{name}.path", f"the {split} split of {src['path']}")
            if "/" in name:
                raise ConfigError(
                    f"{key}.sources.{name}",
                    "a source name becomes a metric name (val/<name>/bpb): it may not contain '/'",
                )
        if self.seq_len < 2 or self.batch_size < 1:
            raise ConfigError(
                f"{key}.seq_len", f"seq_len must be >= 2 and batch_size >= 1, got {self.seq_len}, {self.batch_size}"
            )
        if self.val_tokens is not None and self.val_tokens < self.seq_len:
            raise ConfigError(f"{key}.val_tokens", f"must be at least seq_len={self.seq_len}, got {self.val_tokens}")


def _open(path: Any, key: str) -> PreparedFolder:
    if not isinstance(path, str) or not is_prepared(path):
        raise ConfigError(key, f"{path!r} is not a folder made by prepare.py (no meta.json)")
    try:
        return PreparedFolder.open(path)
    except PreparedFolderError as err:
        raise ConfigError(key, str(err)) from None


@DATASETS.register(
    "mixture",
    MixtureConfig,
    "Weighted mixture of prepared folders sharing one tokenizer; metrics per source and overall.",
)
class Mixture(TokenDataset):
    """Rows drawn from several prepared streams by weight; validation per source."""

    metrics = BITS_PER_BYTE

    def __init__(self, cfg: MixtureConfig, seed: int):
        self.cfg = cfg
        self.seed = seed
        self.seq_len = cfg.seq_len
        self.batch_size = cfg.batch_size
        self.vocab_size = cfg.vocab_size
        self.document_masking = cfg.document_masking
        self.names = list(cfg.sources)
        self.streams = [
            PreparedStream(
                PreparedFolder.open(cfg.sources[n]["path"]),
                cfg.seq_len,
                cfg.batch_size,
                cfg.val_tokens,
                seed,
                cfg.document_masking,
                cfg.vocab_size,
            )
            for n in self.names
        ]
        self.eod_id = self.streams[0].eod_id
        weights = torch.tensor([float(cfg.sources[n].get("weight", 1.0)) for n in self.names], dtype=torch.float64)
        self.weights = weights / weights.sum()
        # validation batch b belongs to source _val_source[b], as that source's batch _val_local[b]
        self._val_source: list[int] = []
        self._val_local: list[int] = []
        for s, stream in enumerate(self.streams):
            n = stream.num_val_batches()
            self._val_source += [s] * n
            self._val_local += list(range(n))

    def train_batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = batch_generator(self.seed, index)
        choice = torch.multinomial(self.weights, self.batch_size, replacement=True, generator=g)  # [B]
        rows = []
        for s in choice.tolist():
            tokens = self.streams[s].train
            start = int(torch.randint(0, len(tokens) - self.seq_len - 1, (1,), generator=g))
            rows.append(np.asarray(tokens[start : start + self.seq_len + 1], dtype=np.int64))
        batch = torch.from_numpy(np.stack(rows))  # [B, T+1]
        return batch[:, :-1], batch[:, 1:]

    def num_val_batches(self) -> int:
        return len(self._val_source)

    def val_batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.streams[self._val_source[index]].val_batch(self._val_local[index])

    def metric_sums(self, logits, targets, token_loss, index: int = 0):
        source = self._val_source[index] if index < len(self._val_source) else 0
        part = self.streams[source].metric_sums(logits, targets, token_loss, index)
        sums = dict(part)
        for s, name in enumerate(self.names):  # every batch returns every key, zeros for the other sources
            for k, v in part.items():
                sums[f"{name}/{k}"] = v if s == source else torch.zeros_like(v)
        return sums

    def finish_metrics(self, sums):
        out = self.streams[0].finish_metrics({k: v for k, v in sums.items() if "/" not in k})
        for s, name in enumerate(self.names):
            own = {k.split("/", 1)[1]: v for k, v in sums.items() if k.startswith(f"{name}/")}
            if own.get("tokens", 0) > 0:
                for k, v in self.streams[s].finish_metrics(own).items():
                    out[f"{name}/{k}"] = v
        return out

    def baselines(self) -> dict[str, float]:
        return compressed_bits_per_byte(b"".join(s.validation_bytes() for s in self.streams))

    def describe(self) -> str:
        parts = [f"{n} ({w:.0%}): {s.describe()}" for n, w, s in zip(self.names, self.weights.tolist(), self.streams)]
        return "mixture of " + "; ".join(parts)
