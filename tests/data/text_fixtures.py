"""Small generated text inputs for the preparation tests: deterministic, varied enough for BPE."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = (
    "the model learns state attention token layer expert router gate decay byte text document "
    "window chunk value key query résumé naïve 東京 λ = ( ) : , . def return if else for in"
).split()


def paragraph(rng: random.Random, n_words: int) -> str:
    lines, line = [], []
    for _ in range(n_words):
        line.append(rng.choice(WORDS))
        if rng.random() < 0.08:
            lines.append(" ".join(line))
            line = []
    lines.append(" ".join(line))
    return "\n".join(lines) + "\n"


def write_text_folder(root: Path, n_files: int = 60, seed: int = 0, words: int = 300) -> Path:
    rng = random.Random(seed)
    for i in range(n_files):
        sub = root / f"part{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"doc{i:03d}.txt").write_text(paragraph(rng, words), encoding="utf-8")
    return root


def write_jsonl(path: Path, n: int = 50, seed: int = 1, field: str = "text") -> Path:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"rec{i}", field: paragraph(rng, 200)}) + "\n")
    return path
