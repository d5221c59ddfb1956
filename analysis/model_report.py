"""Shapes, counts and costs of any composed configuration, from a meta-device build (no weights allocated).

    python -m analysis.model_report [overrides...] [--json] [--seq-len 4096] [--cache-bytes 2] [--state-bytes 2 4]

    python -m analysis.model_report experiment=k3_full --json

Counting convention (the K3 reference checkpoint's): every tensor the model stores -- parameters plus
persistent buffers such as the router's selection bias -- with tied weights once. "Active" parameters
are those one token uses: everything except the routed experts it does not choose (top_k of E per MoE
layer), reported with and without the input embedding table. The model card's headline ("104.2B
activated" for K3) is the figure without it (``active_params_without_embedding``), printed first; the
JSON keeps both fields under their names.

Also reported: parameters per module kind, the layer schedule, AttnRes sources per read, decode cache
bytes (per token for attention caches, per sequence for KDA's fixed state), the hybrid-vs-all-MLA cache
crossover, MLA's prefill (expanded) and decode (absorbed) multiply-adds per cached position, and the
LatentMoE budget (latent projections against the active routed expert matrices, and the full-width
configuration with the same routed expert budget).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, OrderedDict
from typing import Any, Optional

import torch
from torch import nn

from components.flop_count import parameter_counts, training_flops_per_token
from components.model import Decoder, build_on_meta
from components.registry import ConfigError
from runtime.compose import compose, strip_hydra
from runtime.validation import validate


def build_meta(overrides: list[str]) -> Decoder:
    """The composed, validated model on the meta device."""
    root = validate(strip_hydra(compose(overrides)))
    return build_on_meta(root.decoder_config())


def stored_tensors(module: nn.Module) -> "OrderedDict[str, torch.Tensor]":
    """Every tensor a checkpoint of ``module`` holds (parameters + persistent buffers), tied ones once."""
    seen, out = set(), OrderedDict()
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def _count(module: nn.Module) -> int:
    return sum(t.numel() for t in stored_tensors(module).values())


def param_counts(model: Decoder) -> dict[str, Any]:
    # the training-only MTP depths are not part of the released model: counted apart
    mtp = _count(model.mtp)
    total = _count(model) - mtp
    unchosen = sum(layer.ffn.unchosen_expert_params() for layer in model.layers)
    embedding = model.embed.weight.numel()
    kinds: Counter = Counter()
    kinds["embedding"] += embedding
    if model.lm_head.weight is not model.embed.weight:
        kinds["lm_head"] += model.lm_head.weight.numel()
    kinds["final_norm"] += _count(model.norm)
    kinds["residual"] += _count(model.residual)
    for layer in model.layers:
        kinds[f"mixer:{layer.spec.mixer.name}"] += _count(layer.mixer)
        kinds["sublayer_norms"] += _count(layer.mixer_norm) + _count(layer.ffn_norm)
        ffn = layer.ffn
        name = layer.spec.ffn.name
        experts = ffn.routed_experts()
        if experts is None:
            kinds[f"ffn:{name}"] += _count(ffn)
            continue
        routed = _count(experts)
        router = _count(ffn.router())  # routed FFNs have both (tests/contracts/test_ffns.py)
        kinds[f"ffn:{name}:routed_experts"] += routed
        kinds[f"ffn:{name}:router"] += router
        kinds[f"ffn:{name}:other"] += _count(ffn) - routed - router
    assert sum(kinds.values()) == total, (sum(kinds.values()), total)
    return {
        "total_params": total,
        "active_params": total - unchosen,
        "active_params_without_embedding": total - unchosen - embedding,
        "params_by_kind": dict(sorted(kinds.items())),
        "mtp_params": mtp,
        "mtp_active_params": mtp - sum(d.ffn.unchosen_expert_params() for d in model.mtp),
    }


def schedule(model: Decoder) -> dict[str, Any]:
    layers = [
        {"layer": i, "mixer": layer.spec.mixer.name, "ffn": layer.spec.ffn.name} for i, layer in enumerate(model.layers)
    ]
    by_mixer: dict[str, list[int]] = {}
    by_ffn: dict[str, list[int]] = {}
    for row in layers:
        by_mixer.setdefault(row["mixer"], []).append(row["layer"])
        by_ffn.setdefault(row["ffn"], []).append(row["layer"])
    return {
        "layers": layers,
        "mixer_layers": by_mixer,
        "ffn_layers": by_ffn,
        "mixer_counts": {k: len(v) for k, v in by_mixer.items()},
        "ffn_counts": {k: len(v) for k, v in by_ffn.items()},
    }


def attnres_reads(model: Decoder) -> Optional[dict[str, Any]]:
    reads = model.residual.sources_per_read()
    if reads is None:
        return None
    rows = [{"read": "final" if key == "final" else key, "sources": n} for key, n in reads]
    return {"per_read": rows, "final_read_sources": rows[-1]["sources"], "max_sources": max(r["sources"] for r in rows)}


def cache_report(model: Decoder, seq_len: int, cache_bytes: int, state_bytes: list[int]) -> dict[str, Any]:
    """Decode cache: per-token numbers of growing caches, fixed per-sequence state, and crossovers."""
    per_token = 0  # numbers per cached token, all layers
    state_recurrent = 0  # numbers per sequence (KDA's S), all layers
    state_conv = 0
    mla_like: list[nn.Module] = []
    macs: dict[str, dict[str, int]] = {}
    for layer in model.layers:
        mixer = layer.mixer
        per_token += mixer.cache_numbers_per_token()
        recurrent = mixer.recurrent_state_numbers()
        state_recurrent += recurrent
        state_conv += mixer.state_numbers() - recurrent
        if mixer.decode_macs() is not None:
            mla_like.append(mixer)
            macs.setdefault(layer.spec.mixer.name, mixer.decode_macs())
    out: dict[str, Any] = {
        "cache_bytes_per_number": cache_bytes,
        "cache_numbers_per_token": per_token,
        "cache_bytes_per_token": per_token * cache_bytes,
        "recurrent_state_numbers_per_sequence": state_recurrent,
        "conv_state_numbers_per_sequence": state_conv,
        "seq_len": seq_len,
        "cache_bytes_per_sequence": {
            f"state_{b}B": per_token * cache_bytes * seq_len + state_recurrent * b + state_conv * cache_bytes
            for b in state_bytes
        },
        "mla_macs_per_layer": macs,
    }
    # hybrid vs replacing every fixed-state layer by the growing-cache layer kind (all-MLA stack)
    fixed_layers = [layer for layer in model.layers if layer.mixer.recurrent_state_numbers() > 0]
    if fixed_layers and mla_like:
        c = mla_like[0].cache_numbers_per_token()  # numbers per token of one growing-cache layer
        per_layer_state = fixed_layers[0].mixer.recurrent_state_numbers()
        # hybrid: n_fixed * S * b + n_grow * c * cb * T ; all-MLA: (n_fixed + n_grow) * c * cb * T
        out["all_mla_crossover_tokens"] = {
            f"state_{b}B": round(per_layer_state * b / (c * cache_bytes)) for b in state_bytes
        }
    return out


def latent_budget(model: Decoder) -> Optional[dict[str, Any]]:
    layer = next((layer for layer in model.layers if layer.ffn.latent_projections() is not None), None)
    if layer is None:
        return None
    ffn, d = layer.ffn, model.d_model
    cfg = ffn.cfg
    d_l = cfg.resolved_latent_dim(d)
    m = cfg.expert_hidden_dim
    down, up = ffn.latent_projections()
    projections = down.weight.numel() + up.weight.numel()
    active_routed = cfg.top_k * ffn.routed_experts().expert_params()
    report: dict[str, Any] = {
        "d_model": d,
        "latent_dim": d_l,
        "experts": cfg.num_experts,
        "top_k": cfg.top_k,
        "expert_hidden": m,
        "latent_projection_params": projections,
        "active_routed_expert_params": active_routed,
        "latent_projection_share": projections / active_routed,
        "routed_expert_params_total": cfg.num_experts * ffn.routed_experts().expert_params(),
    }
    ratio = d / d_l
    if ratio == int(ratio) and cfg.num_experts % int(ratio) == 0 and cfg.top_k % int(ratio) == 0:
        r = int(ratio)
        E_full, k_full = cfg.num_experts // r, cfg.top_k // r
        report["full_width_equivalent"] = {
            "experts": E_full,
            "top_k": k_full,
            "routed_expert_params_total": E_full * 3 * d * m,
            "active_routed_expert_params": k_full * 3 * d * m,
            "same_budget": E_full * 3 * d * m == report["routed_expert_params_total"]
            and k_full * 3 * d * m == active_routed,
        }
    return report


def report(
    overrides: list[str], seq_len: int = 4096, cache_bytes: int = 2, state_bytes: Optional[list[int]] = None
) -> dict[str, Any]:
    run_root = validate(strip_hydra(compose(overrides)))
    model = build_on_meta(run_root.decoder_config())
    root = model.config
    out: dict[str, Any] = {
        "overrides": overrides,
        "d_model": root.model.d_model,
        "n_layers": root.model.n_layers,
        "vocab_size": root.model.vocab_size,
        "tie_embeddings": root.model.tie_embeddings,
    }
    out.update(param_counts(model))
    out["schedule"] = schedule(model)
    out["attnres"] = attnres_reads(model)
    out["cache"] = cache_report(model, seq_len, cache_bytes, state_bytes or [2, 4])
    out["latent_moe"] = latent_budget(model)
    out["compute"] = compute_report(model, run_root.data.seq_len)
    return out


def compute_report(model: Decoder, seq_len: int) -> dict[str, Any]:
    """Parameters by kind and training FLOPs per token by part at the run's sequence length, as a run's
    ``summary.json`` records them (``components/flop_count.py``)."""
    by_part = training_flops_per_token(model, seq_len)
    return {
        "params": parameter_counts(model),
        "seq_len": seq_len,
        "flops_per_token": sum(by_part.values()),
        "flops_per_token_by_part": by_part,
    }


def _ranges(idx: list[int]) -> str:
    """0,1,2,5,9,13 -> '0-2, 5, 9, 13' (0-indexed layers)."""
    parts, start = [], None
    for i, v in enumerate(idx):
        if start is None:
            start = v
        if i + 1 == len(idx) or idx[i + 1] != v + 1:
            parts.append(f"{start}" if start == v else f"{start}-{v}")
            start = None
    return ", ".join(parts)


def print_table(r: dict[str, Any]) -> None:
    print(
        f"model: d_model {r['d_model']}, {r['n_layers']} layers, vocab {r['vocab_size']:,}, tied {r['tie_embeddings']}"
    )
    print(f"total parameters            {r['total_params']:>22,}")
    # the model card's "activated" figure excludes the input embedding table (a lookup, not a product)
    print(
        f"activated (model card)      {r['active_params_without_embedding']:>22,}   per token, input embedding excluded"
    )
    print(f"active per token            {r['active_params']:>22,}   every tensor one token touches, embedding included")
    if r.get("mtp_params"):
        print(
            f"MTP layers (training only)  {r['mtp_params']:>22,}   not in the counts above "
            f"({r['mtp_active_params']:,} active per token)"
        )
    print("\nparameters by kind")
    for k, v in r["params_by_kind"].items():
        print(f"  {k:<38} {v:>22,}")
    s = r["schedule"]
    print("\nlayer schedule (0-indexed)")
    for k, v in s["mixer_layers"].items():
        print(f"  mixer {k:<10} x{len(v):<4} {_ranges(v)}")
    for k, v in s["ffn_layers"].items():
        print(f"  ffn   {k:<18} x{len(v):<4} {_ranges(v)}")
    if r["attnres"]:
        counts = [row["sources"] for row in r["attnres"]["per_read"]]
        print(f"\nAttnRes sources per read: {counts[:-1]}; final read {counts[-1]}")
    c = r["cache"]
    print(
        f"\ndecode cache: {c['cache_bytes_per_token']:,} B per token ({c['cache_bytes_per_number']} B numbers), "
        f"recurrent state {c['recurrent_state_numbers_per_sequence']:,} + conv "
        f"{c['conv_state_numbers_per_sequence']:,} numbers per sequence"
    )
    for k, v in c["cache_bytes_per_sequence"].items():
        print(f"  per sequence of {c['seq_len']:,} tokens ({k} state): {v:,} B")
    for k, v in c.get("all_mla_crossover_tokens", {}).items():
        print(f"  hybrid cache equals an all-MLA stack's at {v:,} tokens ({k} state)")
    for kind, m in c["mla_macs_per_layer"].items():
        print(
            f"  {kind}: prefill {m['prefill_macs_per_cached_position']:,} / decode "
            f"{m['decode_macs_per_cached_position']:,} multiply-adds per cached position per layer"
        )
    comp = r["compute"]
    print(
        f"\ntraining FLOPs per token at {comp['seq_len']:,} tokens (forward + backward): {comp['flops_per_token']:,.0f}"
    )
    for part, flops in comp["flops_per_token_by_part"].items():
        share = flops / comp["flops_per_token"] if comp["flops_per_token"] else 0.0
        print(f"  {part:<10} {flops:>22,.0f}   {100 * share:5.1f}%")
    lb = r["latent_moe"]
    if lb:
        print(
            f"\nLatentMoE: latent projections {lb['latent_projection_params']:,} = "
            f"{100 * lb['latent_projection_share']:.1f}% "
            f"of the active routed expert matrices ({lb['active_routed_expert_params']:,})"
        )
        fw = lb.get("full_width_equivalent")
        if fw:
            print(
                f"  {lb['experts']}-choose-{lb['top_k']} at width {lb['latent_dim']} = "
                f"{fw['experts']}-choose-{fw['top_k']} at width "
                f"{lb['d_model']} in routed expert budget: {fw['same_budget']} ({fw['routed_expert_params_total']:,} "
                f"total, {fw['active_routed_expert_params']:,} active)"
            )


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--cache-bytes", type=int, default=2, help="bytes per cached number (2: bf16)")
    p.add_argument("--state-bytes", type=int, nargs="+", default=[2, 4], help="bytes per KDA state number")
    args = p.parse_args(argv)
    try:
        r = report(args.overrides, args.seq_len, args.cache_bytes, args.state_bytes)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(r, indent=1))
    else:
        print_table(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
