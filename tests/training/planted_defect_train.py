"""``PLANTED_DEFECT=NAME python -m tests.training.planted_defect_train [overrides]``: ``train.py`` with one
data-parallel defect planted, so a test can show that its comparison catches it (a test harness).

The defect is chosen by the environment, which the ranks Lightning spawns inherit (they re-run this
module with the same arguments):

* ``local_loss_mean``: each rank divides its summed loss by its own token count and logs that, instead
  of the global token mean (``runtime/data_parallel_loss.py``);
* ``local_qb_histogram``: Quantile Balancing updates each rank's bias from its own margin histogram,
  not the histogram summed over ranks.
"""

from __future__ import annotations

import os
import sys

import torch

DEFECTS = ("local_loss_mean", "local_qb_histogram")


def _local_token_mean(loss_sum: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = loss_sum / count.clamp(min=1)
    return mean, mean.detach()


def plant(defect: str) -> None:
    if defect == "local_loss_mean":
        import runtime.lit_module as lit_module

        lit_module.global_token_mean = _local_token_mean
    elif defect == "local_qb_histogram":
        import components.balancers.qb as qb

        qb.reduce_router_stats_ = lambda t: t
    else:
        raise SystemExit(f"PLANTED_DEFECT: '{defect}' is not one of {', '.join(DEFECTS)}")


def main() -> None:
    plant(os.environ.get("PLANTED_DEFECT", ""))
    from runtime.train_command import main as train_main

    sys.exit(train_main(sys.argv[1:]))


if __name__ == "__main__":
    main()
