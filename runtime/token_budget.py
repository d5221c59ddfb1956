"""How long a run trains: a token budget in optimizer steps, and the sentence the run starts with."""

from __future__ import annotations

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
    guard = f", time guard {t.max_time_minutes:g} min" if t.max_time_minutes else ""
    return f"{steps:,} steps x {tokens_per_step(root):,} tokens = {tokens:,} tokens ({source}{guard})"
