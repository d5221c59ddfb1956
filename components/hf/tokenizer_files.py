"""The tokenizer files of an exported folder, so ``AutoTokenizer.from_pretrained(OUT)`` knows its specials.

* ``tokenizer.json``: the run's own (BPE or a file), or for byte-level runs one built here that
  tokenises exactly as ``ByteTokenizer`` does (each UTF-8 byte is its own id 0..255; 256 is
  ``<|endoftext|>``).
* ``tokenizer_config.json``: the fast tokenizer class and the special tokens: end of text (the run's
  end-of-document token), beginning (the same token: a document starts after the previous one's end,
  and an empty context is scored after it, as the project's harness model does) and padding (the run's
  padding token, else end of text); no special token is added to encoded text, and text that spells a
  special token stays text (``split_special_tokens``), as the project encodes it.
* ``generation_config.json``: the same ids, greedy by default.

The ids also go into ``config.json`` (``special_token_ids``). Nothing here needs transformers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from components.data.text.tokenizers import EOD_TOKEN, TOKENIZER_FILE, ByteTokenizer, TextTokenizer

TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
GENERATION_CONFIG = "generation_config.json"


def byte_level_tokenizer():
    """A ``tokenizers.Tokenizer`` equal to ``ByteTokenizer``: bytes 0..255 are ids 0..255 (byte-level
    alphabet, no merges), ``<|endoftext|>`` is 256."""
    alphabet = _byte_alphabet()
    vocab = {alphabet[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOD_TOKEN, special=True, normalized=False)])
    assert tok.token_to_id(EOD_TOKEN) == ByteTokenizer.eod_id
    return tok


def _byte_alphabet() -> list[str]:
    """The character byte-level BPE writes for each byte (GPT-2's printable remapping), by byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def special_tokens(tokenizer: TextTokenizer) -> dict[str, tuple[str, int]]:
    """``{"eos"|"bos"|"pad": (token text, id)}`` of ``tokenizer``."""
    eod = (
        (EOD_TOKEN, tokenizer.eod_id)
        if tokenizer.kind == "bytes"
        else (_token(tokenizer, tokenizer.eod_id), tokenizer.eod_id)
    )
    pad = eod if tokenizer.pad_id is None else (_token(tokenizer, tokenizer.pad_id), tokenizer.pad_id)
    return {"eos": eod, "bos": eod, "pad": pad}


def _token(tokenizer: TextTokenizer, i: int) -> str:
    return tokenizer.tok.id_to_token(i)  # an HFTokenizer


def special_token_ids(tokenizer: TextTokenizer) -> dict[str, int]:
    """``config.json`` / ``generation_config.json`` fields: ``eos_token_id``, ``bos_token_id``, ``pad_token_id``."""
    return {f"{k}_token_id": i for k, (_, i) in special_tokens(tokenizer).items()}


def write_tokenizer_files(folder: str, tokenizer: TextTokenizer, model_max_length: Optional[int] = None) -> list[str]:
    """Write the tokenizer files into ``folder``; returns their names."""
    written = []
    if tokenizer.save(Path(folder)):
        written.append(TOKENIZER_FILE)
    elif tokenizer.kind == "bytes":
        byte_level_tokenizer().save(os.path.join(folder, TOKENIZER_FILE))
        written.append(TOKENIZER_FILE)
    specials = special_tokens(tokenizer)
    names = {f"{k}_token": text for k, (text, _) in specials.items()}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **names,
        "add_bos_token": False,
        "add_eos_token": False,
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length or 1 << 30,
    }
    _write_json(os.path.join(folder, TOKENIZER_CONFIG), config)
    _write_json(os.path.join(folder, SPECIAL_TOKENS_MAP), names)
    return [*written, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP]


def write_generation_config(folder: str, ids: dict[str, int]) -> str:
    """``generation_config.json`` with the special ids (greedy decoding unless asked otherwise)."""
    _write_json(os.path.join(folder, GENERATION_CONFIG), {**ids, "do_sample": False})
    return GENERATION_CONFIG


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
