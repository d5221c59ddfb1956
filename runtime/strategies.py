"""Lightning strategies behind ``trainer.strategy``: one process, DDP, or FSDP2.

* ``ddp``: Lightning's DDPStrategy. Buffers are not re-broadcast from rank 0 at every forward: the only
  buffers that change during training are the routers' selection biases, which every rank computes
  identically from all-reduced statistics (components/balancers/load_stats.py) -- a divergence would
  be a bug, and the training module logs it (``balance/bias_rank_divergence``) instead of hiding it.
* ``fsdp2``: Lightning's ModelParallelStrategy with a data-parallel mesh over every rank (no tensor
  parallelism); the module shards itself in ``configure_model`` with ``shard_fsdp2`` (torch ``fully_shard``
  per decoder layer, MTP depth, embedding, head and final norm, then the root; the method training calls
  instead of ``forward`` registered; bf16 parameters and fp32 reductions under ``bf16-mixed``).
  Checkpoints are sharded folders written by torch.distributed.checkpoint, made crash-safe here: written
  under a temporary name, then swapped in, so an interrupted save never replaces the previous good folder.
"""

from __future__ import annotations

import inspect
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import Shard
from torch.nn.parallel import DistributedDataParallel

from components.ffn.expert_parallel import distribute_experts
from runtime.config import data_parallel_ranks
from runtime.data_parallel_loss import sum_gradients_over_ranks

# the decoder's method training calls instead of forward (runtime/lit_module.py, benchmarks/train_step.py). Not
# ``mtp_losses``: it runs after ``hidden_states``, when the root (which FSDP2 does not reshard after forward)
# is still gathered, and of the root it uses only the final norm. Registered, the root's post-backward would
# fire as soon as the MTP gradient reached the backbone's hidden states (its input), resharding the root before
# the backbone's own backward ran through it.
FSDP_FORWARD_METHODS = ("hidden_states",)


def mixed_precision_policy(precision: str) -> Any:
    """FSDP2's precision policy for ``trainer.precision``: under ``bf16-mixed`` parameters are all-gathered and
    used in bf16 (half the traffic and transient memory of fp32) while gradients are reduce-scattered and
    kept in fp32 (the optimizer's sharded master weights stay fp32); None (FSDP2's default: the parameters'
    own dtype throughout) otherwise."""
    if precision != "bf16-mixed":
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def expert_parallel_mesh(mesh: Any, expert_parallel: int) -> Any:
    """The data-parallel ``mesh`` (1-D, W ranks) as the 2-D mesh ``(efsdp, ep)`` = ``(W / n, n)``: rank r at
    ``(r // n, r % n)``, so an expert-parallel group is n consecutive ranks (one node's fast links first)."""
    world = mesh.size()
    return init_device_mesh(
        mesh.device_type, (world // expert_parallel, expert_parallel), mesh_dim_names=("efsdp", "ep")
    )


def shard_fsdp2(model: Any, mesh: Any, mp_policy: Any = None, expert_parallel: int = 1) -> None:
    """FSDP2 over ``mesh`` (a data-parallel device mesh). Units, each gathered only while it runs: every
    decoder layer, every MTP depth, the embedding, the head (one unit with the embedding when they are tied),
    then the root (the final norm, which the residual scheme reads by weight, and the scheme's weights). The
    embedding and head run more than once per step (backbone and each MTP depth): as units of their own, each
    use gathers them in forward and again in backward, and each backward reduces its share of the gradient.
    ``mp_policy``: ``mixed_precision_policy(trainer.precision)``.

    ``expert_parallel`` = n > 1: the mesh unflattened into ``(efsdp, ep)``; every routed layer's experts split
    over ``ep`` (components/ffn/expert_parallel.py: whole experts, global names and shapes kept) and each
    ``experts`` module an FSDP unit over ``efsdp`` (sharded on the expert dimension), everything else over all
    ranks. Gradients are summed over ranks, never divided (runtime/data_parallel_loss.py says why); gloo has
    no pre-multiplied sum, so the reductions are plain sums. Every place that shards the model calls this
    (the trainer, the GPU check)."""
    kw = {} if mp_policy is None else {"mp_policy": mp_policy}
    if expert_parallel > 1:
        mesh2 = expert_parallel_mesh(mesh, expert_parallel)
        for experts in distribute_experts(model, mesh2["ep"]):
            fully_shard(experts, mesh=mesh2["efsdp"], shard_placement_fn=lambda p: Shard(0), **kw)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    for depth in model.mtp:
        fully_shard(depth, mesh=mesh, **kw)
    if model.lm_head.weight is model.embed.weight:
        fully_shard([model.embed, model.lm_head], mesh=mesh, **kw)
    else:
        fully_shard(model.embed, mesh=mesh, **kw)
        fully_shard(model.lm_head, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    for method in FSDP_FORWARD_METHODS:
        register_fsdp_forward_method(model, method)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    sum_gradients_over_ranks()


class AtomicShardedStrategy(ModelParallelStrategy):
    """ModelParallelStrategy whose sharded checkpoint folders appear only once complete."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        path = Path(self.broadcast(str(filepath)))
        tmp = path.with_name(f".{path.name}.partial")
        old = path.with_name(f".{path.name}.old")
        if self.global_rank == 0:
            for stale in (tmp, old):
                shutil.rmtree(stale, ignore_errors=True)
        self.barrier("sharded_checkpoint_start")
        super().save_checkpoint(checkpoint, tmp, storage_options)
        self.barrier("sharded_checkpoint_written")
        error = ""
        if self.global_rank == 0:
            try:
                if path.exists():
                    os.replace(path, old)  # a folder cannot be renamed over a non-empty one
                os.replace(tmp, path)
                shutil.rmtree(old, ignore_errors=True)
            except OSError as err:
                error = f"{type(err).__name__}: {err}"
        # every rank learns the outcome, so a failed swap raises everywhere instead of leaving ranks waiting
        error = self.broadcast(error)
        if error:
            raise RuntimeError(f"could not put the sharded checkpoint {path} in place: {error}")

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.global_rank != 0:
            return
        if Path(filepath).is_dir():
            shutil.rmtree(filepath, ignore_errors=True)
        else:
            Path(filepath).unlink(missing_ok=True)


def _no_buffer_sync() -> dict[str, bool]:
    """DDP's switch for not re-broadcasting buffers at every forward (renamed in torch 2.13)."""
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


def build_strategy(trainer_cfg: Any) -> Any:
    """The ``strategy=`` argument of ``lightning.Trainer`` for ``trainer.strategy``."""
    name = trainer_cfg.strategy
    if name == "auto":
        return "auto"
    if name == "ddp":
        return DDPStrategy(**_no_buffer_sync(), find_unused_parameters=False, gradient_as_bucket_view=True)
    if name == "fsdp2":
        # every rank one data-parallel shard; Lightning's "auto" would make the node a tensor-parallel group
        world = data_parallel_ranks(trainer_cfg)
        if world is None:
            per_node = torch.cuda.device_count() if trainer_cfg.accelerator in ("gpu", "cuda", "auto") else 1
            world = max(1, per_node) * trainer_cfg.num_nodes
        return AtomicShardedStrategy(data_parallel_size=world, tensor_parallel_size=1, save_distributed_checkpoint=True)
    raise ValueError(f"trainer.strategy: unknown strategy '{name}' (allowed: auto, ddp, fsdp2)")
