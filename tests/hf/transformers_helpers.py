"""What the transformers tests share: tiny models with every weight moved off its initial value, a
folder written as analysis.export writes it, and the comparison the export promises (fp32 logits within
a relative 1e-5, greedy continuations equal up to the end-of-text token)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from components.data.text.tokenizers import ByteTokenizer, TextTokenizer
from components.hf.export_folder import ExportedFolder, write_model_folder
from components.hf.key_map import TEXT_PREFIX
from components.model import Decoder
from components.sampling import generate
from runtime.config import to_container
from tests.helpers import compose_root

REL = 1e-5


def tiny(*overrides: str, seed: int = 0, scale: float = 0.05):
    """(root, model in eval mode) of the overrides on the byte corpus; every floating tensor moved by
    ``scale`` noise (zero inits, unit norms and the selection bias all take part)."""
    root = compose_root("data=corpus", *overrides)
    torch.manual_seed(seed)
    model = Decoder(root.decoder_config()).eval()
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.add_(torch.randn_like(t) * scale)
    return root, model


def write(
    folder: Path,
    root,
    model: Decoder,
    prefix: str = TEXT_PREFIX,
    mxfp4_experts: bool = False,
    tokenizer: Optional[TextTokenizer] = None,
) -> ExportedFolder:
    folder.mkdir(parents=True, exist_ok=True)
    return write_model_folder(
        str(folder),
        root,
        model,
        to_container(root),
        prefix,
        mxfp4_experts=mxfp4_experts,
        tokenizer=tokenizer or ByteTokenizer(),
    )


def ids(batch: int = 2, length: int = 24, vocab: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def assert_close(ours: torch.Tensor, theirs: torch.Tensor, rel: float = REL) -> float:
    """Logits equal within ``rel`` of the largest logit; returns the largest difference."""
    diff = max_diff(ours, theirs)
    bound = rel * max(1.0, ours.abs().max().item())
    assert diff <= bound, f"largest logit difference {diff:.3e} > {bound:.3e}"
    print(f"largest logit difference {diff:.2e} (logits up to {ours.abs().max().item():.2f})")
    return diff


def assert_same_greedy(model: Decoder, hf_model, prompt: torch.Tensor, n: int, eos: int) -> list[int]:
    """transformers' greedy ``generate`` gives the project's greedy continuation (which runs on past
    the end-of-text token, where generate stops); returns the continuation."""
    ours = generate(model, prompt, n)[0, prompt.shape[1] :].tolist()
    if eos in ours:
        ours = ours[: ours.index(eos) + 1]
    theirs = hf_model.generate(prompt, max_new_tokens=n, do_sample=False)[0, prompt.shape[1] :].tolist()
    assert theirs == ours
    return ours
