"""An export's tokenizer opens in transformers: ``AutoTokenizer.from_pretrained(OUT)`` tokenises as the
run does (bytes, or its BPE), knows end-of-text, beginning and padding, adds nothing to encoded text and
keeps text that spells a special token as text; the ids are in config.json and generation_config.json."""

from __future__ import annotations

import json

import pytest

from components.data.text.tokenizers import PAD_TOKEN, ByteTokenizer, train_bpe
from tests.hf.transformers_helpers import tiny, write

transformers = pytest.importorskip("transformers")

TEXTS = ["def f(x):\n    return x  # héllo wörld €", "a<|endoftext|>b", "\x00\x7f\t\r\n  ", ""]
CORPUS = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n", "x = [i * i for i in range(9)]\n"]


@pytest.fixture(scope="module")
def model():
    return tiny("model=tiny")


def _check(tmp_path, model, tokenizer, eos, pad):
    root, decoder = model
    written = write(tmp_path, root, decoder, tokenizer=tokenizer)
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(written.other)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (eos, eos, pad)
    for text in TEXTS:
        assert tok(text)["input_ids"] == tokenizer.encode_batch([text])[0].tolist(), text
        assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.decode([*tok("ab")["input_ids"], eos], skip_special_tokens=True) == "ab"
    cfg = json.loads((tmp_path / "config.json").read_text())
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    for source in (cfg, generation):
        assert (source["eos_token_id"], source["bos_token_id"], source["pad_token_id"]) == (eos, eos, pad)


def test_a_byte_level_export_gets_a_tokenizer_transformers_loads(tmp_path, model):
    _check(tmp_path, model, ByteTokenizer(), eos=256, pad=256)


def test_a_bpe_export_names_its_end_of_text_and_padding_tokens(tmp_path, model):
    bpe = train_bpe(iter(CORPUS * 4), 300)
    _check(tmp_path, model, bpe, eos=bpe.eod_id, pad=bpe.tok.token_to_id(PAD_TOKEN))
