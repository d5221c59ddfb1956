"""A composed config read back from plain data (JSON, a checkpoint's ``run_config``), on the model side.

``typed(schema, node)``: ``node`` as the dataclass ``schema`` (checked by OmegaConf's structured merge),
with the integer keys JSON turned into strings restored (``mixer_plan.at: {"-1": mla}``).
``decoder_config_from_container(data)``: the ``DecoderConfig`` of a run's plain config, built from the
registries alone, so what rebuilds an exported model (``components/hf/transformers_model.py``) needs
nothing of the runtime.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from omegaconf import OmegaConf

from components.config import DecoderConfig, ModelConfig
from components.registry import FFNS, MIXERS, RESIDUALS


def typed(schema: type, node: dict) -> Any:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), int_keys_restored(schema, node)))


def int_keys_restored(schema: type, node: Any) -> Any:
    """``node`` with the keys of ``schema``'s ``dict[int, ...]`` fields as ints again: a config that went
    through JSON (an exported folder's config.json) has them as strings (``mixer_plan.at: {"-1": mla}``)."""
    if not (dataclasses.is_dataclass(schema) and isinstance(node, dict)):
        return node
    hints = typing.get_type_hints(schema)
    restored = dict(node)
    for f in dataclasses.fields(schema):
        if f.name not in restored:
            continue
        hint = hints[f.name]
        if typing.get_origin(hint) is typing.Union:  # Optional[X]
            hint = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
        value = restored[f.name]
        if typing.get_origin(hint) is dict and typing.get_args(hint)[:1] == (int,) and isinstance(value, dict):
            restored[f.name] = {_as_int(k): v for k, v in value.items()}
        elif dataclasses.is_dataclass(hint):
            restored[f.name] = int_keys_restored(hint, value)
    return restored


def _as_int(key: Any) -> Any:
    try:
        return int(key) if isinstance(key, str) else key
    except ValueError:
        return key  # left for the schema to refuse, naming the key


def decoder_config_from_container(data: dict) -> DecoderConfig:
    """The checked ``DecoderConfig`` of a run's plain config (``model``, ``mixer``/``mixers``,
    ``ffn``/``ffns``, ``residual``; other keys are ignored)."""

    def component(registry, node: dict, key: str):
        return typed(registry.get(node["name"], key=f"{key}.name").config_cls, node)

    mixers = {"mixer": component(MIXERS, data["mixer"], "mixer")}
    mixers.update({slot: component(MIXERS, n, f"mixers.{slot}") for slot, n in (data.get("mixers") or {}).items()})
    ffns = {"ffn": component(FFNS, data["ffn"], "ffn")}
    ffns.update({slot: component(FFNS, n, f"ffns.{slot}") for slot, n in (data.get("ffns") or {}).items()})
    residual = component(RESIDUALS, data["residual"], "residual")
    return DecoderConfig.build(typed(ModelConfig, data["model"]), mixers, ffns, residual)
