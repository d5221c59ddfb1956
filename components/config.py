"""The model's own configuration: decoder settings, layer patterns, and what the decoder is built from.

``ModelConfig`` holds the decoder-wide settings (width, depth, vocabulary, init); the components of each
layer come from the registries, chosen per slot. ``DecoderConfig`` is everything ``Decoder`` needs and
nothing else: the model settings, the resolved per-layer plan, the residual scheme. It is built and
checked by ``DecoderConfig.build``, which raises ``ConfigError`` naming the full config key of what is
wrong. Nothing here knows about training, hardware or logging; the runtime composes a whole run
(``runtime/config.py``) and hands the model part to this module.

``ComponentConfig`` (the base of every registered component's config dataclass) and ``LayerPattern``
are defined in ``components/base.py`` and re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import II

from components.base import ComponentConfig, ConfigError, LayerPattern, LayerSpec
from components.layer_plan import resolve_plan, slot_key
from components.nn.build_context import INIT_STD, NORM_EPS


def check_positive(cfg: Any, key: str, *fields: str) -> None:
    """``ConfigError`` naming ``{key}.{field}`` for the first listed field that is not positive."""
    for name in fields:
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{key}.{name}", f"must be positive, got {value}")


@dataclass
class ModelConfig:
    d_model: int = 256
    n_layers: int = 6
    # the data's vocabulary unless set (composition resolves it from the chosen dataset)
    vocab_size: int = II("data.vocab_size")
    tie_embeddings: bool = True
    init_std: float = INIT_STD
    norm_eps: float = NORM_EPS
    # Output projections of every sublayer are initialised with init_std / sqrt(2 * n_layers), as in
    # GPT-2, so the residual stream does not grow with depth at initialisation (BuildContext.for_model).
    scale_residual_init: bool = True
    mixer_plan: LayerPattern = field(default_factory=lambda: LayerPattern(repeat=["mixer"]))
    ffn_plan: LayerPattern = field(default_factory=lambda: LayerPattern(repeat=["ffn"]))
    # multi-token prediction (components/mtp.py): extra training-only layers, depth k predicting the token
    # k+1 ahead, each built like the last layer; the loss adds mtp_weight x their mean cross-entropy
    mtp_depth: int = 0
    mtp_weight: float = 0.3

    def validate(self) -> None:
        for name in ("d_model", "n_layers", "vocab_size", "init_std", "norm_eps"):
            check_positive(self, "model", name)
        if self.mtp_depth < 0:
            raise ConfigError("model.mtp_depth", f"must be >= 0 (0: no multi-token prediction), got {self.mtp_depth}")
        if not self.mtp_weight >= 0:
            raise ConfigError("model.mtp_weight", f"must be >= 0, got {self.mtp_weight}")


@dataclass
class DecoderConfig:
    """What ``components.model.Decoder`` is built from."""

    model: ModelConfig
    layers: list[LayerSpec]  # the mixer and FFN config of every layer, in order
    residual: ComponentConfig  # the residual scheme's config

    @classmethod
    def build(
        cls,
        model: ModelConfig,
        mixers: dict[str, ComponentConfig],
        ffns: dict[str, ComponentConfig],
        residual: ComponentConfig,
    ) -> DecoderConfig:
        """Check and assemble. ``mixers`` / ``ffns`` map slot names to component configs (the primary
        slots are ``mixer`` and ``ffn``); every component is validated under its full config key."""
        model.validate()
        for slot, cfg in mixers.items():
            cfg.validate(model, slot_key(slot, "mixer"))
        for slot, cfg in ffns.items():
            cfg.validate(model, slot_key(slot, "ffn"))
        residual.validate(model, "residual")
        return cls(model, resolve_plan(model, mixers, ffns), residual)

    def component_configs(self) -> list[ComponentConfig]:
        """Every distinct component config of the decoder (each slot's once, then the residual scheme)."""
        seen: dict[int, ComponentConfig] = {}
        for spec in self.layers:
            seen.setdefault(id(spec.mixer), spec.mixer)
            seen.setdefault(id(spec.ffn), spec.ffn)
        return [*seen.values(), self.residual]
