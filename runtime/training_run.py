"""One training run: validated config -> data, model, trainer -> fit -> summary.

Called by ``train.py`` inside Hydra's job (the run folder already exists and is this job's working
output folder). Everything the run writes goes under that folder:

    checkpoints/last.ckpt, checkpoints/step=N.ckpt   resumable state (atomic writes)
    metrics.jsonl                                    every logged metric
    wandb/                                           the W&B run (offline unless credentials exist)
    run.json                                         W&B run id and status, for resuming the same run
    summary.json                                     final metrics and baselines
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import lightning as L
import torch
import wandb
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint

from components.flop_count import compute_record
from components.hf.weights_folder import import_weights
from components.layer_plan import describe_plan
from components.registry import DATASETS
from runtime.callbacks.depth_weight_recorder import DepthWeights
from runtime.callbacks.progress import StepProgressBar
from runtime.callbacks.thread_tuner import CpuThreadTuner
from runtime.callbacks.throughput import Throughput
from runtime.callbacks.time_guard import TimeGuard
from runtime.checkpoints import layout
from runtime.checkpoints.branching import branch_checkpoint
from runtime.checkpoints.write import AtomicCheckpointIO
from runtime.config import RootConfig, to_container
from runtime.cpu_allocator import keep_freed_memory
from runtime.cpu_wait_policy import describe_wait_policy
from runtime.datamodule import TokenDataModule
from runtime.lit_module import LanguageModelModule
from runtime.loggers import build_loggers
from runtime.precision import describe_precision
from runtime.profiling import build_profiler
from runtime.run_folder import default_run_name
from runtime.strategies import build_strategy
from runtime.token_budget import describe_length, time_guard_minutes, training_steps


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def extra_callbacks(root: RootConfig) -> list:
    """The callbacks ``root.callbacks`` names (``_target_`` class paths), in key order."""
    out = []
    for name in sorted(root.callbacks):
        callback = instantiate(root.callbacks[name])
        if not isinstance(callback, L.Callback):
            raise TypeError(f"callbacks.{name}: {type(callback).__name__} is not a Lightning Callback")
        out.append(callback)
    return out


def build_trainer(root: RootConfig, run_dir: str, callbacks: list, loggers: list) -> Any:
    t = root.trainer
    strategy = build_strategy(t)
    # sharded checkpoints are written by torch.distributed.checkpoint (atomic in the strategy itself)
    plugins = [] if t.strategy == "fsdp2" else [AtomicCheckpointIO()]
    checkpoint = ModelCheckpoint(
        dirpath=layout.folder_of(run_dir),
        filename=layout.PERIODIC_NAME,
        auto_insert_metric_name=False,
        every_n_train_steps=t.checkpoint_every_n_steps,
        save_last=True,
        # the newest N by step (Lightning offers "step" as a monitor), or every one
        save_top_k=-1 if t.keep_last_checkpoints is None else t.keep_last_checkpoints,
        monitor=None if t.keep_last_checkpoints is None else "step",
        mode="max",
        save_on_train_epoch_end=False,
    )
    guard = time_guard_minutes(root)
    if guard:
        callbacks = [*callbacks, TimeGuard(guard)]
    return L.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=strategy,
        precision=t.precision,
        max_steps=t.max_steps,
        max_epochs=-1,
        accumulate_grad_batches=t.accumulate_grad_batches,
        gradient_clip_val=None,  # the training module clips, with the norm it logs (lit_module.optimizer_step)
        val_check_interval=t.val_check_interval * t.accumulate_grad_batches,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=t.log_every_n_steps,
        enable_progress_bar=t.enable_progress_bar,
        enable_model_summary=False,
        deterministic=t.deterministic,
        callbacks=[checkpoint, *callbacks],
        logger=loggers,
        plugins=plugins,
        default_root_dir=run_dir,
        use_distributed_sampler=False,
        profiler=build_profiler(t, run_dir),  # trainer.profiler: report / trace under <run_dir>/profiler
    )


def train(root: RootConfig, run_dir: str, extra_config: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Train one configuration in ``run_dir``; returns the summary (also written to summary.json).

    ``extra_config``: more fields for the W&B run's config (a sweep job's point and varied options).
    """
    os.makedirs(run_dir, exist_ok=True)
    _keep_console_to_progress_and_summary()
    return _train(root, run_dir, extra_config)


def _keep_console_to_progress_and_summary() -> None:
    """Lightning's notices that say nothing about this run stay off the console."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*LeafSpec.*is deprecated.*")
    warnings.filterwarnings("ignore", message=".*IterableDataset.*has `__len__` defined.*")
    # validation metrics are summed over ranks before logging (lit_module.on_validation_epoch_end)
    warnings.filterwarnings("ignore", message=".*when logging on epoch level in distributed setting.*")
    warnings.filterwarnings("ignore", message=".*Checkpoint directory .* exists and is not empty.*")  # resuming


@dataclass
class BuiltRun:
    """Everything one run is made of, built and ready to fit (``build``)."""

    root: RootConfig
    run_dir: str
    module: LanguageModelModule
    data: TokenDataModule
    trainer: L.Trainer
    throughput: Throughput
    thread_tuner: CpuThreadTuner
    wandb_logger: Any  # the W&B logger, or None with logger=csv
    run_info: dict[str, Any]  # run.json: the W&B run id and the run's status
    run_name: str
    ckpt: Optional[str]  # the checkpoint the run resumes or branches from


def _train(root: RootConfig, run_dir: str, extra_config: Optional[dict[str, Any]]) -> dict[str, Any]:
    run = build(root, run_dir, extra_config)
    started = time.perf_counter()
    status = "failed"
    try:
        fit(run)
        status = "finished"
        summary = summary_record(run, time.perf_counter() - started)
        if run.wandb_logger is not None and run.trainer.is_global_zero:
            run.wandb_logger.finish_summary(summary)  # the whole record: what analysis.compare reads from W&B
    finally:
        close(run, status)
    if run.trainer.is_global_zero:
        _write_json(os.path.join(run_dir, "summary.json"), summary)
        print(format_summary(summary))
    return summary


def build(root: RootConfig, run_dir: str, extra_config: Optional[dict[str, Any]] = None) -> BuiltRun:
    """Seed, resolve where the run starts (a fresh start, a resume, a branch), build the data, the training
    module, the loggers and the trainer; print what the run is and mark it running in run.json."""
    L.seed_everything(root.seed, workers=True, verbose=False)
    if root.trainer.accelerator == "cpu":
        keep_freed_memory()  # reuse step buffers instead of page-faulting them in again every step
    length = describe_length(root)
    root.trainer.max_steps = training_steps(root)  # a token budget becomes steps; the schedule spans them
    ckpt = layout.resume_point(root.ckpt_path, run_dir)
    branched = ckpt is None and root.init_from is not None
    init_weights = None
    if branched:
        ckpt = branch_checkpoint(root)  # a new run from another run's checkpoint
        init_weights = None if ckpt else root.init_from  # or from exported weights, at step 0

    dataset = DATASETS.build(root.data, root.seed)
    module = LanguageModelModule(root, dataset)
    model = module.model
    if init_weights:
        import_weights(init_weights, model)  # checked against the composed model when the config was validated
    data = TokenDataModule(dataset, root.trainer.accumulate_grad_batches, root.trainer.limit_val_batches)
    throughput = Throughput(model.flops_per_token(dataset.seq_len), dataset.batch_size * dataset.seq_len)

    run_name = root.name or default_run_name(root)
    run_info = _read_json(os.path.join(run_dir, "run.json"))
    resume_id = run_info.get("wandb_id") if ckpt is not None else None
    config_dict = {**to_container(root), **(extra_config or {})}
    loggers, wandb_logger = build_loggers(root, run_dir, run_name, config_dict, resume_id)
    # trainer.cpu_threads=auto: a one-process CPU run of a thread-invariant composition keeps the fastest count
    thread_tuner = CpuThreadTuner.for_run(root)
    callbacks = [throughput, DepthWeights(run_dir), thread_tuner, *extra_callbacks(root)]
    if root.trainer.enable_progress_bar:
        callbacks.append(StepProgressBar())
    trainer = build_trainer(root, run_dir, callbacks, loggers)

    if trainer.is_global_zero:
        print(f"run folder: {run_dir}")
        print(f"data: {dataset.describe()}")
        print(
            f"model: {model.num_params():,} parameters ({model.active_params():,} active per token), layers: "
            f"{describe_plan(model.plan)}"
        )
        print(f"training: {length}")
        print(f"precision: {describe_precision(root.trainer.precision, root.trainer.accelerator)}")
        if thread_tuner.on_cpu:
            print(
                f"cpu threads: {torch.get_num_threads()} ({root.trainer.cpu_threads}), idle threads wait: "
                f"{describe_wait_policy(os.environ)}"
            )
        if ckpt:
            print(f"{'branching from' if branched else 'resuming from'} {ckpt}")
        if init_weights:
            print(f"initial weights from {init_weights}")
    if wandb_logger is not None and trainer.is_global_zero:
        run_info["wandb_id"] = wandb_logger.experiment.id
        run_info["wandb_dir"] = wandb_logger.experiment.dir
    run_info.update(status="running", name=run_name)
    if trainer.is_global_zero:
        _write_json(os.path.join(run_dir, "run.json"), run_info)
    return BuiltRun(
        root, run_dir, module, data, trainer, throughput, thread_tuner, wandb_logger, run_info, run_name, ckpt
    )


def fit(run: BuiltRun) -> None:
    """Train to the planned step (or the time guard), then validate once more: the final metrics."""
    run.trainer.fit(run.module, datamodule=run.data, ckpt_path=run.ckpt)
    run.trainer.validate(run.module, datamodule=run.data, verbose=False)


def summary_record(run: BuiltRun, wall_seconds: float) -> dict[str, Any]:
    """The finished run's summary.json record."""
    trainer, throughput, model, root = run.trainer, run.throughput, run.module.model, run.root
    dataset = run.module.dataset
    # the run's tokens from step 0: a resumed or branched run's earlier steps (before this process) too
    trained_tokens = run.data.start_batch * throughput.tokens_per_micro_batch + throughput.total_tokens
    return {
        "name": run.run_name,
        "run_dir": run.run_dir,
        "steps": trainer.global_step,
        "planned_steps": root.trainer.max_steps,
        # budget: every planned step; time_guard: the guard ended it early; stopped: ended early otherwise
        "ended_by": ended_by(trainer, root.trainer.max_steps),
        "time_guard_minutes": time_guard_minutes(root),
        "train_tokens": trained_tokens,
        "train_seconds": round(throughput.train_seconds, 2),
        "tokens_per_s": throughput.total_tokens / max(throughput.train_seconds, 1e-9),
        "wall_seconds": round(wall_seconds, 2),
        "params": model.num_params(),
        "active_params": model.active_params(),
        "d_model": root.model.d_model,
        "n_layers": root.model.n_layers,
        "precision": root.trainer.precision,  # what trainer.precision=auto chose on this machine
        "cpu_threads": run.thread_tuner.summary(),  # the thread counts trained on, the probes, and why
        "decode_state_numbers": model.decode_state_numbers(),  # analysis.compare's state-size axis
        # parameters by kind, training tokens and FLOPs by part (components/flop_count.py): a scaling fit's x
        "compute": compute_record(model, dataset.seq_len, trained_tokens),
        "val": dict(run.module.last_val_metrics),
        "metric": dataset.metrics.record(),  # which of them is primary, and whether higher is better
        "baselines": dataset.baselines(),
    }


def close(run: BuiltRun, status: str) -> None:
    """Record how the run ended in run.json and close its W&B run, whether it finished or failed."""
    if run.trainer.is_global_zero:
        run.run_info["status"] = status
        try:
            _write_json(os.path.join(run.run_dir, "run.json"), run.run_info)
        except OSError as err:  # a full disk: the failure that stopped the run is the one to report
            print(f"warning: run.json not updated ({err.strerror or err})")
    if run.wandb_logger is not None:
        try:
            wandb.finish(exit_code=0 if status == "finished" else 1)
        except Exception as err:  # a W&B failure never turns a finished run into a failed one
            print(f"warning: W&B could not finish the run cleanly ({type(err).__name__}: {err})")


def ended_by(trainer: Any, planned_steps: Optional[int]) -> str:
    """Why training ended: ``budget`` (every planned step), ``time_guard`` (the guard of
    ``trainer.max_time_minutes`` / ``min_tokens_per_s`` ran out first) or ``stopped`` (ended early
    otherwise)."""
    if planned_steps is None or trainer.global_step >= planned_steps:
        return "budget"
    if any(isinstance(c, TimeGuard) and c.ran_out for c in trainer.callbacks):
        return "time_guard"
    return "stopped"


def steps_note(s: dict[str, Any]) -> str:
    """Flags a run that stopped before its planned steps (the time guard, or an interruption)."""
    planned = s.get("planned_steps")
    if planned is None or s["steps"] >= planned:
        return ""
    if s.get("ended_by", "time_guard") == "time_guard":
        return f" of {planned} planned (stopped early by the time guard: not the planned run's result)"
    return f" of {planned} planned (stopped early: not the planned run's result)"


def early_stop_warning(s: dict[str, Any]) -> Optional[str]:
    """One plain line for a run that did not train its budget, so its figure is not mistaken for the
    budgeted result."""
    planned = s.get("planned_steps")
    if planned is None or s["steps"] >= planned:
        return None
    share = f"{100 * s['steps'] / planned:.0f}% of its {planned:,} planned steps"
    if s.get("ended_by", "time_guard") == "time_guard":
        guard = s.get("time_guard_minutes")
        after = f"after {guard:.0f} min" if guard else "early"
        return (
            f"NOT THE BUDGETED RESULT: the time guard ended training {after}, at {share} "
            f"({s['tokens_per_s']:,.0f} tokens/s: a busy or slow machine?). Finish it with the same command "
            "and ckpt_path=last, or raise trainer.max_time_minutes / lower trainer.min_tokens_per_s."
        )
    return f"NOT THE BUDGETED RESULT: training ended early, at {share}; finish it with ckpt_path=last."


def format_summary(s: dict[str, Any]) -> str:
    val = s["val"]
    metric = s["metric"]["primary"]
    precision_note = f", precision {s['precision']}" if s.get("precision") else ""  # summaries from before it
    lines = [
        "",
        f"== {s['name']} ==",
        f"steps {s['steps']}{steps_note(s)}, {s['train_tokens'] / 1e6:.2f}M tokens in {s['train_seconds'] / 60:.1f} "
        f"min of training ({s['tokens_per_s']:,.0f} tokens/s{precision_note})",
        f"validation loss {val.get('loss', float('nan')):.4f}"
        + (f", {metric} {val[metric]:.4f}" if metric in val and metric != "loss" else ""),
    ]
    warning = early_stop_warning(s)
    if warning:
        lines.append(warning)
    if s["baselines"]:
        base = ", ".join(f"{k} {v:.4f}" for k, v in s["baselines"].items())
        lines.append(f"baselines on the same validation bytes (bits per byte): {base}")
        if metric == "bpb" and "bpb" in val:
            beaten = [k for k, v in s["baselines"].items() if val["bpb"] < v]
            lines.append(f"model {val['bpb']:.4f} bpb beats: {', '.join(beaten) if beaten else 'none'}")
    lines.append(f"run folder: {s['run_dir']}")
    return "\n".join(lines)
