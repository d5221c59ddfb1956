"""Synthetic ladders: losses drawn from a known saturating law with a known compute multiplier and
seed noise at the sandbox's scale, for the scaling-fit and ladder-report tests."""

from __future__ import annotations

import numpy as np

from analysis.scaling_fit import Ladder, Run

# a law at the sandbox's scale (bits per byte): 2.6 at the smallest rung, ~1.8 at 16x its compute
E, A, ALPHA, C0 = 1.3, 1.3, 0.35, 1e13


def law(compute, k: float = 1.0) -> np.ndarray:
    return E + A * (k * np.asarray(compute, float) / C0) ** -ALPHA


def synthetic_runs(
    k: float = 1.15,
    rungs: int = 5,
    seeds: int = 2,
    noise: float = 0.0075,
    correlation: float = 0.5,
    step: float = 2.0,
    overhead: float = 1.03,
    rng_seed: int = 0,
) -> list[dict]:
    """Rows of a ladder: ``rungs`` rungs ``step`` apart in compute (the variant spending ``overhead``
    times the baseline's FLOPs), ``seeds`` seeds per cell whose noise (sd ``noise``) is correlated
    across arms by ``correlation`` (the same seed sees the same batches)."""
    rng = np.random.default_rng(rng_seed)
    rows = []
    for r in range(rungs):
        c = C0 * step**r
        for s in range(seeds):
            shared = rng.standard_normal()
            for arm, compute, mult in (("baseline", c, 1.0), ("variant", c * overhead, k)):
                z = np.sqrt(correlation) * shared + np.sqrt(1 - correlation) * rng.standard_normal()
                loss = float(law(compute, mult)) + noise * z
                rows.append({"arm": arm, "rung": f"r{r}", "seed": s, "train_flops": compute, "val_bpb": loss})
    return rows


def ladder_of(rows: list[dict]) -> Ladder:
    return Ladder(Run(r["arm"], r["rung"], r["seed"], r["train_flops"], r["val_bpb"]) for r in rows)


def write_ladder_csv(path, rows: list[dict], decision: str = "block_attnres", stability: bool = True) -> None:
    """``rows`` as a ladder table with every column of the schema (analysis/ladder_report.py)."""
    import csv

    from analysis.ladder_report import REQUIRED

    columns = [*REQUIRED, "lr_edge"]
    columns += ["max_activation", "grad_norm_spikes", "maxvio"] if stability else []
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, columns)
        w.writeheader()
        for r in rows:
            params = (r["train_flops"] / 120.0) ** 0.5  # C = 6 N T with T = 20 N
            out = {
                "decision": decision,
                "arm": r["arm"],
                "rung": r["rung"],
                "seed": r["seed"],
                "non_embedding_params": round(params),
                "active_params": round(params),
                "train_tokens": round(20 * params),
                "train_flops": r["train_flops"],
                "val_bpb": r["val_bpb"],
                "val_loss": r["val_bpb"] * 0.6931,
                "lr": 3e-3 if r["rung"] != "r0" else 1e-2,
                "run_dir": f"outputs/ladder/{r['arm']}_{r['rung']}_s{r['seed']}",
                "lr_edge": "high" if r["rung"] == "r0" and r["arm"] == "variant" else "",
            }
            if stability:
                out["max_activation"] = 10.0 + float(r["train_flops"]) ** 0.1 * (2 if r["arm"] == "baseline" else 1)
                out["grad_norm_spikes"] = 3 if r["arm"] == "baseline" else 1
                out["maxvio"] = ""  # a run without routed experts has none
            w.writerow(out)


def synthetic_local(
    k: float = 1.15,
    seeds: int = 4,
    spread: float = 1.3,
    compute: float = 1e15,
    noise: float = 0.0075,
    correlation: float = 0.5,
    rng_seed: int = 0,
) -> list[dict]:
    """Rows of a local comparison: the baseline at ``compute`` / ``spread``, ``compute`` and ``compute`` x
    ``spread`` (one run per seed with cooldown branches: its three points share the seed's noise), the
    variant at ``compute`` with multiplier ``k``; a seed's noise is correlated across arms by
    ``correlation`` (the same batches), and each point adds a fifth of the noise of its own."""
    rng = np.random.default_rng(rng_seed)
    rows = []
    for s in range(seeds):
        shared = rng.standard_normal()
        lineage = np.sqrt(correlation) * shared + np.sqrt(1 - correlation) * rng.standard_normal()
        for j, c in enumerate((compute / spread, compute, compute * spread)):
            loss = float(law(c)) + noise * (lineage + 0.2 * rng.standard_normal())
            rows.append({"arm": "baseline", "rung": f"b{j}", "seed": s, "train_flops": c, "val_bpb": loss})
        own = np.sqrt(correlation) * shared + np.sqrt(1 - correlation) * rng.standard_normal()
        loss = float(law(compute, k)) + noise * (own + 0.2 * rng.standard_normal())
        rows.append({"arm": "variant", "rung": "b1", "seed": s, "train_flops": compute, "val_bpb": loss})
    return rows
