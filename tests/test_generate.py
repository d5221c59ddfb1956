"""Generation through the cache equals recomputing the whole sequence at every step."""

from __future__ import annotations

import pytest
import torch

from components.registry import MIXERS
from components.sampling import generate
from tests.helpers import build_model


@pytest.mark.parametrize("mixer", MIXERS.names())
def test_greedy_generation_matches_full_recomputation(mixer):
    torch.manual_seed(0)
    model = build_model("model=tiny", f"mixer={mixer}").double().eval()
    prompt = torch.randint(0, model.vocab_size, (2, 7))
    out = generate(model, prompt, max_new_tokens=6)
    seq = prompt
    with torch.no_grad():
        for _ in range(6):
            nxt = model(seq)[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out, seq)


def test_sampling_is_seeded_and_respects_top_k():
    torch.manual_seed(0)
    model = build_model("model=tiny").eval()
    prompt = torch.randint(0, model.vocab_size, (1, 4))
    a = generate(model, prompt, 8, temperature=1.0, generator=torch.Generator().manual_seed(1))
    b = generate(model, prompt, 8, temperature=1.0, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and a.shape == (1, 12)
    top1 = generate(model, prompt, 8, temperature=1.0, top_k=1)
    assert torch.equal(top1, generate(model, prompt, 8))  # top-1 sampling is greedy
