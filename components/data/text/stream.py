"""Windows of a prepared folder's token streams, scored in bits per byte whatever the tokenizer.

Validation bits per byte = (summed next-token loss over the scored targets) / ln 2 / (the UTF-8 bytes
those targets stand for). The bytes come from the tokenizer's per-id byte lengths, so any subset of
windows is scored exactly; end-of-document tokens stand for no bytes, but their loss counts (a model
pays for knowing where documents end, as a compressor does). When a tokenizer's per-id lengths do not
add up to its documents' sizes (``meta.json``: ``token_bytes_exact`` false, e.g. a normalising
tokenizer), the split's average bytes per token is used instead, and ``describe`` says so.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from components.data.base import TokenStreamDataset
from components.data.compressor_baselines import compressed_bits_per_byte
from components.data.metrics import BITS_PER_BYTE, ByteAccounting
from components.data.text.prepared import PreparedFolder, bytes_per_token


class PreparedStream(TokenStreamDataset):
    """Random training windows and consecutive validation windows of one prepared folder."""

    metrics = BITS_PER_BYTE

    def __init__(
        self,
        folder: PreparedFolder,
        seq_len: int,
        batch_size: int,
        val_tokens: Optional[int],
        seed: int,
        document_masking: bool = False,
        vocab_size: Optional[int] = None,
    ):
        self.folder = folder
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.vocab_size = vocab_size or folder.vocab_size
        self.eod_id = folder.eod_id
        self.document_masking = document_masking
        self.train = folder.tokens("train")
        self.val = folder.tokens("val")
        for split, arr in (("train", self.train), ("val", self.val)):
            if len(arr) <= seq_len + 1:
                raise ValueError(
                    f"{folder.path}: the {split} split holds {len(arr)} tokens, fewer than seq_len + 2 = {seq_len + 2}"
                )
        n_val = (len(self.val) - 1) // seq_len
        self.num_val_windows = min(n_val, val_tokens // seq_len) if val_tokens else n_val
        table = folder.tokenizer.token_bytes()
        self._token_bytes = table
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        lengths[: len(table)] = [len(b) for b in table]
        self.exact = bool(folder.meta.get("token_bytes_exact", False))
        if not self.exact:  # the split's average, for every non-special token
            lengths = np.where(lengths > 0, bytes_per_token(folder.meta["splits"]["val"]), 0.0)
        self.byte_accounting = ByteAccounting(torch.from_numpy(lengths))

    def validation_bytes(self) -> bytes:
        """The UTF-8 bytes the scored validation targets stand for."""
        targets = np.asarray(self.val[1 : self.num_val_windows * self.seq_len + 1])
        table = self._token_bytes
        return b"".join(table[t] for t in targets.tolist())

    def baselines(self) -> dict[str, float]:
        return compressed_bits_per_byte(self.validation_bytes())

    def describe(self) -> str:
        note = "" if self.exact else "; bits per byte use the split's average bytes per token"
        return f"{self.folder.describe()}, {self.num_val_windows} validation windows of {self.seq_len}{note}"
