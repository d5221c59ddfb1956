"""Autoregressive generation on top of the decoder's incremental cache."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from components.distributed import require_whole_model
from components.model import Decoder


@torch.no_grad()
def generate(
    model: Decoder,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    top_p: Optional[float] = None,
    on_token: Optional[Callable[[torch.Tensor], Optional[bool]]] = None,
) -> torch.Tensor:
    """Continue ``prompt [B, T]`` by ``max_new_tokens`` tokens; returns ``[B, T + max_new_tokens]``.

    ``temperature=0`` is greedy decoding; otherwise tokens are sampled from the softmax of
    ``logits / temperature``, restricted to the ``top_k`` most likely tokens and to the smallest set
    whose probability reaches ``top_p`` (nucleus) when given. The prompt is processed once (prefill);
    every later step feeds only the newest token through the cache. ``on_token`` sees each new
    ``[B, 1]`` token as it is chosen (streaming); returning True stops generation after that token
    (a stop sequence), so the result may be shorter. A model split over ranks is refused by name
    (``require_whole_model``).
    """
    require_whole_model(model, "generate")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
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
            probs = scaled.softmax(-1)  # [B, vocab]
            if top_p is not None:
                sorted_p, order = probs.sort(dim=-1, descending=True)
                outside = sorted_p.cumsum(-1) - sorted_p >= top_p  # tokens after the nucleus is full
                probs = probs.scatter(-1, order, sorted_p.masked_fill(outside, 0.0))
            token = torch.multinomial(probs, 1, generator=generator)  # [B, 1]
        out.append(token)
        if on_token is not None and on_token(token):
            break
        logits = model(token, cache=cache)[:, -1]
    return torch.cat(out, dim=1)
