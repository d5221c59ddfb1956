"""Which transformers class an exported model is labelled with, and why.

A model whose every part a class of transformers computes exactly is exported as that class: Llama
(``LlamaForCausalLM``: MHA/GQA/MQA with RoPE, a dense SwiGLU FFN, the plain residual) or Kimi Linear
(``KimiLinearForCausalLM``: KDA with the softplus gate and low-rank output gate, NoPE MLA without the
output gate, dense or plain-MoE SwiGLU FFNs, the plain residual). Anything else is labelled as the
project's own registered class (``components/hf/transformers_model.py``): ``K3SandboxForCausalLM``, or
for a K3-family model with the release's multimodal prefix the release's top-level ``kimi_k3`` schema.
``choose`` names the first feature that keeps a model from a native class, so the export can say why.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from components.hf.config_json import is_release_family
from components.hf.key_map import MULTIMODAL_PREFIX, TEXT_PREFIX
from components.model import Decoder

LLAMA = "LlamaForCausalLM"
KIMI_LINEAR = "KimiLinearForCausalLM"
SANDBOX = "K3SandboxForCausalLM"
KIMI_K3 = "KimiK3ForConditionalGeneration"  # the release's architectures entry
MODEL_TYPES = {LLAMA: "llama", KIMI_LINEAR: "kimi_linear", SANDBOX: "k3_sandbox", KIMI_K3: "kimi_k3"}
ATTENTION = {"mha", "gqa", "mqa"}
KIMI_MIXERS = {"kda", "mla"}
KIMI_FFNS = {"dense", "moe"}
# the eps transformers' Kimi Linear gives q_a_layernorm and kv_a_layernorm (not configurable)
KIMI_LORA_NORM_EPS = 1e-6


@dataclass(frozen=True)
class Layout:
    """The class an export is labelled with; ``reason`` names what kept it from a native class."""

    architecture: str
    reason: Optional[str] = None

    @property
    def model_type(self) -> str:
        return MODEL_TYPES[self.architecture]

    @property
    def native(self) -> bool:
        return self.architecture in (LLAMA, KIMI_LINEAR)

    def describe(self) -> str:
        what = f"{self.architecture} (model_type {self.model_type})"
        return f"{what}; {self.reason}" if self.reason else what


def _fields(cfg: Any, skip: tuple[str, ...] = ()) -> dict:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in skip}


# settings that change how a component computes, per family (backends, chunk sizes, init do not)
_NOT_MATH = ("backend", "activation_backend", "chunk_size", "dispatch", "a_log_init", "dt_bias_init", "absorbed_decode")


def _uniform(cfgs: list[Any], what: str) -> Optional[str]:
    """None if every config computes alike, else a reason naming the first layer that differs."""
    first = _fields(cfgs[0], _NOT_MATH)
    for i, cfg in enumerate(cfgs):
        if _fields(cfg, _NOT_MATH) != first:
            diff = next(k for k, v in _fields(cfg, _NOT_MATH).items() if first.get(k) != v)
            return f"the {what} of layer {i} differs from layer 0's ({diff}), one setting for all layers in that class"
    return None


def _common(model: Decoder, cls: str) -> Optional[str]:
    residual = model.config.residual.name
    if residual != "plain":
        return f"not {cls}: residual={residual} (AttnRes; {cls} adds sublayers to a plain residual)"
    if len(model.mtp):
        return f"not {cls}: model.mtp_depth={len(model.mtp)} (MTP layers are not part of {cls})"
    return None


def _prefix(prefix: str, cls: str) -> Optional[str]:
    if prefix == MULTIMODAL_PREFIX:
        return f"not {cls}: the multimodal prefix (language_model.model.) is the K3 release's layout"
    return None


def _activation(cfg: Any, key: str, cls: str) -> Optional[str]:
    if cfg.activation != "swiglu":
        name = {"situ_glu": "SiTU-GLU", "glu": "GLU (sigmoid gate)"}.get(cfg.activation, cfg.activation)
        return f"not {cls}: {key}.activation={cfg.activation} ({name}; {cls} computes SwiGLU)"
    return None


def _llama_reason(model: Decoder, prefix: str) -> Optional[str]:
    cls = LLAMA
    if reason := _common(model, cls):
        return reason
    mixers = [layer.mixer.cfg for layer in model.layers]
    ffns = [layer.ffn.cfg for layer in model.layers]
    for i, (m, f) in enumerate(zip(mixers, ffns)):
        if m.name not in ATTENTION:
            return f"not {cls}: layer {i} has mixer {m.name}"
        if not m.rope:
            return f"not {cls}: mixer.rope=false (NoPE attention; {cls} always rotates)"
        if f.name != "dense":
            return f"not {cls}: layer {i} has ffn {f.name} ({cls} has one dense FFN per layer)"
        if reason := _activation(f, "ffn", cls):
            return reason
    hidden = {layer.ffn.gate_proj.weight.shape[0] for layer in model.layers}
    if len(hidden) > 1:
        return f"not {cls}: the dense FFNs have different widths {sorted(hidden)}"
    if reason := _uniform(mixers, "attention"):
        return f"not {cls}: {reason}"
    return _prefix(prefix, cls)


def _kimi_reason(model: Decoder, prefix: str, mxfp4_experts: bool) -> Optional[str]:
    cls = KIMI_LINEAR
    if reason := _common(model, cls):
        return reason
    if model.lm_head.weight is model.embed.weight:
        return f"not {cls}: model.tie_embeddings=true ({cls} keeps its own output head)"
    if mxfp4_experts:
        return f"not {cls}: --mxfp4-experts (packed experts are read by the project's class)"
    norm_eps = model.config.model.norm_eps
    kda, mla, dense, moe = [], [], [], []
    for i, layer in enumerate(model.layers):
        m, f = layer.mixer.cfg, layer.ffn.cfg
        if m.name not in KIMI_MIXERS:
            return f"not {cls}: layer {i} has mixer {m.name}"
        if m.name == "kda":
            if m.gate_lower_bound is not None:
                return f"not {cls}: mixer.gate_lower_bound={m.gate_lower_bound} (K3's lower-bound KDA gate)"
            if m.full_rank_gate:
                return f"not {cls}: mixer.full_rank_gate=true (a full-rank KDA output gate)"
            if m.norm_eps != norm_eps:
                return f"not {cls}: the KDA output norm's eps {m.norm_eps} is not model.norm_eps={norm_eps}"
            kda.append(m)
        else:
            if m.rope:
                return f"not {cls}: MLA with rope=true ({cls}'s MLA is NoPE)"
            if m.output_gate:
                return f"not {cls}: MLA with output_gate=true (K3's gated MLA)"
            if m.lora_norm_eps != KIMI_LORA_NORM_EPS:
                return f"not {cls}: MLA lora_norm_eps={m.lora_norm_eps} ({cls} uses {KIMI_LORA_NORM_EPS})"
            mla.append(m)
        if f.name not in KIMI_FFNS:
            kind = "LatentMoE" if "latent" in f.name else f.name
            return f"not {cls}: layer {i} has ffn {f.name} ({kind})"
        if reason := _activation(f, "ffn", cls):
            return reason
        if f.name == "moe":
            if f.router_activation != "sigmoid":
                return f"not {cls}: ffn.router_activation={f.router_activation} ({cls} routes by sigmoid)"
            if f.capacity_factor is not None:
                return f"not {cls}: ffn.capacity_factor={f.capacity_factor} ({cls} is dropless)"
            if f.num_shared_experts < 1:
                return f"not {cls}: ffn.num_shared_experts=0 ({cls} always has a shared expert)"
            if f.num_experts < 2:
                return f"not {cls}: ffn.num_experts=1 ({cls} groups at least two experts)"
            moe.append(f)
        else:
            dense.append(layer.ffn.gate_proj.weight.shape[0])
    if len(set(dense)) > 1:
        return f"not {cls}: the dense FFNs have different widths {sorted(set(dense))}"
    for cfgs, what in ((kda, "KDA"), (mla, "MLA"), (moe, "MoE")):
        if cfgs and (reason := _uniform(cfgs, what)):
            return f"not {cls}: {reason}"
    return _prefix(prefix, cls)


def choose(model: Decoder, prefix: str = TEXT_PREFIX, mxfp4_experts: bool = False) -> Layout:
    """The class ``model`` is exported as under ``prefix`` (``--mxfp4-experts``: packed experts)."""
    mixers = {layer.mixer.cfg.name for layer in model.layers}
    if mixers <= ATTENTION:
        reason = _llama_reason(model, prefix)
        if reason is None:
            return Layout(LLAMA)
    elif mixers <= KIMI_MIXERS:
        reason = _kimi_reason(model, prefix, mxfp4_experts)
        if reason is None:
            return Layout(KIMI_LINEAR)
    else:
        reason = f"no transformers class mixes {' and '.join(sorted(mixers))} layers"
    if is_release_family(model, model.config.residual.name) and prefix == MULTIMODAL_PREFIX:
        return Layout(KIMI_K3, reason)
    return Layout(SANDBOX, reason)


def llama_config(model: Decoder) -> dict:
    """``config.json`` fields of a model ``choose`` labels ``LlamaForCausalLM``."""
    attn = model.layers[0].mixer
    return {
        "hidden_size": model.d_model,
        "intermediate_size": model.layers[0].ffn.gate_proj.weight.shape[0],
        "num_hidden_layers": len(model.layers),
        "num_attention_heads": attn.n_heads,
        "num_key_value_heads": attn.n_kv_heads,
        "head_dim": attn.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": model.config.model.norm_eps,
        "rope_theta": attn.cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": attn.cfg.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": model.lm_head.weight is model.embed.weight,
        "vocab_size": model.vocab_size,
    }


def kimi_linear_config(model: Decoder) -> dict:
    """The fields transformers' ``KimiLinearConfig`` reads beyond the release schema: explicit layer
    types, the renormalisation as the router applies it (not for top-1), one head count."""
    layer_types = ["linear_attention" if layer.mixer.cfg.name == "kda" else "full_attention" for layer in model.layers]
    mlp_types = ["sparse" if layer.ffn.cfg.name == "moe" else "dense" for layer in model.layers]
    out: dict[str, Any] = {"layer_types": layer_types, "mlp_layer_types": mlp_types, "hidden_act": "silu"}
    mla = next((layer.mixer.cfg for layer in model.layers if layer.mixer.cfg.name == "mla"), None)
    kda = next((layer.mixer.cfg for layer in model.layers if layer.mixer.cfg.name == "kda"), None)
    heads = mla.n_heads if mla is not None else kda.n_heads
    out.update({"num_attention_heads": heads, "num_key_value_heads": heads})
    if mla is None:  # the field defaults of a model without MLA layers are unused; kept small and valid
        out.update(
            {"q_lora_rank": None, "kv_lora_rank": 1, "qk_nope_head_dim": 1, "qk_rope_head_dim": 1, "v_head_dim": 1}
        )
    moe = next((layer.ffn.cfg for layer in model.layers if layer.ffn.cfg.name == "moe"), None)
    if moe is not None:
        out["moe_renormalize"] = bool(moe.renormalize and moe.top_k > 1)
    dense = next((layer.ffn for layer in model.layers if layer.ffn.cfg.name == "dense"), None)
    if dense is None:
        out["intermediate_size"] = 1
    return out


def native_shape(layout: Layout, key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape the class of ``layout`` stores checkpoint tensor ``key`` in (Kimi Linear: KDA's
    ``A_log`` as ``[1, 1, H, 1]``); the project's own shape otherwise."""
    if layout.architecture == KIMI_LINEAR and key.endswith(".self_attn.A_log"):
        return (1, 1, *shape, 1)
    return shape
