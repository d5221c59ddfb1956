"""Strict validation of a composed run config: every failure a ``ConfigError`` naming the full dotted key.

``validate`` converts the composed config to typed objects (``runtime/config.py``) and checks what only
the whole config can tell: registered component names, layer-plan slots, shapes that do not fit
together (the model side's own checks, ``components/config.py``), and what the hardware allows (kernel
back-ends, data-parallel batch splits).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from components.ops.backend import interpreting
from components.registry import DATASETS, ConfigError, closest
from runtime.checkpoints.branching import check_branch
from runtime.config import COMPONENT_KEYS, REGISTRIES, RootConfig, component_configs, data_parallel_ranks
from runtime.precision import resolve_precision
from runtime.run_identity import JOB_TYPES

ALLOWED = {
    "trainer.accelerator": ("cpu", "gpu", "cuda", "auto"),
    "trainer.precision": ("auto", "32-true", "32", "bf16-mixed", "bf16-true", "16-mixed", "64-true"),
    "logger.name": ("wandb", "csv"),
    "trainer.compile": ("auto", "true", "false", "True", "False"),
    "trainer.strategy": ("auto", "ddp", "fsdp2"),
    "trainer.on_nonfinite": ("stop", "skip"),
    "logger.mode": ("auto", "online", "offline", "disabled"),
}
PROFILERS = ("simple", "advanced", "pytorch")  # trainer.profiler, besides null


def check(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(key, message)


def _check_component_node(node: Any, group: str, key: str) -> None:
    registry = REGISTRIES[group]
    if not isinstance(node, DictConfig) or "name" not in node:
        raise ConfigError(
            key,
            f"no {registry.family} chosen; pick one of {', '.join(registry.names())} "
            f"(e.g. {group}={registry.names()[0]})",
        )
    name = node.name
    entry = registry.get(name, key=f"{key}.name")
    node_type = OmegaConf.get_type(node)
    if node_type is not entry.config_cls:
        raise ConfigError(
            key,
            f"{registry.family} '{name}' must be composed with its schema {entry.config_cls.__name__} "
            f"(conf/{group}/{name}.yaml lists `{name}_schema` in its defaults), "
            f"got {getattr(node_type, '__name__', node_type)}",
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
    for group in COMPONENT_KEYS:
        _check_component_node(cfg.get(group), group, group)
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

    check(
        root.logger.job_type is None or root.logger.job_type in JOB_TYPES,
        "logger.job_type",
        f"'{root.logger.job_type}' is not allowed; choose one of null, {', '.join(JOB_TYPES)}",
    )
    for key, allowed in ALLOWED.items():
        section, attr = key.split(".")
        value = getattr(getattr(root, section), attr)
        check(value in allowed, key, f"'{value}' is not allowed; choose one of {', '.join(allowed)}")

    t = root.trainer
    # from here on the run's config names the precision it trains in (its W&B record and summary too)
    t.precision = resolve_precision(t.precision, t.accelerator)
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
        t.min_tokens_per_s is None or t.min_tokens_per_s > 0,
        "trainer.min_tokens_per_s",
        f"must be positive (or null: a fixed time guard of trainer.max_time_minutes), got {t.min_tokens_per_s}",
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
            f"'{t.precision}' is not supported with trainer.strategy=fsdp2; "
            f"choose one of {', '.join(fsdp2_precisions)}",
        )

    check_branch(root)
    root.decoder_config()  # the model side's checks: shapes, slots, layer indices, every component
    for key in ("balancer", "data", "optimizer", "schedule"):
        getattr(root, key).validate(root.model, key)
    check_kernel_backends(root)
    check_expert_parallel(root)
    check_cpu_threads(root)
    ranks = data_parallel_ranks(t)
    batch = root.data.batch_size
    if ranks:
        check(
            batch % ranks == 0,
            "data.batch_size",
            f"{batch} rows cannot be split evenly over the {ranks} data-parallel ranks "
            f"(trainer.devices x trainer.num_nodes); use a multiple of {ranks}",
        )
    return root


CPU_THREAD_MODES = ("auto", "fixed")


def check_cpu_threads(root: RootConfig) -> None:
    """``trainer.cpu_threads`` is a mode the run knows."""
    mode = root.trainer.cpu_threads
    check(
        mode in CPU_THREAD_MODES,
        "trainer.cpu_threads",
        f"'{mode}' is not allowed; choose one of {', '.join(CPU_THREAD_MODES)} (auto: tune the thread count to the "
        "machine's load as the run goes; fixed: keep the count the process started with)",
    )


def check_expert_parallel(root: RootConfig) -> None:
    """``trainer.expert_parallel``: only under fsdp2, dividing the data-parallel ranks and every routed layer's
    experts (each rank holds whole experts), and dropless (a dropped pair has no place in the exchange)."""
    t, key = root.trainer, "trainer.expert_parallel"
    n = t.expert_parallel
    check(isinstance(n, int) and n >= 1, key, f"must be a positive number of ranks (1: off), got {n!r}")
    if n == 1:
        return
    check(t.strategy == "fsdp2", key, f"needs trainer.strategy=fsdp2, got '{t.strategy}'")
    ranks = data_parallel_ranks(t)
    check(
        ranks is not None and ranks % n == 0,
        key,
        f"{n} must divide the data-parallel ranks (trainer.devices x trainer.num_nodes = {ranks})",
    )
    routed = [(k, c) for k, c in component_configs(root) if hasattr(c, "num_experts")]
    check(bool(routed), key, "the model has no routed experts to split")
    for ffn_key, ffn in routed:
        check(
            ffn.num_experts % n == 0,
            f"{ffn_key}.num_experts",
            f"{ffn.num_experts} experts cannot be split over {key}={n} ranks; use a multiple of {n}",
        )
        check(
            ffn.capacity_factor is None,
            f"{ffn_key}.capacity_factor",
            f"token dropping is not supported with {key}={n}; set null (dropless)",
        )


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
                    f"'{choice}' is a CUDA (Triton) kernel and this run is on CPU (trainer.accelerator=cpu); "
                    "use 'torch' or 'auto'",
                )
