"""``config.json`` of an exported model.

Two parts. The released K3 text schema (flat text fields, KDA settings in the nested
``linear_attn_config`` with 1-based layer lists, ``attn_res_block_size``, ``num_nextn_predict_layers``),
filled from the composed model wherever a field applies, so tools that read the release read the
export. And ``k3_sandbox``: the run's whole composed config, from which
``runtime.load_run.load_exported`` rebuilds the exact model. ``checkpoint_config`` labels the model as
the project's registered class (``model_type: k3_sandbox``); ``components/hf/export_folder.py`` labels
an export with the class that computes it (Llama, Kimi Linear, the release's ``kimi_k3`` schema).
"""

from __future__ import annotations

import json
import os
from typing import Any

from components.model import Decoder

RELEASED_MIXERS = {"kda", "mla"}
RELEASED_FFNS = {"dense", "moe", "latent_moe", "stable_latent_moe"}
RELEASED_RESIDUALS = {"plain", "block_attnres", "full_attnres"}
SANDBOX_KEY = "k3_sandbox"
# the run's tokenizer as a prepared folder's meta.json describes it (kind, spec, hash, special ids), so
# the folder's tokenizer.json loads through the same checked loader as a prepared data folder's
TOKENIZER_KEY = "k3_sandbox_tokenizer"


def _names(model: Decoder) -> tuple[list[str], list[str]]:
    return [layer.mixer.cfg.name for layer in model.layers], [layer.ffn.cfg.name for layer in model.layers]


def is_release_family(model: Decoder, residual_name: str) -> bool:
    mixers, ffns = _names(model)
    return set(mixers) <= RELEASED_MIXERS and set(ffns) <= RELEASED_FFNS and residual_name in RELEASED_RESIDUALS


def checkpoint_config(root: Any, model: Decoder, run_config: dict) -> dict:
    """The ``config.json`` dict of ``model`` composed by ``root`` (``run_config``: its plain dict)."""
    mixers, ffns = _names(model)
    n = len(model.layers)
    cfg: dict[str, Any] = {
        # the project's own class: components/hf/export_folder.py relabels what a transformers class
        # computes exactly (components/hf/native.py); a K3 export is never Kimi-Linear-48B's class
        "architectures": ["K3SandboxForCausalLM"],
        "model_type": SANDBOX_KEY,
        "vocab_size": model.embed.weight.shape[0],
        "hidden_size": model.embed.weight.shape[1],
        "num_hidden_layers": n,
        "rms_norm_eps": root.model.norm_eps,
        "tie_word_embeddings": model.lm_head.weight is model.embed.weight,
        "num_nextn_predict_layers": len(model.mtp),
        "torch_dtype": "float32",
    }
    dense = next((layer.ffn.cfg for layer in model.layers if layer.ffn.cfg.name == "dense"), None)
    routed = next((layer.ffn for layer in model.layers if layer.ffn.routed_experts() is not None), None)
    act_cfg = dense or (routed.cfg if routed is not None else None)
    if act_cfg is not None:
        cfg["hidden_act"] = (
            "situ"
            if act_cfg.activation == "situ_glu"
            else act_cfg.activation.replace("_glu", "").replace("swiglu", "silu")
        )
        if act_cfg.activation == "situ_glu":
            cfg["activation_situ_beta"] = act_cfg.situ_beta
            cfg["activation_situ_linear_beta"] = act_cfg.situ_linear_beta
    if dense is not None:
        cfg["intermediate_size"] = model.layers[ffns.index("dense")].ffn.gate_proj.weight.shape[0]
        cfg["first_k_dense_replace"] = next((i for i, f in enumerate(ffns) if f != "dense"), n)
    if routed is not None:
        r = routed.cfg
        cfg.update(
            {
                "num_experts": r.num_experts,
                "num_experts_per_token": r.top_k,
                "moe_intermediate_size": r.expert_hidden_dim,
                "num_shared_experts": r.num_shared_experts,
                "moe_renormalize": r.renormalize,
                "moe_router_activation_func": r.router_activation,
                "routed_scaling_factor": r.routed_scaling_factor,
                "moe_layer_freq": 1,
                "topk_method": "noaux_tc",
                "use_grouped_topk": True,
                "num_expert_group": 1,
                "topk_group": 1,
            }
        )
        if routed.latent:
            cfg["routed_expert_hidden_size"] = routed.routed_expert_down_proj.weight.shape[0]
            cfg["latent_moe_use_norm"] = bool(routed.stable)
    mla = next((layer.mixer.cfg for layer in model.layers if layer.mixer.cfg.name == "mla"), None)
    if mla is not None:
        cfg.update(
            {
                "num_attention_heads": mla.n_heads,
                "num_key_value_heads": mla.n_heads,
                "q_lora_rank": mla.q_lora_rank,
                "kv_lora_rank": mla.kv_lora_rank,
                "qk_nope_head_dim": mla.qk_nope_head_dim,
                "qk_rope_head_dim": mla.qk_rope_head_dim,
                "v_head_dim": mla.v_head_dim,
                "mla_use_nope": not mla.rope,
                "mla_use_output_gate": mla.output_gate,
                "rope_theta": mla.rope_theta,
            }
        )
    kda = next((layer.mixer.cfg for layer in model.layers if layer.mixer.cfg.name == "kda"), None)
    if kda is not None:
        cfg["linear_attn_config"] = {
            "num_heads": kda.n_heads,
            "head_dim": kda.head_dim,
            "short_conv_kernel_size": kda.conv_size,
            "gate_lower_bound": kda.gate_lower_bound,
            "use_full_rank_gate": kda.full_rank_gate,
            "kda_layers": [i + 1 for i, m in enumerate(mixers) if m == "kda"],
            "full_attn_layers": [i + 1 for i, m in enumerate(mixers) if m != "kda"],
        }
    if root.residual.name == "block_attnres":
        cfg["attn_res_block_size"] = root.residual.block_size
    elif root.residual.name == "full_attnres":
        cfg["attn_res_block_size"] = 1
    cfg[SANDBOX_KEY] = run_config
    return cfg


def write_config(cfg: dict, folder: str) -> None:
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=False)
        f.write("\n")


def read_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: unreadable ({err})") from None
