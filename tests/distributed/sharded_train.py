"""``python -m tests.distributed.sharded_train [overrides]``: ``train.py`` as a sharded run's test sees it (a
test harness, not an option).

* ``SaveRouterBiases`` (``+callbacks.biases={_target_:tests.distributed.sharded_train.SaveRouterBiases,
  path:FILE}``) writes every router's selection bias at the end of training, from rank 0.
* ``ExpertGradNorm`` (``+callbacks.expert_grad_norm={_target_:tests.distributed.sharded_train.ExpertGradNorm}``)
  logs ``train/expert_grad_norm``, the norm of the routed experts' gradients alone: Muon and AdamW updates do
  not change when a gradient is scaled, so a wrong scale of the expert gradients shows in their norm (and in
  clipping) before it shows in a loss.
* ``PLANTED_DEFECT=NAME`` plants one expert-parallel defect, so a test can show its comparison catches it
  (the ranks Lightning spawns inherit the environment and re-run this module):

  - ``fsdp_divides_expert_grads``: the experts' FSDP units keep FSDP's default gradient division (an average
    over the expert-sharding dimension) instead of the sum every other unit uses;
  - ``ep_group_router_stats``: router statistics summed over the expert-parallel group only, not over every
    data-parallel rank.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning as L
import torch

DEFECTS = ("fsdp_divides_expert_grads", "ep_group_router_stats")


class SaveRouterBiases(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from components.balancers.load_stats import find_routers

        if trainer.global_rank == 0:
            biases = [r.e_score_correction_bias.detach().cpu().clone() for r in find_routers(pl_module.model)]
            torch.save(biases, self.path)


class ExpertGradNorm(L.Callback):
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        from components.ffn.expert_parallel import EXPERT_WEIGHTS, routed_experts
        from runtime.grad_norm import total_grad_norm

        params = [getattr(e, n) for e in routed_experts(pl_module.model) for n in EXPERT_WEIGHTS]
        norm = total_grad_norm(params)
        if norm is not None:
            pl_module.log("train/expert_grad_norm", norm, on_step=True, on_epoch=False)


def _plant(defect: str) -> None:
    import components.balancers.load_stats as load_stats
    import components.ffn.expert_parallel as expert_parallel
    import runtime.strategies as strategies

    if defect == "fsdp_divides_expert_grads":
        shard = strategies.shard_fsdp2

        def shard_with_default_division(model: Any, *args: Any, **kwargs: Any) -> None:
            shard(model, *args, **kwargs)
            for experts in expert_parallel.routed_experts(model):
                for group in experts._get_fsdp_state()._fsdp_param_groups:
                    group.gradient_divide_factor, group.force_sum_reduction_for_comms = None, False

        strategies.shard_fsdp2 = shard_with_default_division
    elif defect == "ep_group_router_stats":
        distribute = strategies.distribute_experts  # the name the FSDP2 recipe calls

        def distribute_and_capture(model: Any, ep_mesh: Any) -> Any:
            load_stats.router_stats_group = lambda: ep_mesh.get_group()
            return distribute(model, ep_mesh)

        strategies.distribute_experts = distribute_and_capture
    elif defect:
        raise SystemExit(f"PLANTED_DEFECT: '{defect}' is not one of {', '.join(DEFECTS)}")


def main() -> None:
    _plant(os.environ.get("PLANTED_DEFECT", ""))
    from runtime.train_command import main as train_main

    sys.exit(train_main(sys.argv[1:]))


if __name__ == "__main__":
    main()
