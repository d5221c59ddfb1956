"""How many GPUs a composed model needs, and on which mesh: per-GPU memory of FSDP2 with expert parallelism.

    python -m analysis.parallel_plan experiment=k3_full --gpu h100 --seq 4096
    python -m analysis.parallel_plan experiment=k3_full --gpu h200 --seq 8192 --micro-batch 1 2 --json

The model is built on the meta device (nothing allocated) and counted by ``runtime/memory_accounting.py``,
the accounting the pre-flight memory check uses: for each candidate mesh -- GPU count, expert-parallel
size ``ep`` (``trainer.expert_parallel``), activation checkpointing off and on, micro-batch -- the
fullest rank's fp32 weights, gradients and optimizer state (sharded exactly as FSDP2 pads them), the
all-gathered units (the largest with its prefetched neighbour), activations, the all-to-all and
reduce-scatter buffers, the optimizer step's transient and a runtime reserve; then the smallest GPU
count that fits the GPU's memory (each ``(ep, checkpointing)`` searched by bisection over whole nodes),
with the overrides that train on it. Counts are exact; activations and buffers are estimates whose rules
the accounting module states.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional

from components.registry import ConfigError
from runtime import memory_accounting as accounting
from runtime.cli import int_at_least, reports_errors
from runtime.compose import compose, strip_hydra
from runtime.memory_check import mesh_overrides
from runtime.validation import validate

PRECISIONS = ("bf16-mixed", "32-true")


def candidate_meshes(inv: accounting.Inventory, fit: Optional[accounting.MemoryPlan], gpus_per_node: int) -> list:
    """(GPUs, ep) rows of the table: power-of-two GPU counts from an eighth of the fit to twice it (without a
    fit: one node to 4,096 GPUs), and the fit's own count; at each, plain FSDP (ep 1), the fit's ep, and the
    ep that gathers least (the smallest such ep)."""
    low, top = (max(1, fit.gpus // 8), 2 * fit.gpus) if fit else (gpus_per_node, 4096)
    counts = {g for g in accounting.candidate_gpu_counts(gpus_per_node, top) if g & (g - 1) == 0 and low <= g}
    if fit:
        counts.add(fit.gpus)
    rows = []
    for g in sorted(counts):
        eps = [e for e in inv.expert_parallel_sizes() if g % e == 0]
        best = min(eps, key=lambda e: (accounting.gathered_peak(inv, e)["peak_numbers"], e))
        for ep in (1, fit.ep if fit and g == fit.gpus else 1, best):
            if (g, ep) not in rows:
                rows.append((g, ep))
    return rows


def build_plan(
    overrides: list[str],
    gpu: str,
    seq_len: int,
    micro_batches: list[int],
    gpus_per_node: int = 8,
    precision: str = "bf16-mixed",
    max_gpus: int = 16384,
) -> dict[str, Any]:
    root = validate(strip_hydra(compose(overrides)))
    inv = accounting.inventory_for(root)
    device = accounting.GPUS[gpu]
    capacity = device.memory_bytes
    out: dict[str, Any] = {
        "overrides": overrides,
        "gpu": {"name": device.name, "memory_bytes": capacity},
        "seq_len": seq_len,
        "precision": precision,
        "gpus_per_node": gpus_per_node,
        "max_gpus": max_gpus,
        "model": model_summary(inv),
        "micro_batches": [],
    }
    for mb in micro_batches:
        fit = accounting.smallest_fit(inv, capacity, seq_len, mb, precision, gpus_per_node, max_gpus)
        no_ac = accounting.smallest_fit(inv, capacity, seq_len, mb, precision, gpus_per_node, max_gpus, (False,))
        rows = []
        for gpus, ep in candidate_meshes(inv, fit, gpus_per_node):
            pair = [
                accounting.plan(inv, accounting.Mesh(gpus, ep, ac, mb, seq_len), capacity, precision).as_dict()
                for ac in (False, True)
            ]
            rows.append({"without_checkpointing": pair[0], "with_checkpointing": pair[1]})
        out["micro_batches"].append(
            {
                "micro_batch": mb,
                "smallest_fit": fit.as_dict() if fit else None,
                "overrides": mesh_overrides(fit, gpus_per_node) if fit else None,
                "smallest_fit_without_checkpointing": no_ac.as_dict() if no_ac else None,
                "traffic_per_micro_step": accounting.traffic_bytes(
                    inv, accounting.Mesh(fit.gpus, fit.ep, fit.activation_checkpointing, mb, seq_len), precision
                )
                if fit
                else None,
                "candidates": rows,
            }
        )
    return out


def model_summary(inv: accounting.Inventory) -> dict[str, Any]:
    largest = max(inv.units, key=lambda u: u.gathered(1))
    return {
        "total_params": inv.total_params,
        "expert_params": inv.expert_params,
        "moe_layers": inv.moe_layers,
        "num_experts": inv.num_experts,
        "top_k": inv.top_k,
        "routed_width": inv.routed_width,
        "optimizer": inv.optimizer,
        "muon_params": inv.muon_params,
        "adamw_params": inv.adamw_params,
        "largest_unit": {"name": largest.name, "dense_params": largest.dense, "expert_params": largest.experts},
        "units": [{"name": u.name, "dense_params": u.dense, "expert_params": u.experts} for u in inv.units],
        "root_params": inv.root,
    }


def _gpus(n: int) -> str:
    return f"{n:,} GPU{'' if n == 1 else 's'}"


def _g(n: int) -> str:
    return f"{n / accounting.GiB:.1f}"


def print_plan(r: dict[str, Any]) -> None:
    m = r["model"]
    print(f"model ({' '.join(r['overrides']) or 'defaults'}): {m['total_params']:,} parameters")
    if m["moe_layers"]:
        print(
            f"  routed experts {m['expert_params']:,}: {m['moe_layers']} MoE layers x {m['num_experts']} experts, "
            f"top-{m['top_k']}, (token, slot) rows of width {m['routed_width']:,} in the all-to-all"
        )
    if m["muon_params"]:
        print(
            f"  optimizer muon: {m['muon_params']:,} orthogonalised (one fp32 momentum), "
            f"{m['adamw_params']:,} by AdamW (two fp32 moments)"
        )
    else:
        print(f"  optimizer {m['optimizer']}: two fp32 moments per parameter")
    u = m["largest_unit"]
    print(f"  largest FSDP unit {u['name']}: {u['dense_params']:,} + {u['expert_params']:,} routed (gathered: / ep)")
    g = r["gpu"]
    print(
        f"GPU {g['name']} ({_g(g['memory_bytes'])} GiB), {r['gpus_per_node']} per node; seq {r['seq_len']:,}, "
        f"{r['precision']}"
    )
    for block in r["micro_batches"]:
        print(f"\nmicro-batch {block['micro_batch']} (sequences per GPU)")
        fit = block["smallest_fit"]
        if fit:
            ac = "with" if fit["activation_checkpointing"] else "without"
            print(
                f"  smallest mesh that fits: {_gpus(fit['gpus'])}, ep {fit['ep']} x efsdp {fit['efsdp']}, {ac} "
                f"activation checkpointing, {_g(fit['total'])} GiB per GPU\n    {block['overrides']}"
            )
            t = block["traffic_per_micro_step"]
            print(
                f"  each GPU receives per micro-step: all-gather {t['all_gather'] / 1e9:,.0f} GB, reduce-scatter "
                f"{t['reduce_scatter'] / 1e9:,.0f} GB, all-to-all {t['all_to_all'] / 1e9:,.0f} GB"
            )
        else:
            print(
                f"  no mesh of up to {r['max_gpus']:,} GPUs fits: activations, gathered units, buffers and the reserve "
                "do not shrink with more GPUs, nor does a rank's share of the experts below one whole expert per "
                "MoE layer"
            )
        no_ac = block["smallest_fit_without_checkpointing"]
        if fit and fit["activation_checkpointing"]:
            plain = f"{_gpus(no_ac['gpus'])} (ep {no_ac['ep']})" if no_ac else "none"
            print(f"  without activation checkpointing: {plain}")
        print(
            "\n   GPUs  nodes    ep efsdp  experts  weights  grads  optim  units  act/AC  act  a2a    RS  step  "
            "reserve  total/AC  total  fits/AC fits"
        )
        for row in block["candidates"]:
            a, c = row["without_checkpointing"], row["with_checkpointing"]
            nodes = max(1, a["gpus"] // r["gpus_per_node"])
            print(
                f"  {a['gpus']:>5} {nodes:>6} {a['ep']:>5} {a['efsdp']:>5} "
                f"{a['experts_gathered']:>4}/{a['experts_stored']:<3} "
                f"{_g(a['weights']):>8} {_g(a['gradients']):>6} {_g(a['optimizer_state']):>6} "
                f"{_g(a['gathered_units']):>6} {_g(c['activations']):>7} {_g(a['activations']):>5} "
                f"{_g(a['all_to_all']):>4} {_g(a['reduce_scatter']):>5} {_g(a['optimizer_step']):>5} "
                f"{_g(a['reserve']):>8} {_g(c['total']):>9} {_g(a['total']):>6} "
                f"{'yes' if c['fits'] else 'no':>8} {'yes' if a['fits'] else 'no':>4}"
            )
    print(
        "\nGiB per GPU, fullest rank. experts: whole experts per MoE layer each rank runs / stores; units: gathered "
        "parameters (unit + prefetch + unsharded gradients); act: activations (AC: with activation checkpointing); "
        "a2a: all-to-all send + receive; RS: reduce-scatter input (fp32); step: the optimizer step's transient "
        "(overlaps activations, not added to them)."
    )


@reports_errors("analysis.parallel_plan", ConfigError)
def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="analysis.parallel_plan", description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    p.add_argument("--gpu", required=True, choices=sorted(accounting.GPUS), help="the GPU whose memory must hold it")
    p.add_argument("--seq", type=int_at_least(1), required=True, help="tokens per sequence")
    p.add_argument("--micro-batch", type=int_at_least(1), nargs="+", default=[1], help="sequences per GPU")
    p.add_argument("--gpus-per-node", type=int_at_least(1), default=8)
    p.add_argument("--precision", choices=PRECISIONS, default="bf16-mixed", help="the run's trainer.precision")
    p.add_argument("--max-gpus", type=int_at_least(1), default=16384, help="the largest mesh searched")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    r = build_plan(
        args.overrides, args.gpu, args.seq, args.micro_batch, args.gpus_per_node, args.precision, args.max_gpus
    )
    if args.json:
        print(json.dumps(r, indent=1))
    else:
        print_plan(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
