"""LightningModule: next-token loss, optimizer with warmup + decay, validation metrics, and the guards
that keep a distributed run meaning the same as a one-process run.

* Loss normalisation (runtime/data_parallel_loss.py): the gradient DDP/FSDP average is the
  gradient of the global token-mean loss, and the logged ``train/loss`` is that mean, as on one process.
* Non-finite guard (``trainer.on_nonfinite``): a NaN/inf loss or gradient norm stops the run naming the
  step, before the update and before any checkpoint of that step, or skips the update.
* Checkpoints carry every rank's RNG state.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from components.activation_probe import largest_activations
from components.balancers.load_stats import bias_rank_divergence, find_routers
from components.data.base import TokenDataset
from components.distributed import world_size
from components.model import Decoder
from components.nn.segments import Segments
from components.objective import document_segments, scored_loss_sum, token_losses
from components.optim.schedules.base import SCHEDULES
from components.registry import BALANCERS, OPTIMIZERS
from runtime import rng_state
from runtime.compile import compile_mode, compiled_hidden
from runtime.config import RootConfig, to_container
from runtime.data_parallel_loss import global_token_mean
from runtime.grad_norm import clip_grads_with_norm_, total_grad_norm
from runtime.loggers import log_validation
from runtime.strategies import mixed_precision_policy, shard_fsdp2


class NonFiniteTrainingError(RuntimeError):
    """A NaN or infinite loss or gradient ended the run (``trainer.on_nonfinite=stop``)."""


def _loss_scale(trainer: Any) -> float:
    """The fp16 loss scale the precision plugin multiplies the loss by (1.0 without a scaler)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0


class LanguageModelModule(L.LightningModule):
    def __init__(self, cfg: RootConfig, dataset: TokenDataset):
        super().__init__()
        self.cfg = cfg
        self.dataset = dataset
        self.model = Decoder(cfg.decoder_config())
        self.balancer = BALANCERS.build(cfg.balancer)
        self.balancer.attach(self.model)
        self._set_hidden()
        self._val_sums: dict[str, torch.Tensor] = {}
        self.last_val_metrics: dict[str, float] = {}
        self._step_loss_finite: Optional[torch.Tensor] = None  # all micro-batch losses of this step finite
        self.skipped_in_a_row = 0
        self.skipped_steps = 0

    def configure_model(self) -> None:
        """FSDP2 (``trainer.strategy=fsdp2``): shard each decoder layer, then the rest, over the
        data-parallel ranks, the experts over ``trainer.expert_parallel`` ranks first
        (runtime/strategies.py::shard_fsdp2). Other strategies need nothing here.
        ``trainer.activation_checkpointing`` is set first: each layer recomputes inside its own forward, so
        FSDP2's hooks wrap it."""
        if self.cfg.trainer.activation_checkpointing:
            self.model.set_activation_checkpointing(True)
        if self.cfg.trainer.strategy != "fsdp2" or getattr(self, "_sharded", False):
            return
        t = self.cfg.trainer
        mesh = self.device_mesh["data_parallel"]
        shard_fsdp2(self.model, mesh, mixed_precision_policy(t.precision), t.expert_parallel)
        self._set_hidden()  # the sharded model's hook-wrapped method
        self._sharded = True

    def _set_hidden(self) -> None:
        """``self._hidden``: the model's hidden-state function, compiled when the trainer says so. A view
        of the same module (shares parameters; state dicts keep the plain names), not registered, so
        checkpoints hold no second copy."""
        mode = compile_mode(self.cfg.trainer, self.model)  # off, model (one graph) or layers (per layer)
        object.__setattr__(self, "_hidden", compiled_hidden(self.model, mode))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def _segments(self, x: torch.Tensor) -> Optional[Segments]:
        """With ``data.document_masking``: the batch's documents (the end-of-document token begins the next)."""
        return document_segments(x, self.dataset.eod_id, self.dataset.document_masking)

    def _hidden_states(self, x: torch.Tensor, segments: Optional[Segments] = None) -> torch.Tensor:
        """Final hidden states ``[B, T, d]``; with document ``segments`` each token sees only its own document."""
        return self._hidden(x) if segments is None else self._hidden(x, segments=segments)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        segments = self._segments(x)
        h = self._hidden_states(x, segments)  # [B, T, d]
        loss_sum, tokens = scored_loss_sum(self.model.lm_head, h, y)
        loss_for_grad, loss = global_token_mean(loss_sum, tokens)  # the whole data-parallel micro-batch
        finite = torch.isfinite(loss)
        self._step_loss_finite = finite if self._step_loss_finite is None else self._step_loss_finite & finite
        total = loss_for_grad
        if len(self.model.mtp):
            total = total + self._mtp_loss(h, x, y, segments)
        aux = self.balancer.aux_loss(self.model)
        if aux is not None:
            total = total + aux
            self.log("train/aux_loss", aux.detach(), on_step=True, on_epoch=False)
        self.log("train/loss", loss.detach(), on_step=True, on_epoch=False, prog_bar=True)
        return total

    def _mtp_loss(
        self, h: torch.Tensor, x: torch.Tensor, y: torch.Tensor, segments: Optional[Segments]
    ) -> torch.Tensor:
        """``model.mtp_weight`` x the mean over MTP depths of their token-mean cross-entropies (each
        normalised over the data-parallel micro-batch like the main loss); logs each depth's loss."""
        terms, losses = [], []
        for k, (loss_sum, tokens) in enumerate(self.model.mtp_losses(h, x, y, segments), start=1):
            for_grad, loss = global_token_mean(loss_sum, tokens)
            terms.append(for_grad)
            losses.append(loss.detach())
            self.log(f"train/mtp_loss_{k}", loss.detach(), on_step=True, on_epoch=False)
        if not terms:  # windows shorter than the MTP depth
            return h.new_zeros(())
        self.log("train/mtp_loss", torch.stack(losses).mean(), on_step=True, on_epoch=False)
        return self.cfg.model.mtp_weight * torch.stack(terms).mean()

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """One optimizer step, in this order. Lightning calls it once per step, after the step's earlier
        micro-batches have run ``training_step`` and their backward (gradients accumulate):

        1. ``optimizer_closure``: ``training_step`` and the backward of the step's last micro-batch;
        2. the gradient norm over every parameter, sharded ones on any mesh included (runtime/grad_norm.py);
        3. the non-finite guard: stop naming the step, or skip the update (``trainer.on_nonfinite``);
        4. clipping to ``trainer.gradient_clip_val`` with the norm of 2;
        5. the optimizer's update (Lightning's precision plugin around it: autocast, a loss scaler);
        6. the balancer's once-per-step bias update from the step's router statistics, before any callback
           (a checkpoint of this step must hold the bias the next step routes with).

        Steps 2-4 run inside the closure, so they see the gradients exactly as the update will; the
        learning-rate schedule steps after this method, as Lightning does for every step.
        """
        skipped_before = self.skipped_steps

        def backward_then_prepare_update() -> Any:
            loss = optimizer_closure()  # 1
            self._prepare_update(optimizer)  # 2-4
            return loss

        optimizer.step(closure=backward_then_prepare_update)  # 5
        self._update_balancer(skipped=self.skipped_steps > skipped_before)  # 6

    def _prepare_update(self, optimizer: torch.optim.Optimizer) -> None:
        """Steps 2-4 of ``optimizer_step``: the gradient norm, the non-finite guard, clipping; logged."""
        params = [p for p in self.parameters() if p.grad is not None]
        grad_norm = total_grad_norm(params)
        scale = _loss_scale(self.trainer)
        if grad_norm is not None and scale != 1.0:  # fp16 loss scaling: the gradients are still scaled
            grad_norm = grad_norm / scale  # a power of two: exact
        self._guard_nonfinite(grad_norm)
        clip = self.cfg.trainer.gradient_clip_val
        if clip and grad_norm is not None:  # a skipped step has no gradients left to clip
            clip_grads_with_norm_(params, clip, grad_norm)
        if grad_norm is not None:
            self.log("train/grad_norm", grad_norm, on_step=True, on_epoch=False)
        self.log("train/lr", optimizer.param_groups[0]["lr"], on_step=True, on_epoch=False)

    def _guard_nonfinite(self, grad_norm: Optional[torch.Tensor]) -> None:
        """Stop (or skip the update) when this step's loss or gradients are NaN/inf. Losses and
        gradients are already reduced over ranks, so every rank takes the same decision."""
        loss_ok = self._step_loss_finite
        self._step_loss_finite = None
        # with fp16 loss scaling, inf gradients are routine: the scaler skips those steps itself
        check_grads = grad_norm is not None and self.cfg.trainer.precision != "16-mixed"
        ok = torch.ones((), dtype=torch.bool, device=self.device) if loss_ok is None else loss_ok
        if check_grads:
            ok = ok & torch.isfinite(grad_norm)
        if bool(ok):  # one host sync per optimizer step
            self.skipped_in_a_row = 0
            return
        what = "loss" if loss_ok is not None and not bool(loss_ok) else "gradient norm"
        step = self.global_step + 1  # 1-based number of the optimizer step being taken
        t = self.cfg.trainer
        if t.on_nonfinite == "skip" and self.skipped_in_a_row < t.max_skipped_steps:
            self.skipped_in_a_row += 1
            self.skipped_steps += 1
            for p in self.parameters():
                p.grad = None  # the optimizers leave parameters without gradients untouched
            self.log("train/skipped_steps", float(self.skipped_steps), on_step=True, on_epoch=False)
            return
        hint = (
            f" ({self.skipped_in_a_row} steps skipped in a row, trainer.max_skipped_steps={t.max_skipped_steps})"
            if t.on_nonfinite == "skip"
            else ""
        )
        raise NonFiniteTrainingError(
            f"non-finite {what} at optimizer step {step}{hint}: training stopped before the update; "
            f"the last checkpoint (at or before step {self.global_step}) is intact. Lower optimizer.lr, "
            f"raise optimizer.warmup_steps, or set trainer.on_nonfinite=skip"
        )

    def _update_balancer(self, skipped: bool) -> None:
        """Step 6 of ``optimizer_step``: the balancer's bias update from this step's router statistics (a
        skipped, non-finite step drops its statistics and keeps the bias)."""
        if skipped:
            for router in find_routers(self.model):
                router.reset_stats()
            return
        metrics = self.balancer.step(self.model)
        if world_size() > 1:
            routers = find_routers(self.model)
            if routers:
                # identical biases on every rank is an invariant of the balancers; report any drift
                metrics["bias_rank_divergence"] = bias_rank_divergence(routers)
        for k, v in metrics.items():
            self.log(f"balance/{k}", v, on_step=True, on_epoch=False)

    # -- checkpoints ----------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["rng_states"] = rng_state.gather_all_ranks()  # collective: runs on every rank
        checkpoint["run_config"] = to_container(self.cfg)  # a checkpoint alone rebuilds its model (runtime/load_run.py)
        checkpoint["nonfinite_skipped_steps"] = [self.skipped_steps, self.skipped_in_a_row]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get("rng_states")
        if states and not rng_state.restore_for_rank(states, self.global_rank):
            rank_zero_warn(
                f"checkpoint holds RNG states of {len(states)} ranks, this run has {world_size()}: generators start "
                "from the seed"
            )
        self.skipped_steps, self.skipped_in_a_row = checkpoint.get("nonfinite_skipped_steps", [0, 0])

    # -- validation -----------------------------------------------------------------------------
    def on_validation_epoch_start(self) -> None:
        self._val_sums = {}

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        segments = self._segments(x)
        if batch_idx == 0:
            # the largest GLU intermediate and FFN output on the first validation batch: the stability
            # metric of SiTU-GLU's softcaps (an eager pass of one batch; the ladder's max_activation)
            self._activations = largest_activations(self.model, x, segments)
        logits = self.model.lm_head(self._hidden_states(x, segments))
        token_loss = token_losses(logits, y)  # [B, T]
        for k, v in self.dataset.metric_sums(logits, y, token_loss, batch_idx).items():
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
        record = {f"act/{k}": v for k, v in getattr(self, "_activations", {}).items()}
        record.update({f"val/{k}": v for k, v in self.last_val_metrics.items()})
        for key, v in record.items():  # progress bar and callback metrics; the loggers get the record below
            shown = key in ("val/loss", f"val/{self.dataset.metrics.primary}")
            self.log(key, v, on_step=False, on_epoch=True, prog_bar=shown, sync_dist=False, logger=False)
        log_validation(self.trainer, record)  # at the step the weights are at, with the compute axis

    # -- optimisation ---------------------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        optimizer = OPTIMIZERS.build(self.cfg.optimizer, self.model, key="optimizer")
        schedule = SCHEDULES.build(self.cfg.schedule, key="schedule")
        warmup, total = self.cfg.optimizer.warmup_steps, self.cfg.trainer.max_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule.multiplier(step, warmup, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
