"""A whole run's configuration as typed schema: the model's parts, data, optimizer, trainer, logger.

Hydra composes ``conf/config.yaml`` against ``RootConfig`` (stored in its ConfigStore), which already
refuses unknown keys and wrong types at composition. What only the whole config can tell is checked by
``runtime/validation.py``; ``runtime/checkpoints/branching.py`` resolves ``init_from`` / ``init_step`` and
``runtime/token_budget.py`` turns a token budget into steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from components.config import DecoderConfig, ModelConfig
from components.optim.schedules.base import SCHEDULES
from components.registry import FAMILIES, discover_all


@dataclass
class TrainerConfig:
    accelerator: str = "cpu"
    # processes per node: an int, or "auto" (every visible GPU; 1 on CPU)
    devices: Any = 1
    num_nodes: int = 1
    # auto: one process; ddp: data parallel, gradients all-reduced; fsdp2: parameters, gradients and
    # optimizer state sharded over the data-parallel ranks (torch fully_shard per decoder layer,
    # sharded checkpoints). Both keep one global batch = data.batch_size rows split over the ranks.
    strategy: str = "auto"
    # expert parallelism (fsdp2 only): each routed layer's experts split over groups of this many ranks; 1: off
    expert_parallel: int = 1
    # what a non-finite loss or gradient norm does: "stop" ends the run naming the step (the last
    # checkpoint stays the last good one); "skip" leaves weights, optimizer state and router biases
    # untouched for that step and goes on (at most max_skipped_steps in a row, then stops). A skipped
    # step still counts: it advances the step counter, the learning-rate schedule and the data.
    on_nonfinite: str = "stop"
    max_skipped_steps: int = 10
    # a Lightning precision, or auto: bf16-mixed on GPUs and on CPUs with native bf16 products (AMX,
    # AVX-512 BF16), 32-true on other CPUs (runtime/precision.py); resolved when the config is validated
    precision: str = "32-true"
    # how long to train: max_steps optimizer steps, or (max_steps=null) a budget of max_tokens training
    # tokens, turned into steps of data.batch_size x data.seq_len x accumulate_grad_batches tokens
    # (rounded up). A set max_steps wins over max_tokens (the run says so when it starts). Either way
    # the learning-rate schedule spans exactly those steps, so the result does not depend on speed.
    max_steps: Optional[int] = 1000
    max_tokens: Optional[int] = None
    # a guard, not a budget: stop after this many minutes of wall time (None: no guard at all). With
    # min_tokens_per_s set the guard grows with the budget: the larger of max_time_minutes and the
    # planned tokens at that rate, so a longer run or a busy machine is not cut at a fixed time. A run
    # the guard stops ends before its schedule does, and its summary says so plainly.
    max_time_minutes: Optional[float] = None
    min_tokens_per_s: Optional[float] = None
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = 1.0
    val_check_interval: int = 250
    limit_val_batches: Optional[int] = None
    log_every_n_steps: int = 10
    checkpoint_every_n_steps: int = 250
    # keep only the newest N periodic checkpoints (step=*.ckpt; last.ckpt is always kept); None: keep all
    keep_last_checkpoints: Optional[int] = None
    enable_progress_bar: bool = True
    deterministic: bool = False
    # torch.compile the model: "true", "false", or "auto" (compile when a C++ compiler is on PATH,
    # which TorchInductor's CPU backend needs, or on CUDA, unless a component declares
    # compile_friendly = False: KDA, MoE routers); costs some seconds up front
    compile: str = "false"
    # refuse to start when weights + gradients + optimizer state cannot fit (runtime/memory_check.py)
    memory_check: bool = True
    # Lightning profiler, writing into <run folder>/profiler/ (runtime/profiling.py): null (off); simple
    # (time per training hook); advanced (cProfile per hook); pytorch (torch.profiler: operator table and
    # a Chrome / TensorBoard trace of 3 training steps after 1 wait + 1 warmup step, shapes not recorded)
    profiler: Optional[str] = None
    # recompute each decoder layer's forward in backward instead of keeping its activations (less memory,
    # about one more forward of compute; same loss, gradients and router statistics). Set on the model
    # before FSDP2 shards it; parameter and checkpoint names are unchanged.
    activation_checkpointing: bool = False
    # CPU threads of a one-process CPU run: "auto" times a few steps at each thread count now and then
    # and keeps the fastest, so a run beside other busy processes takes the cores it can use and leaves
    # the rest (runtime/cpu_thread_tuning.py; results do not depend on it); "fixed" keeps the count the
    # process started with (OMP_NUM_THREADS, else one per core). Ignored on GPUs and with several ranks.
    # Measured side by side with the start-up wait policy (benchmarks/busy_machine.py): auto keeps 1.02 of
    # fixed's speed alone and 0.83-0.97 of the fair share beside busy processes, against fixed's 0.21-0.54
    cpu_threads: str = "auto"


@dataclass
class LoggerConfig:
    # wandb: W&B (online when credentials are configured, offline otherwise) plus a local metrics.jsonl
    # csv: only the local metrics.jsonl
    name: str = "wandb"
    project: str = "k3-sandbox"
    entity: Optional[str] = None
    # auto: online if W&B credentials are configured, else offline; or force online/offline/disabled
    mode: str = "auto"
    group: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    # seconds to wait for the W&B server when starting an online run before recording offline instead
    init_timeout_s: float = 90.0
    # W&B's job type: None for train (or sweep-point inside a multirun); the ladder's runs set ladder-rung
    job_type: Optional[str] = None


@dataclass
class RootConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    # registry-selected components (typed by the member's own schema when composed)
    mixer: Any = MISSING
    ffn: Any = MISSING
    mixers: dict[str, Any] = field(default_factory=dict)
    ffns: dict[str, Any] = field(default_factory=dict)
    residual: Any = MISSING
    balancer: Any = MISSING
    data: Any = MISSING
    optimizer: Any = MISSING
    schedule: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    # extra Lightning callbacks by name, each a node with a ``_target_`` class path and its arguments,
    # e.g. ``+callbacks.kill='{_target_: runtime.callbacks.fault_injection.FaultInjection, kill_after: 5}'``;
    # they observe or interrupt a run and are not part of its identity (the run folder ignores them)
    callbacks: dict[str, Any] = field(default_factory=dict)
    seed: int = 1337
    # run name (also the run folder's name); None: derived from the chosen components
    name: Optional[str] = None
    # None: fresh run; "last": resume the newest run folder of the same command; or a .ckpt path
    ckpt_path: Optional[str] = None
    # where run folders go (relative paths are relative to the working directory)
    output_root: str = "outputs"
    # branch from another run: its run folder (with init_step, the step of the checkpoint to start from)
    # or a .ckpt file. The run starts from that checkpoint's weights, optimizer state, step and data
    # position, under its own config (e.g. a WSD cooldown of another length) in its own folder;
    # ckpt_path=last then resumes the branch itself
    init_from: Optional[str] = None
    init_step: Optional[int] = None

    def decoder_config(self) -> DecoderConfig:
        """The model part of this run, checked (``components.model.Decoder(root.decoder_config())``). Built
        once and kept while the model's fields stay as they were (validation, the run folder's name, the
        memory check, the loggers and the training module all ask for it)."""
        fields = repr((self.model, self.mixer, self.mixers, self.ffn, self.ffns, self.residual))
        kept = self.__dict__.get("_decoder_config")
        if kept is None or kept[0] != fields:
            built = DecoderConfig.build(
                self.model, {"mixer": self.mixer, **self.mixers}, {"ffn": self.ffn, **self.ffns}, self.residual
            )
            kept = self.__dict__["_decoder_config"] = (fields, built)
        return kept[1]


# the root keys whose nodes select a registry member (the group's name): the component families and the
# learning-rate schedule
REGISTRIES = {**FAMILIES, SCHEDULES.group: SCHEDULES}
COMPONENT_KEYS = tuple(REGISTRIES)


def register_root_schemas() -> None:
    cs = ConfigStore.instance()
    cs.store(name="root_schema", node=RootConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="trainer", name="trainer_schema", node=TrainerConfig)
    cs.store(group="logger", name="logger_schema", node=LoggerConfig)


def register_all() -> None:
    """Import every registered component and store all config schemas in Hydra's ConfigStore."""
    register_root_schemas()
    discover_all()
    for registry in REGISTRIES.values():  # the families, and the schedules beside them
        registry.discover()


def data_parallel_ranks(t: TrainerConfig) -> Optional[int]:
    """Ranks the global batch is split over, when the config fixes it (None for devices=auto)."""
    if t.strategy == "auto":
        return 1
    per_node = len(t.devices) if isinstance(t.devices, list) else t.devices if isinstance(t.devices, int) else None
    return None if per_node is None else per_node * t.num_nodes


def component_configs(root: RootConfig) -> list[tuple[str, Any]]:
    """(full key, config) of every registry-selected component in the config."""
    items: list[tuple[str, Any]] = [(key, getattr(root, key)) for key in COMPONENT_KEYS]
    items += [(f"mixers.{k}", v) for k, v in root.mixers.items()]
    items += [(f"ffns.{k}", v) for k, v in root.ffns.items()]
    return items


def to_container(root: RootConfig) -> dict:
    """Plain-dict view of a typed config (for logging and checkpoints)."""
    return dataclasses.asdict(root)
