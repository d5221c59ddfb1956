"""A whole run's configuration: the model's parts, data, optimizer, trainer, logger; strict validation.

Hydra composes ``conf/config.yaml`` against ``RootConfig`` (stored in its ConfigStore), which already
refuses unknown keys and wrong types at composition. ``validate`` then converts the result to typed
objects and checks what only the whole config can tell: registered component names, layer-plan slots,
shapes that do not fit together (the model side's own checks, ``components/config.py``), and what the
hardware allows (kernel back-ends, data-parallel batch splits). Every failure is a ``ConfigError``
naming the full dotted key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from components.config import DecoderConfig, ModelConfig
from components.hf.checkpoint import is_checkpoint_folder
from components.ops.backend import interpreting
from components.registry import FAMILIES, ConfigError, closest


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
    # what a non-finite loss or gradient norm does: "stop" ends the run naming the step (the last
    # checkpoint stays the last good one); "skip" leaves weights, optimizer state and router biases
    # untouched for that step and goes on (at most max_skipped_steps in a row, then stops). A skipped
    # step still counts: it advances the step counter, the learning-rate schedule and the data.
    on_nonfinite: str = "stop"
    max_skipped_steps: int = 10
    precision: str = "32-true"
    # how long to train: max_steps optimizer steps, or (max_steps=null) a budget of max_tokens training
    # tokens, turned into steps of data.batch_size x data.seq_len x accumulate_grad_batches tokens
    # (rounded up). A set max_steps wins over max_tokens (the run says so when it starts). Either way
    # the learning-rate schedule spans exactly those steps, so the result does not depend on speed.
    max_steps: Optional[int] = 1000
    max_tokens: Optional[int] = None
    # a guard, not a budget: stop after this many minutes of wall time (None: no limit). A run the
    # guard stops ends before its schedule does, and its summary says so.
    max_time_minutes: Optional[float] = None
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
        """The model part of this run, checked (``components.model.Decoder(root.decoder_config())``)."""
        return DecoderConfig.build(
            self.model, {"mixer": self.mixer, **self.mixers}, {"ffn": self.ffn, **self.ffns}, self.residual
        )


ALLOWED = {
    "trainer.accelerator": ("cpu", "gpu", "cuda", "auto"),
    "trainer.precision": ("32-true", "32", "bf16-mixed", "bf16-true", "16-mixed", "64-true"),
    "logger.name": ("wandb", "csv"),
    "trainer.compile": ("auto", "true", "false", "True", "False"),
    "trainer.strategy": ("auto", "ddp", "fsdp2"),
    "trainer.on_nonfinite": ("stop", "skip"),
    "logger.mode": ("auto", "online", "offline", "disabled"),
}
PROFILERS = ("simple", "advanced", "pytorch")  # trainer.profiler, besides null

# the config groups whose nodes select a registry member, with the root keys that hold them
COMPONENT_KEYS = (
    ("mixer", "mixer"),
    ("ffn", "ffn"),
    ("residual", "residual"),
    ("balancer", "balancer"),
    ("data", "data"),
    ("optimizer", "optimizer"),
)


def register_root_schemas() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="root_schema", node=RootConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="trainer", name="trainer_schema", node=TrainerConfig)
    cs.store(group="logger", name="logger_schema", node=LoggerConfig)


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------
def check(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(key, message)


def _check_component_node(node: Any, group: str, key: str) -> None:
    registry = FAMILIES[group]
    if not isinstance(node, DictConfig) or "name" not in node:
        raise ConfigError(
            key,
            f"no {registry.family} chosen; pick one of {', '.join(registry.names())} (e.g. {group}={registry.names()[0]})",
        )
    name = node.name
    entry = registry.get(name, key=f"{key}.name")
    node_type = OmegaConf.get_type(node)
    if node_type is not entry.config_cls:
        raise ConfigError(
            key,
            f"{registry.family} '{name}' must be composed with its schema {entry.config_cls.__name__} (conf/{group}/{name}.yaml lists `{name}_schema` in its defaults), got {getattr(node_type, '__name__', node_type)}",
        )


def check_known_keys(node: Any, key: str = "") -> None:
    """Refuse keys that the node's schema does not declare (``+mixer.n_head=4`` is added by Hydra)."""
    if not isinstance(node, DictConfig):
        return
    schema = OmegaConf.get_type(node)
    if schema is not None and dataclasses.is_dataclass(schema):
        fields = {f.name: f for f in dataclasses.fields(schema)}
        for k in node.keys():
            if k not in fields:
                where = key or "the root config"
                allowed = ", ".join(sorted(fields))
                guess = closest(str(k), list(fields))
                hint = f" Did you mean '{guess}'?" if guess else ""
                raise ConfigError(
                    f"{key}.{k}" if key else str(k),
                    f"unknown key '{k}' in {where} ({schema.__name__}); allowed keys: {allowed}.{hint}",
                )
    for k in node.keys():
        child = node._get_node(k)
        if isinstance(child, DictConfig):
            check_known_keys(child, f"{key}.{k}" if key else str(k))


def complete_data(cfg: DictConfig) -> None:
    """Let the chosen dataset fill what its files decide (a prepared folder's vocabulary) before the
    config is resolved, so ``model.vocab_size`` (``${data.vocab_size}``) follows it."""
    from components.registry import DATASETS

    node = cfg.get("data")
    entry = DATASETS.get(node.name, key="data.name")
    complete = getattr(entry.config_cls, "complete", None)
    if complete is not None:
        try:
            complete(node, "data")
        except OmegaConfBaseException as err:
            raise ConfigError(
                getattr(err, "full_key", "") or "data", str(getattr(err, "msg", err)).strip().splitlines()[0]
            ) from None


def validate(cfg: DictConfig) -> RootConfig:
    """Check a composed config and return it as typed objects. Raises ConfigError."""
    check_known_keys(cfg)
    for group, key in COMPONENT_KEYS:
        _check_component_node(cfg.get(key), group, key)
    for slot, node in (cfg.get("mixers") or {}).items():
        _check_component_node(node, "mixer", f"mixers.{slot}")
    for slot, node in (cfg.get("ffns") or {}).items():
        _check_component_node(node, "ffn", f"ffns.{slot}")
    for name, node in (cfg.get("callbacks") or {}).items():
        check(
            isinstance(node, DictConfig) and "_target_" in node,
            f"callbacks.{name}",
            "must be a node with a `_target_` class path (a Lightning callback) and its arguments",
        )

    complete_data(cfg)
    try:
        root: RootConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except OmegaConfBaseException as err:
        raise ConfigError(
            getattr(err, "full_key", "") or "", str(getattr(err, "msg", err)).strip().splitlines()[0]
        ) from None

    for key, allowed in ALLOWED.items():
        section, attr = key.split(".")
        value = getattr(getattr(root, section), attr)
        check(value in allowed, key, f"'{value}' is not allowed; choose one of {', '.join(allowed)}")

    t = root.trainer
    check(
        t.max_steps is not None or t.max_tokens is not None,
        "trainer.max_steps",
        "how long to train is unset: give trainer.max_steps (optimizer steps) or trainer.max_tokens (a token budget)",
    )
    check(
        t.max_steps is None or t.max_steps > 0,
        "trainer.max_steps",
        f"must be positive (or null, to train trainer.max_tokens tokens), got {t.max_steps}",
    )
    check(
        t.max_tokens is None or t.max_tokens > 0,
        "trainer.max_tokens",
        f"must be positive (or null), got {t.max_tokens}",
    )
    check(
        t.max_time_minutes is None or t.max_time_minutes > 0,
        "trainer.max_time_minutes",
        f"must be positive (or null: no time guard), got {t.max_time_minutes}",
    )
    check(
        t.accumulate_grad_batches >= 1,
        "trainer.accumulate_grad_batches",
        f"must be >= 1, got {t.accumulate_grad_batches}",
    )
    check(t.val_check_interval > 0, "trainer.val_check_interval", f"must be positive, got {t.val_check_interval}")
    check(
        t.checkpoint_every_n_steps > 0,
        "trainer.checkpoint_every_n_steps",
        f"must be positive, got {t.checkpoint_every_n_steps}",
    )
    check(
        t.keep_last_checkpoints is None or t.keep_last_checkpoints >= 1,
        "trainer.keep_last_checkpoints",
        f"must be at least 1 (or null: keep every checkpoint), got {t.keep_last_checkpoints}",
    )
    check(t.num_nodes >= 1, "trainer.num_nodes", f"must be >= 1, got {t.num_nodes}")
    devices_ok = (
        t.devices == "auto"
        or (isinstance(t.devices, int) and t.devices >= 1)
        or (isinstance(t.devices, list) and len(t.devices) > 0)
    )
    check(
        devices_ok,
        "trainer.devices",
        f"must be a positive number of processes per node, a list of device indices or 'auto', got {t.devices!r}",
    )
    check(t.max_skipped_steps >= 1, "trainer.max_skipped_steps", f"must be >= 1, got {t.max_skipped_steps}")
    check(
        t.profiler is None or t.profiler in PROFILERS,
        "trainer.profiler",
        f"'{t.profiler}' is not allowed; choose one of null, {', '.join(PROFILERS)}",
    )
    if t.strategy == "fsdp2":
        fsdp2_precisions = ("32-true", "32", "bf16-mixed", "bf16-true")
        check(
            t.precision in fsdp2_precisions,
            "trainer.precision",
            f"'{t.precision}' is not supported with trainer.strategy=fsdp2; choose one of {', '.join(fsdp2_precisions)}",
        )

    branch_checkpoint(root)  # raises for a missing run folder or step
    if root.init_from is not None and root.ckpt_path is None and is_checkpoint_folder(root.init_from):
        check_weights_fit(root.init_from, root)
    root.decoder_config()  # the model side's checks: shapes, slots, layer indices, every component
    for key in ("balancer", "data", "optimizer"):
        getattr(root, key).validate(root.model, key)
    check_kernel_backends(root)
    ranks = data_parallel_ranks(t)
    batch = root.data.batch_size
    if ranks:
        check(
            batch % ranks == 0,
            "data.batch_size",
            f"{batch} rows cannot be split evenly over the {ranks} data-parallel ranks (trainer.devices x trainer.num_nodes); use a multiple of {ranks}",
        )
    return root


def check_weights_fit(folder: str, root: RootConfig) -> None:
    """Every tensor of the weights folder fits the composed model (names, shapes, dtypes from the files'
    headers, the model built on the meta device): a ConfigError naming the first that does not."""
    import torch

    from components.hf.checkpoint import WeightsMismatch, check_weights
    from components.model import Decoder

    with torch.device("meta"):
        model = Decoder(root.decoder_config())
    try:
        check_weights(folder, model)
    except (WeightsMismatch, ValueError) as err:
        raise ConfigError(
            "init_from",
            f"{err}; compose the model the folder holds (its config.json, or its "
            "k3_sandbox section for a folder this project exported)",
        ) from None


def branch_checkpoint(root: RootConfig) -> Optional[str]:
    """The checkpoint ``init_from`` / ``init_step`` name (None without ``init_from``, or when it names a
    folder of weights: the run then starts at step 0 from those weights); ConfigError naming the key
    when it does not exist."""
    import os

    if root.init_from is None:
        check(root.init_step is None, "init_step", "needs init_from (the run folder to branch from)")
        return None
    check(
        root.ckpt_path in (None, "last"),
        "init_from",
        f"a run either branches (init_from) or resumes a checkpoint (ckpt_path={root.ckpt_path}), not both; ckpt_path=last resumes a branch",
    )
    path = root.init_from
    if is_checkpoint_folder(path):
        check(
            root.init_step is None,
            "init_step",
            f"init_from={path} is a folder of exported weights; init_step applies to a run folder",
        )
        return None  # weights only: the run starts at step 0 (runtime/run.py loads them)
    if os.path.isfile(path) or os.path.isfile(os.path.join(path, ".metadata")):
        check(
            root.init_step is None,
            "init_step",
            f"init_from={path} is a checkpoint already; init_step applies to a run folder",
        )
        return path
    check(
        os.path.isdir(os.path.join(path, "checkpoints")),
        "init_from",
        f"{path} is neither a checkpoint, a run folder (no checkpoints/ in it) nor a folder of exported weights (config.json beside model.safetensors)",
    )
    steps = sorted(
        int(n[5:-5])
        for n in os.listdir(os.path.join(path, "checkpoints"))
        if n.startswith("step=") and n.endswith(".ckpt")
    )
    check(
        root.init_step is not None,
        "init_step",
        f"init_from={path} is a run folder: name the step to branch at (checkpoints at steps {steps})",
    )
    ckpt = os.path.join(path, "checkpoints", f"step={root.init_step}.ckpt")
    check(os.path.exists(ckpt), "init_step", f"{path} has no checkpoint at step {root.init_step}; it has steps {steps}")
    return ckpt


def tokens_per_step(root: RootConfig) -> int:
    """Training tokens one optimizer step consumes (global: summed over data-parallel ranks)."""
    return root.data.batch_size * root.data.seq_len * root.trainer.accumulate_grad_batches


def training_steps(root: RootConfig) -> int:
    """Optimizer steps the run trains: ``trainer.max_steps`` when set, else the ``trainer.max_tokens``
    budget in whole steps (rounded up)."""
    t = root.trainer
    if t.max_steps is not None:
        return t.max_steps
    return -(-t.max_tokens // tokens_per_step(root))


def describe_length(root: RootConfig) -> str:
    """How long the run trains, in steps and tokens, and which setting decided it."""
    steps = training_steps(root)
    tokens = steps * tokens_per_step(root)
    t = root.trainer
    if t.max_steps is None:
        source = f"trainer.max_tokens={t.max_tokens:,}"
    elif t.max_tokens is not None:
        source = f"trainer.max_steps; trainer.max_tokens={t.max_tokens:,} is not used"
    else:
        source = "trainer.max_steps"
    guard = f", time guard {t.max_time_minutes:g} min" if t.max_time_minutes else ""
    return f"{steps:,} steps x {tokens_per_step(root):,} tokens = {tokens:,} tokens ({source}{guard})"


def check_kernel_backends(root: RootConfig) -> None:
    """A run on the CPU cannot use a CUDA-only kernel (Triton kernels run on the CPU only under
    Triton's interpreter, ``TRITON_INTERPRET=1``)."""
    if root.trainer.accelerator != "cpu":
        return
    for key, comp in component_configs(root):
        for name, choice in comp.kernel_backends().items():
            if choice == "fla" or (choice == "triton" and not interpreting()):
                raise ConfigError(
                    f"{key}.{name}",
                    f"'{choice}' is a CUDA (Triton) kernel and this run is on CPU (trainer.accelerator=cpu); use 'torch' or 'auto'",
                )


def data_parallel_ranks(t: TrainerConfig) -> Optional[int]:
    """Ranks the global batch is split over, when the config fixes it (None for devices=auto)."""
    if t.strategy == "auto":
        return 1
    per_node = len(t.devices) if isinstance(t.devices, list) else t.devices if isinstance(t.devices, int) else None
    return None if per_node is None else per_node * t.num_nodes


def component_configs(root: RootConfig) -> list[tuple[str, Any]]:
    """(full key, config) of every registry-selected component in the config."""
    items: list[tuple[str, Any]] = [("mixer", root.mixer), ("ffn", root.ffn)]
    items += [(f"mixers.{k}", v) for k, v in root.mixers.items()]
    items += [(f"ffns.{k}", v) for k, v in root.ffns.items()]
    items += [
        ("residual", root.residual),
        ("balancer", root.balancer),
        ("data", root.data),
        ("optimizer", root.optimizer),
    ]
    return items


def to_container(root: RootConfig) -> dict:
    """Plain-dict view of a typed config (for logging and checkpoints)."""
    return dataclasses.asdict(root)
