"""``python -m tests.training.half_batch_train [overrides]``: one process that computes every step as two
data-parallel ranks would, to measure the rounding floor of a 2-rank run (a test harness, not an option).

Each global batch is split into the two halves that ranks 0 and 1 of ``trainer=ddp trainer.devices=2``
take. Each half's forward and backward runs on its own, with its loss divided by the global token count
(``runtime/data_parallel_loss.py``), and the two halves' gradients are added as DDP's all-reduce adds
them (the harness's scale is the rank's divided by the world size, 2: exact in binary floating point).
Router statistics from the two forwards add up as the all-reduce of a 2-rank step does. What remains
between this run and one process is rounding alone: half-sized matrix products, two partial sums. A 2-rank
run that sits within the distance of this run from one process has no defect to find.

Supports the models whose step is a token-mean loss plus router statistics: no MTP, no auxiliary loss.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch

import runtime.lit_module as lit_module
from components.data.base import IGNORE_INDEX

_plain_step = lit_module.LanguageModelModule.training_step


class HalfBatchModule(lit_module.LanguageModelModule):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if len(self.model.mtp):
            raise SystemExit("half_batch_train: models with MTP are not supported")
        self._first_half_grads: Optional[list[Optional[torch.Tensor]]] = None

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        rows = x.shape[0] // 2
        halves = [(x[:rows], y[:rows]), (x[rows:], y[rows:])]  # rank 0's rows, rank 1's rows
        global_count = (y != IGNORE_INDEX).sum().clamp(min=1)
        summed: list[torch.Tensor] = []

        def rank_share(loss_sum: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            summed.append(loss_sum.detach())
            return loss_sum / global_count, torch.stack(summed).sum() / global_count

        original, lit_module.global_token_mean = lit_module.global_token_mean, rank_share
        log = self.log
        try:
            self.log = lambda *a, **k: None  # type: ignore[method-assign]  # rank 1's step logs the global loss
            first = _plain_step(self, halves[0], batch_idx)
            if self.balancer.aux_loss(self.model) is not None:
                raise SystemExit("half_batch_train: balancers with an auxiliary loss are not supported")
            self.log = log  # type: ignore[method-assign]
            params = [p for p in self.parameters() if p.requires_grad]
            self._first_half_grads = list(torch.autograd.grad(first, params, allow_unused=True))
            return _plain_step(self, halves[1], batch_idx)
        finally:
            self.log = log  # type: ignore[method-assign]
            lit_module.global_token_mean = original

    def on_after_backward(self) -> None:
        grads, self._first_half_grads = self._first_half_grads, None
        params = [p for p in self.parameters() if p.requires_grad]
        for p, g in zip(params, grads or []):
            if g is None:
                continue
            p.grad = g.clone() if p.grad is None else p.grad.add_(g)


def main() -> None:
    import runtime.training_run
    from runtime.train_command import main as train_main

    runtime.training_run.LanguageModelModule = HalfBatchModule  # the training module runtime.training_run builds
    sys.exit(train_main(sys.argv[1:]))


if __name__ == "__main__":
    main()
