"""Tokens per second and model FLOPs utilisation (MFU) over each logging interval, and the cumulative
tokens and FLOPs every logged row is measured at."""

from __future__ import annotations

import time
from typing import Any, Optional

import lightning as L
import torch


def measure_peak_flops(device: torch.device, dtype: torch.dtype, max_size: int = 2048, budget_s: float = 0.25) -> float:
    """FLOP/s of a square matmul on ``device``: the ceiling MFU is measured against.

    The size doubles from 256 until one product takes a few milliseconds, then products repeat for about
    ``budget_s``: a CPU without native bf16 runs bf16 matmuls at ~1 GFLOP/s, where one fixed 2048^3
    product would take minutes before the first training step.
    """

    def timed(a: torch.Tensor, b: torch.Tensor, repeats: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    size = 256
    while True:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        timed(a, b, 1)  # warm-up: kernel selection, allocation
        once = timed(a, b, 1)
        if once >= budget_s / 20 or size >= max_size:
            break
        size *= 2
    repeats = max(1, min(20, int(budget_s / max(once, 1e-9))))
    return 2 * size**3 * repeats / timed(a, b, repeats)


# dense bf16 tensor-core peaks of common accelerators (FLOP/s)
KNOWN_PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12, "4090": 165e12}


def peak_flops(device: torch.device, precision: str) -> tuple[float, str]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in KNOWN_PEAKS.items():
            if key in name:
                return value, f"{name} datasheet"
    dtype = torch.bfloat16 if "bf16" in precision else torch.float32
    return measure_peak_flops(device, dtype), f"measured {str(dtype).replace('torch.', '')} matmul"


class Throughput(L.Callback):
    """Throughput and the compute axis of the logged history (all ranks' tokens together).

    * ``perf/tokens_per_s``: the tokens of the steps since the last logged one over their training time
      (validation excluded): the rate over the logging interval, not one step's; ``perf/mfu`` likewise.
    * ``perf/tokens`` and ``perf/flops``: tokens and training FLOPs (``flops_per_token`` each) the model
      had trained on when the row's metrics were measured, counted from step 0 (a resumed run's earlier
      steps included): ``step x tokens per optimizer step`` in a training row (its loss is measured
      before that step's update) and in a validation row alike, so loss against tokens or FLOPs lines up.

    ``total_tokens`` / ``train_seconds``: this process's training tokens and time, start-up and compilation
    included (the summary's ``tokens_per_s``).
    """

    def __init__(self, flops_per_token: float, tokens_per_micro_batch: int, peak: Optional[float] = None):
        self.flops_per_token = flops_per_token
        self.tokens_per_micro_batch = tokens_per_micro_batch
        self.peak = peak
        self.peak_source = ""
        self._last: Optional[float] = None
        self._paused_at: Optional[float] = None
        self._step_tokens = 0  # this optimizer step's micro-batches so far
        self._interval_tokens = 0  # the steps since the last logged one
        self._interval_seconds = 0.0
        self.total_tokens = 0
        self.train_seconds = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.peak is None:
            self.peak, self.peak_source = peak_flops(pl_module.device, str(trainer.precision))
        self._last = time.perf_counter()

    def tokens_per_step(self, trainer: L.Trainer) -> int:
        return self.tokens_per_micro_batch * trainer.accumulate_grad_batches

    def compute_axis(self, trainer: L.Trainer, step: int) -> dict[str, float]:
        """``perf/tokens`` and ``perf/flops`` after ``step`` optimizer steps (a validation record's too:
        runtime/loggers.py::log_validation)."""
        tokens = float(step * self.tokens_per_step(trainer))
        return {"perf/tokens": tokens, "perf/flops": tokens * self.flops_per_token}

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._step_tokens += self.tokens_per_micro_batch
        if trainer.fit_loop._should_accumulate():
            return
        now = time.perf_counter()
        elapsed = now - self._last if self._last is not None else 0.0
        self._last = now
        self.total_tokens += self._step_tokens
        self.train_seconds += elapsed
        self._interval_tokens += self._step_tokens
        self._interval_seconds += elapsed
        self._step_tokens = 0
        if self._interval_seconds > 0:
            tps = self._interval_tokens / self._interval_seconds
            pl_module.log("perf/tokens_per_s", tps, on_step=True, on_epoch=False, prog_bar=True)
            if self.peak:
                mfu = tps * self.flops_per_token / (self.peak * trainer.world_size)
                pl_module.log("perf/mfu", mfu, on_step=True, on_epoch=False)
        # the row this step's metrics go to: the steps taken before this one's update
        for key, value in self.compute_axis(trainer, trainer.global_step - 1).items():
            pl_module.log(key, value, on_step=True, on_epoch=False)
        if trainer._logger_connector.should_update_logs:  # Lightning writes this step's row: a new interval
            self._interval_tokens, self._interval_seconds = 0, 0.0

    # validation time is not training time
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._paused_at = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._last is not None and self._paused_at is not None:
            self._last += time.perf_counter() - self._paused_at
        self._paused_at = None
