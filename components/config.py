"""Root config schemas and strict validation of a composed configuration.

Hydra composes ``conf/config.yaml`` against the dataclasses below (stored in its ConfigStore), which
already refuses unknown keys and wrong types at composition. ``validate`` then converts the result to
typed objects and checks what only the whole config can tell: registered component names, layer-plan
slots, and shapes that do not fit together (``d_model`` not divisible by ``n_heads``, ...). Every
failure is a ``ConfigError`` naming the full dotted key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import II, MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from components.registry import FAMILIES, ConfigError, closest


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------
@dataclass
class LayerPattern:
    """Which slot each layer uses: ``repeat`` is cycled over the layers, ``at`` pins single layers.

    Slot names are ``mixer`` / ``ffn`` (the primary components) or keys of ``mixers`` / ``ffns``.
    ``at`` keys are 0-indexed layer numbers; negative numbers count from the end (-1 = last layer).
    K3: mixers ``repeat: [mixer, mixer, mixer, mla]`` with ``at: {-1: mla}``; FFNs ``repeat: [ffn]``
    with ``at: {0: dense}``.
    """

    repeat: list[str] = MISSING
    at: dict[int, str] = field(default_factory=dict)


@dataclass
class ModelConfig:
    d_model: int = 256
    n_layers: int = 6
    vocab_size: int = II("data.vocab_size")
    tie_embeddings: bool = True
    init_std: float = 0.02
    norm_eps: float = 1e-5
    # Output projections of every sublayer are initialised with init_std / sqrt(2 * n_layers), as in
    # GPT-2, so the residual stream does not grow with depth at initialisation.
    scale_residual_init: bool = True
    mixer_plan: LayerPattern = field(default_factory=lambda: LayerPattern(repeat=["mixer"]))
    ffn_plan: LayerPattern = field(default_factory=lambda: LayerPattern(repeat=["ffn"]))


# ----------------------------------------------------------------------------------------------
# Optimisation and training
# ----------------------------------------------------------------------------------------------
@dataclass
class OptimizerConfig:
    name: str = "adamw"
    lr: float = 3e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 100
    # cosine decay from lr to lr * min_lr_ratio over the remaining steps; "constant" keeps lr flat
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    # Muon only (components/optim/muon.py): momentum, Nesterov, Newton-Schulz steps, per-head blocks
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    per_head: bool = False


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
    max_steps: int = 1000
    # stop training after this many minutes of wall time (None: no limit); the schedule still
    # assumes max_steps, so a time-limited run ends early rather than decaying faster
    max_time_minutes: Optional[float] = None
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = 1.0
    val_check_interval: int = 250
    limit_val_batches: Optional[int] = None
    log_every_n_steps: int = 10
    checkpoint_every_n_steps: int = 250
    enable_progress_bar: bool = True
    deterministic: bool = False
    # torch.compile the model: "true", "false", or "auto" (compile when a C++ compiler is on PATH,
    # which TorchInductor's CPU backend needs, or on CUDA, unless a component declares
    # compile_friendly = False: KDA, MoE routers); costs some seconds up front
    compile: str = "false"
    # refuse to start when weights + gradients + optimizer state cannot fit (components/training/memory_check.py)
    memory_check: bool = True


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
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    seed: int = 1337
    # run name (also the run folder's name); None: derived from the chosen components
    name: Optional[str] = None
    # None: fresh run; "last": resume the newest run folder of the same command; or a .ckpt path
    ckpt_path: Optional[str] = None
    # where run folders go (relative paths are relative to the working directory)
    output_root: str = "outputs"


ALLOWED = {
    "optimizer.name": ("adamw", "muon"),
    "optimizer.schedule": ("cosine", "constant", "linear"),
    "trainer.accelerator": ("cpu", "gpu", "cuda", "auto"),
    "trainer.precision": ("32-true", "32", "bf16-mixed", "bf16-true", "16-mixed", "64-true"),
    "logger.name": ("wandb", "csv"),
    "trainer.compile": ("auto", "true", "false", "True", "False"),
    "trainer.strategy": ("auto", "ddp", "fsdp2"),
    "trainer.on_nonfinite": ("stop", "skip"),
    "logger.mode": ("auto", "online", "offline", "disabled"),
}


def register_root_schemas() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="root_schema", node=RootConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="optimizer", name="optimizer_schema", node=OptimizerConfig)
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
        raise ConfigError(key, f"no {registry.family} chosen; pick one of {', '.join(registry.names())} (e.g. {group}={registry.names()[0]})")
    name = node.name
    entry = registry.get(name, key=f"{key}.name")
    node_type = OmegaConf.get_type(node)
    if node_type is not entry.config_cls:
        raise ConfigError(key, f"{registry.family} '{name}' must be composed with its schema {entry.config_cls.__name__} (conf/{group}/{name}.yaml lists `{name}_schema` in its defaults), got {getattr(node_type, '__name__', node_type)}")


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
                raise ConfigError(f"{key}.{k}" if key else str(k), f"unknown key '{k}' in {where} ({schema.__name__}); allowed keys: {allowed}.{hint}")
    for k in node.keys():
        child = node._get_node(k)
        if isinstance(child, DictConfig):
            check_known_keys(child, f"{key}.{k}" if key else str(k))


def validate(cfg: DictConfig) -> RootConfig:
    """Check a composed config and return it as typed objects. Raises ConfigError."""
    check_known_keys(cfg)
    for group, key in (("mixer", "mixer"), ("ffn", "ffn"), ("residual", "residual"), ("balancer", "balancer"), ("data", "data")):
        _check_component_node(cfg.get(key), group, key)
    for slot, node in (cfg.get("mixers") or {}).items():
        _check_component_node(node, "mixer", f"mixers.{slot}")
    for slot, node in (cfg.get("ffns") or {}).items():
        _check_component_node(node, "ffn", f"ffns.{slot}")

    try:
        root: RootConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except OmegaConfBaseException as err:
        raise ConfigError(getattr(err, "full_key", "") or "", str(getattr(err, "msg", err)).strip().splitlines()[0]) from None

    for key, allowed in ALLOWED.items():
        section, attr = key.split(".")
        value = getattr(getattr(root, section), attr)
        check(value in allowed, key, f"'{value}' is not allowed; choose one of {', '.join(allowed)}")

    m = root.model
    check(m.d_model > 0, "model.d_model", f"must be positive, got {m.d_model}")
    check(m.n_layers > 0, "model.n_layers", f"must be positive, got {m.n_layers}")
    check(m.vocab_size > 0, "model.vocab_size", f"must be positive, got {m.vocab_size}")
    check(m.init_std > 0, "model.init_std", f"must be positive, got {m.init_std}")
    t = root.trainer
    check(t.max_steps > 0, "trainer.max_steps", f"must be positive, got {t.max_steps}")
    check(t.accumulate_grad_batches >= 1, "trainer.accumulate_grad_batches", f"must be >= 1, got {t.accumulate_grad_batches}")
    check(t.val_check_interval > 0, "trainer.val_check_interval", f"must be positive, got {t.val_check_interval}")
    check(t.checkpoint_every_n_steps > 0, "trainer.checkpoint_every_n_steps", f"must be positive, got {t.checkpoint_every_n_steps}")
    check(t.num_nodes >= 1, "trainer.num_nodes", f"must be >= 1, got {t.num_nodes}")
    devices_ok = t.devices == "auto" or (isinstance(t.devices, int) and t.devices >= 1) or (isinstance(t.devices, list) and len(t.devices) > 0)
    check(devices_ok, "trainer.devices", f"must be a positive number of processes per node, a list of device indices or 'auto', got {t.devices!r}")
    check(t.max_skipped_steps >= 1, "trainer.max_skipped_steps", f"must be >= 1, got {t.max_skipped_steps}")
    if t.strategy == "fsdp2":
        fsdp2_precisions = ("32-true", "32", "bf16-mixed", "bf16-true")
        check(t.precision in fsdp2_precisions, "trainer.precision", f"'{t.precision}' is not supported with trainer.strategy=fsdp2; choose one of {', '.join(fsdp2_precisions)}")
    o = root.optimizer
    check(o.lr > 0, "optimizer.lr", f"must be positive, got {o.lr}")
    check(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optimizer.betas", f"must be two numbers in [0, 1), got {list(o.betas)}")
    check(0 <= o.min_lr_ratio <= 1, "optimizer.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
    check(o.warmup_steps >= 0, "optimizer.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    check(0 <= o.momentum < 1, "optimizer.momentum", f"must be in [0, 1), got {o.momentum}")
    check(1 <= o.ns_steps < 100, "optimizer.ns_steps", f"must be in [1, 99], got {o.ns_steps}")

    from components.layer_plan import resolve_plan

    resolve_plan(root)  # checks slots and layer indices

    for key, comp in component_configs(root):
        validator = getattr(comp, "validate", None)
        if validator is not None:
            validator(root, key)
    ranks = data_parallel_ranks(t)
    batch = getattr(root.data, "batch_size", None)
    if ranks and isinstance(batch, int):
        check(batch % ranks == 0, "data.batch_size", f"{batch} rows cannot be split evenly over the {ranks} data-parallel ranks (trainer.devices x trainer.num_nodes); use a multiple of {ranks}")
    return root


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
    items += [("residual", root.residual), ("balancer", root.balancer), ("data", root.data)]
    return items


def to_container(root: RootConfig) -> dict:
    """Plain-dict view of a typed config (for logging and checkpoints)."""
    return dataclasses.asdict(root)
