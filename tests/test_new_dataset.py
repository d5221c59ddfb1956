"""Adding a dataset is one module plus one YAML file, nothing else: in a copy of the repository, a JSON-lines
reader with its own tokenizer is written that way; ``train.py`` trains on it, ``analysis.evaluate --lengths
1x`` reproduces the run's own validation loss and bits per byte, ``analysis.generate`` loads the run and
its tokenizer, and the dataset contract tests collect and pass it."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_train
from tests.test_new_component import _tree_hashes, repository_copy_with

DATASET = '''"""JSON lines, one document per line (its ``text`` field), byte-level; the last ones are validation."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch

from components.data.base import DatasetConfig, TokenStreamDataset
from components.data.metrics import BITS_PER_BYTE, ByteAccounting
from components.data.text.tokenizers import ByteTokenizer, TextTokenizer
from components.registry import DATASETS


@dataclass
class JsonLinesConfig(DatasetConfig):
    name: str = "jsonl_docs"
    path: str = "{path}"
    vocab_size: int = 257
    seq_len: int = 32
    batch_size: int = 4
    val_documents: int = 20
    val_tokens: int = 512

    def text_tokenizer(self) -> TextTokenizer:
        return ByteTokenizer()


@DATASETS.register("jsonl_docs", JsonLinesConfig)
class JsonLinesDocs(TokenStreamDataset):
    metrics = BITS_PER_BYTE

    def __init__(self, cfg: JsonLinesConfig, seed: int):
        tokenizer = cfg.text_tokenizer()
        with open(cfg.path) as f:
            texts = [json.loads(line)["text"] for line in f if line.strip()]
        docs = [np.append(ids.astype(np.int64), tokenizer.eod_id) for ids in tokenizer.encode_batch(texts)]
        self.train = np.concatenate(docs[: -cfg.val_documents])
        self.val = np.concatenate(docs[-cfg.val_documents :])
        self.vocab_size, self.seq_len, self.batch_size, self.seed = cfg.vocab_size, cfg.seq_len, cfg.batch_size, seed
        self.eod_id = tokenizer.eod_id
        self.num_val_windows = min((len(self.val) - 1) // cfg.seq_len, cfg.val_tokens // cfg.seq_len)
        lengths = torch.tensor([len(b) for b in tokenizer.token_bytes()], dtype=torch.float64)  # [257]
        self.byte_accounting = ByteAccounting(lengths)
'''

YAML = """# JSON-lines documents, byte-level (components/data/jsonl_docs.py; schema JsonLinesConfig).
defaults:
  - jsonl_docs_schema
  - _self_
"""


def _documents(path: Path, n: int = 120) -> Path:
    rng = random.Random(0)
    words = "alpha beta gamma delta key value query window token byte line".split()
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(20, 60)))}) + "\n")
    return path


def _python(copy: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=copy, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_one_module_and_one_yaml_add_a_dataset(tmp_path):
    docs = _documents(tmp_path / "docs.jsonl")
    new_files = {
        "components/data/jsonl_docs.py": DATASET.replace("{path}", str(docs)),
        "conf/data/jsonl_docs.yaml": YAML,
    }
    copy, before = repository_copy_with(tmp_path, new_files)

    out = tmp_path / "out"
    proc = run_train(
        "data=jsonl_docs",
        "model=tiny",
        "trainer.precision=32-true",
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
        "trainer.compile=false",
        "trainer.enable_progress_bar=false",
        "trainer.max_time_minutes=null",
        "logger=csv",
        f"output_root={out}",
        "name=jsonl",
        cwd=copy,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = out / "jsonl"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["metric"]["primary"] == "bpb" and summary["val"]["bpb"] > 0

    evaluated = _python(copy, "-m", "analysis.evaluate", str(run_dir), "--lengths", "1x", "--tokens", "512")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    one = json.loads((run_dir / "eval" / "lengths.json").read_text())["results"][0]
    assert one["windows"] == 16
    assert one["loss"] == pytest.approx(summary["val"]["loss"], rel=1e-5)
    assert one["bpb"] == pytest.approx(summary["val"]["bpb"], rel=1e-5)

    generated = _python(
        copy, "-m", "analysis.generate", str(run_dir), "--prompt", "alpha beta", "--max-new-tokens", "8"
    )
    assert generated.returncode == 0, generated.stderr[-3000:]
    assert "alpha beta" in generated.stdout

    contract = ["-m", "pytest", "-p", "no:cacheprovider", "-q", "tests/contracts/test_datasets.py", "-k", "jsonl_docs"]
    ran = _python(copy, *contract)
    assert ran.returncode == 0 and "4 passed" in ran.stdout, ran.stdout[-3000:]

    after = _tree_hashes(copy)
    added = set(after) - set(before)
    changed = {rel for rel in before if after.get(rel) != before[rel]}
    assert added == set(new_files) and not changed, (sorted(added), sorted(changed))
