"""Expands per-layer patterns into a concrete plan: which mixer and FFN config each layer uses.

K3 is written as ``mixer_plan: {repeat: [mixer, mixer, mixer, mla], at: {-1: mla}}`` (3 x KDA then
MLA, repeated, last layer MLA) and ``ffn_plan: {repeat: [ffn], at: {0: dense}}`` (dense FFN in layer 0,
MoE after); the slots ``mla`` and ``dense`` are keys of ``mixers`` and ``ffns``.
"""

from __future__ import annotations

from typing import Any

from components.base import ComponentConfig, ConfigError, LayerPattern, LayerSpec


def expand_pattern(pattern: LayerPattern, n_layers: int, slots: dict[str, ComponentConfig], key: str) -> list[str]:
    """Slot name per layer for one LayerPattern; raises ConfigError naming ``key`` on bad input."""
    repeat = list(pattern.repeat)
    if not repeat:
        raise ConfigError(f"{key}.repeat", "must list at least one slot")
    allowed = ", ".join(sorted(slots))
    for i, slot in enumerate(repeat):
        if slot not in slots:
            raise ConfigError(f"{key}.repeat[{i}]", f"unknown slot '{slot}'; defined slots: {allowed}")
    names = [repeat[i % len(repeat)] for i in range(n_layers)]
    for layer, slot in dict(pattern.at).items():
        index = int(layer)
        if not -n_layers <= index < n_layers:
            raise ConfigError(
                f"{key}.at", f"layer {index} is outside a {n_layers}-layer model (valid: {-n_layers}..{n_layers - 1})"
            )
        if slot not in slots:
            raise ConfigError(f"{key}.at.{layer}", f"unknown slot '{slot}'; defined slots: {allowed}")
        names[index % n_layers] = slot
    return names


def resolve_plan(
    model: Any, mixer_slots: dict[str, ComponentConfig], ffn_slots: dict[str, ComponentConfig]
) -> list[LayerSpec]:
    """Per-layer (mixer, FFN) configs from a ``ModelConfig``'s patterns and the configs of each slot
    (``model`` is not annotated as one: components/config.py imports this module)."""
    n = model.n_layers
    mixer_names = expand_pattern(model.mixer_plan, n, mixer_slots, "model.mixer_plan")
    ffn_names = expand_pattern(model.ffn_plan, n, ffn_slots, "model.ffn_plan")
    return [LayerSpec(i, m, mixer_slots[m], f, ffn_slots[f]) for i, (m, f) in enumerate(zip(mixer_names, ffn_names))]


def slot_key(slot: str, family: str) -> str:
    """Full config key of a slot: ``mixer`` -> ``mixer``, ``mla`` -> ``mixers.mla``."""
    return slot if slot == family else f"{family}s.{slot}"


def describe_plan(plan: list[LayerSpec]) -> str:
    """Compact run-length summary, e.g. ``0: kda/dense | 1-2: kda/moe | 3: mla/moe``."""
    parts: list[str] = []
    start = 0
    for i in range(1, len(plan) + 1):
        if i == len(plan) or (plan[i].mixer.name, plan[i].ffn.name) != (plan[start].mixer.name, plan[start].ffn.name):
            span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            parts.append(f"{span}: {plan[start].mixer.name}/{plan[start].ffn.name}")
            start = i
    return " | ".join(parts)
