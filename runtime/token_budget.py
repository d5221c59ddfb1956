"""How long a run trains: a token budget in optimizer steps, and the sentence the run starts with."""

from __future__ import annotations

from typing import Optional

from runtime.config import RootConfig


def tokens_per_step(root: RootConfig) -> int:
    """Training tokens one optimizer step consumes (global: summed over data-parallel ranks)."""
    return root.data.batch_size * root.data.seq_len * root.trainer.accumulate_grad_batches


def training_steps(root: RootConfig) -> int:
    """Optimizer steps the run trains: ``trainer.max_steps`` when set, else the ``trainer.max_tokens``
    budget in whole steps (rounded up)."""
    t = root.trainer
    if t.max_steps is not None:
        return t.max_steps
    return -(-t.max_tokens // tokens_per_step(root))


def time_guard_minutes(root: RootConfig) -> Optional[float]:
    """The wall-time guard: ``trainer.max_time_minutes``, raised to the planned tokens at
    ``trainer.min_tokens_per_s`` where that is longer (None: no guard)."""
    t = root.trainer
    if not t.max_time_minutes:
        return None
    if not t.min_tokens_per_s:
        return t.max_time_minutes
    tokens = training_steps(root) * tokens_per_step(root)
    return max(t.max_time_minutes, tokens / t.min_tokens_per_s / 60)


def describe_length(root: RootConfig) -> str:
    """How long the run trains, in steps and tokens, and which setting decided it."""
    steps = training_steps(root)
    tokens = steps * tokens_per_step(root)
    t = root.trainer
    if t.max_steps is None:
        source = f"trainer.max_tokens={t.max_tokens:,}"
    elif t.max_tokens is not None:
        source = f"trainer.max_steps; trainer.max_tokens={t.max_tokens:,} is not used"
    else:
        source = "trainer.max_steps"
    minutes = time_guard_minutes(root)
    guard = ""
    if minutes is not None:
        rate = f": the tokens at {t.min_tokens_per_s:,g} tokens/s" if minutes > t.max_time_minutes else ""
        guard = f", time guard {minutes:.0f} min{rate}"
    return f"{steps:,} steps x {tokens_per_step(root):,} tokens = {tokens:,} tokens ({source}{guard})"
