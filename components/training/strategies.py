"""Lightning strategies behind ``trainer.strategy``: one process, DDP, or FSDP2.

* ``ddp``: Lightning's DDPStrategy. Buffers are not re-broadcast from rank 0 at every forward: the only
  buffers that change during training are the routers' selection biases, which every rank computes
  identically from all-reduced statistics (components/balancers/load_stats.py) -- a divergence would
  be a bug, and the training module logs it (``balance/bias_rank_divergence``) instead of hiding it.
* ``fsdp2``: Lightning's ModelParallelStrategy with a data-parallel mesh over every rank (no tensor
  parallelism); the module shards itself in ``configure_model`` (torch ``fully_shard`` per decoder
  layer, then the root). Checkpoints are sharded folders written by torch.distributed.checkpoint,
  made crash-safe here: written under a temporary name, then swapped in, so an interrupted save never
  replaces the previous good folder.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy


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
        if self.global_rank == 0:
            if path.exists():
                os.replace(path, old)  # a folder cannot be renamed over a non-empty one
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        self.barrier("sharded_checkpoint_done")

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.global_rank == 0:
            shutil.rmtree(filepath, ignore_errors=True) if Path(filepath).is_dir() else Path(filepath).unlink(missing_ok=True)


def world_size_of(trainer_cfg: Any) -> Optional[int]:
    """Ranks the run will have, when the config says (None for ``devices: auto``)."""
    d = trainer_cfg.devices
    per_node = len(d) if isinstance(d, list) else d if isinstance(d, int) else None
    return None if per_node is None else per_node * trainer_cfg.num_nodes


def build_strategy(trainer_cfg: Any) -> Any:
    """The ``strategy=`` argument of ``lightning.Trainer`` for ``trainer.strategy``."""
    name = trainer_cfg.strategy
    if name == "auto":
        return "auto"
    if name == "ddp":
        return DDPStrategy(forward_sync_buffers=False, find_unused_parameters=False, gradient_as_bucket_view=True)
    if name == "fsdp2":
        # every rank one data-parallel shard; Lightning's "auto" would make the node a tensor-parallel group
        world = world_size_of(trainer_cfg)
        if world is None:
            import torch

            world = (torch.cuda.device_count() if trainer_cfg.accelerator in ("gpu", "cuda", "auto") else 1) * trainer_cfg.num_nodes
        return AtomicShardedStrategy(data_parallel_size=world, tensor_parallel_size=1, save_distributed_checkpoint=True)
    raise ValueError(f"trainer.strategy: unknown strategy '{name}' (allowed: auto, ddp, fsdp2)")
