"""The types every part of the model side shares, with no project or third-party imports, so that the
registries, the model config and the layer plan can all import them at module top without a cycle.

``ConfigError`` is what a configuration that cannot be built raises; ``ComponentConfig`` is the base of
every registered component's config dataclass (mixers, FFNs, balancers, residual schemes, datasets,
optimizers): its methods are the whole contract the rest of the code may call on a component's config.
``LayerPattern`` is how a model config names the slot of each layer; ``LayerSpec`` is one layer of the
resolved plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# OmegaConf's marker for a required field (``omegaconf.MISSING``), spelled out to stay dependency-free
MISSING: Any = "???"


class ConfigError(ValueError):
    """A composed configuration that cannot be built. ``key`` is the full dotted config key."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}" if key else message)


class ComponentConfig:
    """Contract of a registered component's config (subclasses are dataclasses with a ``name`` field)."""

    name: str

    def validate(self, model: Any, key: str) -> None:
        """Raise ``ConfigError`` (full key ``{key}.{field}``) for values this component cannot take.
        ``model`` (a ``components.config.ModelConfig``, which imports this module) gives the decoder-wide
        settings (``d_model``, ...) a check may need."""

    def kernel_backends(self) -> dict[str, str]:
        """``{field: choice}`` of the kernel back-ends this config selects (``components/ops/backend.py``),
        so the runtime can refuse a CUDA-only kernel on a CPU run; {} for components without kernels."""
        return {}

    def tags(self) -> list[str]:
        """Run tags this choice implies beyond ``<group>:<name>`` (``act:situ_glu`` for a GLU FFN)."""
        return []


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


@dataclass(frozen=True)
class LayerSpec:
    """One layer of the resolved plan: the slot and config of its mixer and of its FFN."""

    index: int
    mixer_slot: str
    mixer: ComponentConfig
    ffn_slot: str
    ffn: ComponentConfig
