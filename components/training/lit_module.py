"""LightningModule: next-token loss, AdamW with warmup + cosine decay, validation metrics."""

from __future__ import annotations

import math
import shutil
import time
from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F

from components.config import RootConfig
from components.data.base import IGNORE_INDEX, TokenDataset
from components.model import Decoder
from components.optim.build import build_optimizer
from components.registry import BALANCERS


def compile_unfriendly(model: torch.nn.Module) -> list[str]:
    """Modules that declare ``compile_friendly = False``: eager code with data-dependent control flow or
    host-side statistics (KDA's chunked kernel, routers' balancing statistics), where graph breaks make
    torch.compile recompile per layer and cost more than it saves."""
    return sorted({type(m).__name__ for m in model.modules() if getattr(m, "compile_friendly", True) is False})


def should_compile(trainer_cfg: Any, model: Optional[torch.nn.Module] = None) -> bool:
    choice = str(trainer_cfg.compile).lower()
    if choice != "auto":
        return choice == "true"
    if model is not None and compile_unfriendly(model):
        return False
    if trainer_cfg.accelerator in ("gpu", "cuda"):
        return True
    return any(shutil.which(cc) for cc in ("c++", "g++", "clang++"))


class TimeBudget:
    """Training seconds used so far, for schedules that must finish within ``trainer.max_time_minutes``."""

    def __init__(self, seconds: Optional[float]):
        self.seconds = seconds
        self.started: Optional[float] = None

    def fraction(self) -> float:
        if not self.seconds or self.started is None:
            return 0.0
        return (time.perf_counter() - self.started) / self.seconds


def lr_lambda(step: int, warmup: int, total: int, schedule: str, min_ratio: float, time_fraction: float = 0.0) -> float:
    """Multiplier of the peak learning rate at ``step``: linear warmup, then the chosen decay.

    The decay follows whichever is further along, steps or the time budget, so a run capped by
    ``trainer.max_time_minutes`` still ends fully decayed on a slower machine.
    """
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, max((step - warmup) / max(1, total - warmup), time_fraction))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LanguageModelModule(L.LightningModule):
    def __init__(self, cfg: RootConfig, dataset: TokenDataset):
        super().__init__()
        self.cfg = cfg
        self.dataset = dataset
        self.model = Decoder(cfg)
        self.balancer = BALANCERS.build(cfg.balancer)
        self.balancer.attach(self.model)
        # compiled view of the same module (shares parameters; state dicts keep the plain names)
        hidden = self.model.hidden_states
        hidden = torch.compile(hidden, dynamic=False) if should_compile(cfg.trainer, self.model) else hidden
        object.__setattr__(self, "_hidden", hidden)  # not registered: no second copy in state dicts
        minutes = cfg.trainer.max_time_minutes
        self.time_budget = TimeBudget(minutes * 60 if minutes else None)
        self._val_sums: dict[str, torch.Tensor] = {}
        self.last_val_metrics: dict[str, float] = {}

    def on_train_start(self) -> None:
        self.time_budget.started = time.perf_counter()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def _token_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # cross-entropy in fp32 whatever the activation dtype
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none").view_as(targets)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self._hidden(x)  # [B, T, d]
        mask = y != IGNORE_INDEX
        # project only the scored positions: on sparse tasks (MQAR) the output layer is most of the work
        logits = self.model.lm_head(h[mask])  # [N, vocab]
        loss = F.cross_entropy(logits.float(), y[mask], reduction="sum") / mask.sum().clamp(min=1)
        total = loss
        aux = self.balancer.aux_loss(self.model)
        if aux is not None:
            total = total + aux
            self.log("train/aux_loss", aux.detach(), on_step=True, on_epoch=False)
        self.log("train/loss", loss.detach(), on_step=True, on_epoch=False, prog_bar=True)
        return total

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # norm before clipping (Lightning clips right after this hook)
        norms = [p.grad.detach().float().norm() for p in self.parameters() if p.grad is not None]
        if norms:
            self.log("train/grad_norm", torch.stack(norms).norm(), on_step=True, on_epoch=False)
        self.log("train/lr", optimizer.param_groups[0]["lr"], on_step=True, on_epoch=False)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.trainer.fit_loop._should_accumulate():
            return
        metrics = self.balancer.step(self.model)
        for k, v in metrics.items():
            self.log(f"balance/{k}", v, on_step=True, on_epoch=False)

    # -- validation -----------------------------------------------------------------------------
    def on_validation_epoch_start(self) -> None:
        self._val_sums = {}

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self.model.lm_head(self._hidden(x))
        token_loss = self._token_loss(logits, y)
        for k, v in self.dataset.metric_sums(logits, y, token_loss).items():
            v = v.detach().double()
            self._val_sums[k] = self._val_sums[k] + v if k in self._val_sums else v

    def on_validation_epoch_end(self) -> None:
        if not self._val_sums:
            return
        keys = sorted(self._val_sums)
        stacked = torch.stack([self._val_sums[k] for k in keys])
        stacked = self.trainer.strategy.reduce(stacked, reduce_op="sum")
        metrics = self.dataset.finish_metrics({k: float(v) for k, v in zip(keys, stacked)})
        self.last_val_metrics = {k: float(v) for k, v in metrics.items()}
        for k, v in self.last_val_metrics.items():
            self.log(f"val/{k}", v, on_step=False, on_epoch=True, prog_bar=k in ("loss", self.dataset.metric), sync_dist=False, rank_zero_only=True)

    # -- optimisation ---------------------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        o = self.cfg.optimizer
        optimizer = build_optimizer(self.model, o)
        total = self.cfg.trainer.max_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: lr_lambda(step, o.warmup_steps, total, o.schedule, o.min_lr_ratio, self.time_budget.fraction()),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: Optional[float] = None, gradient_clip_algorithm: Optional[str] = None) -> None:
        if gradient_clip_val:
            self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm="norm")
