"""The sandbox composition of a model folder transformers saved (no ``k3_sandbox`` section).

A ``LlamaForCausalLM`` folder (``save_pretrained``) holds exactly what the sandbox builds from MHA, GQA or
MQA with RoPE, a dense SwiGLU FFN and the plain residual, under the same tensor names
(``components/hf/key_map.py``), so its ``config.json`` maps onto command-line overrides:
``composition_overrides(cfg)``. What the sandbox does not compute the same way (RoPE scaling, biases,
another activation, sliding windows) is refused by name: ``ForeignConfigError``.
"""

from __future__ import annotations

from typing import Any


class ForeignConfigError(ValueError):
    """A transformers config.json the sandbox cannot compose exactly; the message names the field."""


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    for where, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = value.get("rope_type", value.get("type", "default"))
        if kind != "default":
            raise ForeignConfigError(f"{where}.rope_type={kind}: the sandbox's RoPE is unscaled (rope_type default)")
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return float(cfg.get("rope_theta", 10000.0))


def _check(cfg: dict, key: str, allowed: Any, default: Any) -> None:
    value = cfg.get(key, default)
    if value != allowed:
        raise ForeignConfigError(f"{key}={value!r}: the sandbox composes only {key}={allowed!r}")


def composition_overrides(cfg: dict) -> list[str]:
    """Overrides composing the model of a transformers ``config.json`` (``model_type: llama``)."""
    model_type = cfg.get("model_type")
    if model_type != "llama":
        raise ForeignConfigError(
            f"model_type={model_type!r}: only Llama folders map onto a sandbox composition; compose the model "
            "with overrides (e.g. experiment=k3_full for a released K3 folder)"
        )
    _check(cfg, "hidden_act", "silu", "silu")
    _check(cfg, "attention_bias", False, False)
    _check(cfg, "mlp_bias", False, False)
    _check(cfg, "pretraining_tp", 1, 1)
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    theta = _rope_theta(cfg)
    mixer = "mha" if kv == heads else ("mqa" if kv == 1 else "gqa")
    out = [
        f"model.d_model={hidden}",
        f"model.n_layers={int(cfg['num_hidden_layers'])}",
        f"model.vocab_size={int(cfg['vocab_size'])}",
        f"model.tie_embeddings={'true' if cfg.get('tie_word_embeddings', False) else 'false'}",
        f"model.norm_eps={float(cfg.get('rms_norm_eps', 1e-6))!r}",
        "model.mtp_depth=0",
        f"mixer={mixer}",
        f"mixer.n_heads={heads}",
        *([f"mixer.n_kv_heads={kv}"] if mixer == "gqa" else []),
        f"mixer.head_dim={head_dim}",
        "mixer.rope=true",
        f"mixer.rope_theta={theta!r}",
        "ffn=dense",
        "ffn.activation=swiglu",
        f"ffn.hidden_dim={int(cfg['intermediate_size'])}",
        "residual=plain",
    ]
    return out


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def merged_overrides(derived: list[str], given: list[str]) -> list[str]:
    """``derived`` without the keys ``given`` sets itself, followed by ``given`` (a group chosen in
    ``given``, ``model=tiny``, still takes the derived fields on top)."""
    keys = {_key(o) for o in given if "=" in o}
    return [*(o for o in derived if _key(o) not in keys), *given]
