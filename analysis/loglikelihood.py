"""Log-likelihoods of token sequences under a decoder: what benchmark harnesses ask a model for.

``continuation_logprobs`` scores (context, continuation) token pairs in right-padded batches (a causal
model never sees the padding before a scored position); ``rolling_logprob`` scores a whole text in
disjoint windows of at most ``max_length`` tokens, the first conditioned on a prefix token (end of
document), each later one on the token just before it (the harness's rolling windows with a context of one). Both
return natural-log probabilities.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from components.objective import token_losses
from runtime.cpu_thread_tuning import LoopThreadTuner, cpu_thread_tuner


def _truncate(context: list[int], continuation: list[int], max_length: int) -> tuple[list[int], list[int]]:
    """Keep the last ``max_length + 1`` tokens of context + continuation (the continuation is scored in
    full if it fits; otherwise its start is dropped from scoring)."""
    whole = (context + continuation)[-(max_length + 1) :]
    n = min(len(continuation), len(whole) - 1)
    return whole[: len(whole) - n], whole[len(whole) - n :]


@torch.no_grad()
def continuation_logprobs(
    model: torch.nn.Module,
    pairs: Sequence[tuple[list[int], list[int]]],
    max_length: int,
    batch_size: int = 8,
    device: str | torch.device = "cpu",
    tuner: Optional[LoopThreadTuner] = None,
) -> list[tuple[float, bool]]:
    """For each (context ids, continuation ids): (sum of log p(continuation token | everything before it),
    whether greedy decoding would have produced the whole continuation). Contexts are non-empty. ``tuner``:
    keeps the CPU thread count right for the machine's load (``runtime/cpu_thread_tuning.py``)."""
    tuner = tuner or cpu_thread_tuner(device, invariant=False)
    out: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
    # longest first: batches of similar lengths pad less
    order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
    for first in range(0, len(order), batch_size):
        chunk = order[first : first + batch_size]
        items = [_truncate(list(pairs[i][0]), list(pairs[i][1]), max_length) for i in chunk]
        inputs = [(c + n)[:-1] for c, n in items]
        width = max(len(x) for x in inputs)
        ids = torch.zeros(len(items), width, dtype=torch.long)  # [B, T] right-padded
        for row, x in enumerate(inputs):
            ids[row, : len(x)] = torch.tensor(x)
        with tuner.timed_step(work=ids.numel()):
            logits = model(ids.to(device)).float().cpu()  # [B, T, V]
        for row, (i, (context, continuation)) in enumerate(zip(chunk, items)):
            if not continuation:
                continue
            start = len(context) - 1  # the position whose output predicts the first continuation token
            target = torch.tensor(continuation)
            scores = logits[row, start : start + len(continuation)]  # [n, V]
            total = -float(token_losses(scores, target).sum())
            greedy = bool((scores.argmax(-1) == target).all())
            out[i] = (total, greedy)
    return out


@torch.no_grad()
def rolling_logprob(
    model: torch.nn.Module, tokens: list[int], prefix_id: int, max_length: int, device: str | torch.device = "cpu"
) -> float:
    """log p(tokens), scored in disjoint windows of ``max_length`` predictions; each window's input is
    the token just before it (``prefix_id`` for the first) and all but its last prediction."""
    total = 0.0
    for start in range(0, len(tokens), max_length):
        predicted = tokens[start : start + max_length]
        inputs = [tokens[start - 1] if start else prefix_id] + predicted[:-1]
        logits = model(torch.tensor([inputs], device=device)).float()[0].cpu()  # [T, V]
        total -= float(token_losses(logits, torch.tensor(predicted)).sum())
    return total
