"""Autoregressive generation on top of the decoder's incremental cache."""

from __future__ import annotations

from typing import Optional

import torch

from components.model import Decoder


@torch.no_grad()
def generate(
    model: Decoder,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Continue ``prompt [B, T]`` by ``max_new_tokens`` tokens; returns ``[B, T + max_new_tokens]``.

    ``temperature=0`` is greedy decoding; otherwise tokens are sampled from the softmax of
    ``logits / temperature`` (restricted to the ``top_k`` most likely tokens when given). The prompt
    is processed once (prefill); every later step feeds only the newest token through the cache.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    cache = model.new_cache()
    logits = model(prompt, cache=cache)[:, -1]  # [B, vocab]
    out = [prompt]
    for _ in range(max_new_tokens):
        if temperature == 0:
            token = logits.argmax(-1, keepdim=True)  # [B, 1]
        else:
            scaled = logits.float() / temperature
            if top_k is not None:
                kth = scaled.topk(min(top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            token = torch.multinomial(scaled.softmax(-1), 1, generator=generator)  # [B, 1]
        out.append(token)
        logits = model(token, cache=cache)[:, -1]
    return torch.cat(out, dim=1)
