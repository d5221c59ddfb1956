"""A scaling ladder: one K3 decision's two arms trained at several sizes with compute-proportional budgets.

``python -m sweeps.run ladder DECISION [--preset cpu|gpu] [--jobs N] [--dry-run] [overrides...]``

A decision is ``sweeps/ladders/<DECISION>.yaml`` (``baseline`` and ``variant``: override lists, e.g.
``experiment=k3_small_plain_residual`` against ``experiment=k3_small``); a preset is
``sweeps/ladders/presets/<PRESET>.yaml`` (the rungs, tokens per parameter, seeds, learning-rate sweep,
data and trainer). Rung sizes follow one rule that keeps K3's shape (``sweeps/ladder_rungs.py``).

The ladder runs in three phases, each as many runs at once as ``--jobs`` allows:

1. learning rates: each arm at the ``lr.sweep_rungs`` smallest rungs, seed ``seeds[0]``, at every
   ``lr.factors`` x ``lr.base``, on the smallest token budget. The best rate per arm and rung is fitted
   as a power of the active parameters and applied to every rung of that arm (equal tuning for both
   arms); a best rate at the edge of its sweep is flagged (``lr_edge`` in ``ladder.csv``).
2. stable runs: each arm x rung x seed, warmup-stable-decay to ``tokens_per_param`` tokens per active
   parameter, checkpointed where the branches start;
3. cooldown branches: for each of ``branch_multiples`` (fewer tokens per parameter), a branch from the
   stable run's checkpoint at the step its own decay begins (``init_from``), decaying to its budget: a
   second compute point per rung for a tenth of the stable run's cost or so.

Every run has a fixed name, so the same command after an interruption skips finished runs and resumes
the others from their last checkpoint (``ckpt_path=last``). The ladder folder
``<output-root>/ladders/<DECISION>-<PRESET>/`` ends with ``ladder.csv`` (one row per compute point)
and, per token multiple, the fits and figures of ``python -m analysis.ladder`` in ``tpp<M>/``.
``--dry-run`` prints every run with its parameters, tokens and FLOPs and the estimated time: on a CPU
preset from a few measured steps per rung (``--measure-steps``), on a GPU preset in GPU-hours at the
preset's peak and MFU.
"""

from __future__ import annotations

import argparse
import csv
import glob
import hashlib
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import yaml

from runtime.rate_probe import Rate, probe_rate
from sweeps.ladder_rungs import Rung

LADDERS = Path(__file__).resolve().parent / "ladders"
PRESETS = LADDERS / "presets"
REPO = LADDERS.parent.parent
ARMS = ("baseline", "variant")


class LadderError(ValueError):
    """A ladder or preset that cannot run; the message names the file and key."""


# -- definitions ---------------------------------------------------------------------------------------
def _names(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.yaml"))


def _read(folder: Path, name: str, kind: str, allowed: tuple[str, ...], required: tuple[str, ...]) -> dict:
    path = folder / f"{name}.yaml"
    if not path.is_file():
        raise LadderError(f"{kind} '{name}' not found; {kind}s: {', '.join(_names(folder))}")
    data = yaml.safe_load(path.read_text()) or {}
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise LadderError(f"{path.name}: unknown keys {', '.join(unknown)}; allowed: {', '.join(allowed)}")
    missing = [k for k in required if k not in data]
    if missing:
        raise LadderError(f"{path.name}: missing {', '.join(missing)}")
    return data


def decision_names() -> list[str]:
    return _names(LADDERS)


def load_decision(name: str) -> dict[str, Any]:
    d = _read(LADDERS, name, "decision", ("description", *ARMS), ARMS)
    for arm in ARMS:
        if not isinstance(d[arm], list) or not all(isinstance(o, str) for o in d[arm]):
            raise LadderError(f"{name}.yaml: {arm} must be a list of overrides")
    return d


@dataclass
class Preset:
    name: str
    rungs: list[Rung]
    tokens_per_param: float
    branch_multiples: list[float]
    seeds: list[int]
    lr_base: float
    lr_factors: list[float]
    lr_sweep_rungs: int
    warmup_fraction: float
    decay_fraction: float
    overrides: list[str]
    # GPU presets: dry-run accounting composes with these instead of the data the runs read
    accounting_overrides: list[str] = field(default_factory=list)
    peak_flops: Optional[float] = None
    mfu: Optional[float] = None
    description: str = ""


PRESET_KEYS = (
    "description",
    "rungs",
    "tokens_per_param",
    "branch_multiples",
    "seeds",
    "lr",
    "warmup_fraction",
    "decay_fraction",
    "overrides",
    "accounting_overrides",
    "gpu",
)


def load_preset(name: str) -> Preset:
    """A preset by name (``sweeps/ladders/presets/NAME.yaml``) or by the path of a YAML file."""
    folder, stem = PRESETS, name
    if name.endswith((".yaml", ".yml")):
        folder, stem = Path(name).resolve().parent, Path(name).stem
    required = ("rungs", "tokens_per_param", "seeds", "lr", "overrides")
    p = _read(folder, stem, "preset", PRESET_KEYS, required)
    where = f"presets/{name}.yaml" if folder == PRESETS else name
    name = stem
    rungs = [Rung(int(d), int(n)) for d, n in p["rungs"]]
    for rung in rungs:
        try:
            rung.check()
        except ValueError as err:
            raise LadderError(f"{where}: rungs: {err}") from None
    if len(rungs) < 2:
        raise LadderError(f"{where}: rungs: a ladder needs at least 2 rungs")
    lr = p["lr"]
    tpp = float(p["tokens_per_param"])
    branches = sorted(float(m) for m in p.get("branch_multiples") or [])
    if any(not 0 < m < tpp for m in branches):
        raise LadderError(f"{where}: branch_multiples must lie between 0 and tokens_per_param={tpp}")
    gpu = p.get("gpu") or {}
    preset = Preset(
        name=name,
        rungs=rungs,
        tokens_per_param=tpp,
        branch_multiples=branches,
        seeds=[int(s) for s in p["seeds"]],
        lr_base=float(lr["base"]),
        lr_factors=sorted(float(f) for f in lr.get("factors", [1.0])),
        lr_sweep_rungs=int(lr.get("sweep_rungs", 2)),
        warmup_fraction=float(p.get("warmup_fraction", 0.05)),
        decay_fraction=float(p.get("decay_fraction", 0.2)),
        overrides=list(p["overrides"]),
        accounting_overrides=list(p.get("accounting_overrides") or []),
        peak_flops=float(gpu["peak_flops"]) if "peak_flops" in gpu else None,
        mfu=float(gpu["mfu"]) if "mfu" in gpu else None,
        description=p.get("description", ""),
    )
    if not 1 <= preset.lr_sweep_rungs <= len(rungs):
        raise LadderError(f"{where}: lr.sweep_rungs must be between 1 and the number of rungs ({len(rungs)})")
    return preset


# -- accounting ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Size:
    non_embedding_params: int
    active_params: int
    flops_per_token: float
    tokens_per_step: int


def account(overrides: list[str]) -> Size:
    """Parameters, training FLOPs per token and tokens per step of a composition (built on meta)."""
    from components.flop_count import parameter_counts, training_flops_per_token
    from components.model import build_on_meta
    from runtime.launch import compose, strip_hydra
    from runtime.validation import validate

    root = validate(strip_hydra(compose(overrides)))
    model = build_on_meta(root.decoder_config())
    params = parameter_counts(model)
    seq_len = root.data.seq_len
    flops = sum(training_flops_per_token(model, seq_len).values())
    tokens_per_step = root.data.batch_size * seq_len * root.trainer.accumulate_grad_batches
    return Size(params["non_embedding"], params["active"], flops, tokens_per_step)


# -- the plan ------------------------------------------------------------------------------------------
@dataclass
class LadderRun:
    name: str
    phase: str  # lr | stable | branch
    arm: str
    rung: Rung
    seed: int
    tokens_per_param: float
    steps: int
    warmup: int
    size: Size
    lr_factor: Optional[float] = None  # lr phase: the factor of lr.base this run tries
    lr: Optional[float] = None  # stable and branch runs: chosen after the lr phase
    branch_of: Optional[str] = None
    init_from: Optional[str] = None  # the stable run's folder, once it has finished
    init_step: Optional[int] = None
    checkpoint_every: Optional[int] = None

    @property
    def tokens(self) -> int:
        return self.steps * self.size.tokens_per_step

    @property
    def flops(self) -> float:
        return self.tokens * self.size.flops_per_token

    @property
    def cost_flops(self) -> float:
        """FLOPs this run itself spends (a branch starts at its init_step)."""
        return (self.steps - (self.init_step or 0)) * self.size.tokens_per_step * self.size.flops_per_token


def _steps(tokens_per_param: float, size: Size) -> int:
    return max(1, math.ceil(tokens_per_param * size.active_params / size.tokens_per_step))


def plan(decision: str, preset: Preset, extra: list[str], arms_overrides: dict[str, list[str]]) -> list[LadderRun]:
    """Every run of the ladder, the learning rates of the stable and branch runs still open."""
    from components.optim.schedules.wsd import decay_start  # the schedule the runs train under

    runs: list[LadderRun] = []
    arm_slugs = {arm: arm_slug(arms_overrides[arm]) for arm in ARMS}
    if arm_slugs["baseline"] == arm_slugs["variant"]:  # an A/A ladder: the same runs twice would be one set
        arm_slugs = {arm: f"{arm_slugs[arm]}-{arm}" for arm in ARMS}
    smallest = preset.branch_multiples[0] if preset.branch_multiples else preset.tokens_per_param
    for arm in ARMS:
        for i, rung in enumerate(preset.rungs):
            size = account(arm_overrides(arms_overrides[arm], rung, preset, extra, accounting=True))
            total = _steps(preset.tokens_per_param, size)
            warmup = max(1, round(preset.warmup_fraction * _steps(smallest, size)))
            starts = []
            for m in preset.branch_multiples:
                branch_steps = _steps(m, size)
                start = decay_start(branch_steps, warmup, preset.decay_fraction)
                if start >= decay_start(total, warmup, preset.decay_fraction):
                    raise LadderError(
                        f"rung {rung.name}: the {m:g}-tokens-per-parameter branch would start inside the "
                        "stable run's decay; use a smaller branch multiple"
                    )
                starts.append((m, branch_steps, start))
            every = math.gcd(*[s for _, _, s in starts]) if starts else None
            if i < preset.lr_sweep_rungs:
                for f in preset.lr_factors:
                    lr_steps = _steps(smallest, size)
                    runs.append(
                        LadderRun(
                            f"{arm_slugs[arm]}-{rung.name}-lr{f:g}",
                            "lr",
                            arm,
                            rung,
                            preset.seeds[0],
                            smallest,
                            lr_steps,
                            warmup,
                            size,
                            lr_factor=f,
                        )
                    )
            for seed in preset.seeds:
                stable = f"{arm_slugs[arm]}-{rung.name}-s{seed}"
                runs.append(
                    LadderRun(
                        stable,
                        "stable",
                        arm,
                        rung,
                        seed,
                        preset.tokens_per_param,
                        total,
                        warmup,
                        size,
                        checkpoint_every=every,
                    )
                )
                for m, branch_steps, start in starts:
                    runs.append(
                        LadderRun(
                            f"{stable}-tpp{m:g}",
                            "branch",
                            arm,
                            rung,
                            seed,
                            m,
                            branch_steps,
                            warmup,
                            size,
                            branch_of=stable,
                            init_step=start,
                        )
                    )
    return runs


def arm_slug(arm: list[str]) -> str:
    """A run-name stem that says what an arm trains (``experiment=k3_small`` -> ``k3_small``): runs are
    named by what they train, so two decisions that share an arm share its runs."""
    parts = [o.split("=", 1)[1] if o.startswith("experiment=") else o for o in arm]
    slug = re.sub(r"[^A-Za-z0-9_.=+-]", "_", "+".join(parts)) or "default"
    if len(slug) > 60:
        slug = slug[:48] + "-" + hashlib.sha1(slug.encode()).hexdigest()[:8]
    return slug


def runs_folder(output_root: Path, preset: Preset, extra: list[str]) -> Path:
    """Where a preset's runs live, shared by every decision trained at it: ``ladders/runs-<preset>-<hash>``,
    the hash over everything that shapes a run (the preset's settings and the command line's overrides),
    so a changed preset or override never reuses a run trained under the old one."""
    identity = {k: v for k, v in asdict(preset).items() if k not in ("name", "description")}
    identity["extra"] = list(extra)
    digest = hashlib.sha1(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return output_root / "ladders" / f"runs-{preset.name}-{digest}"


def arm_overrides(arm: list[str], rung: Rung, preset: Preset, extra: list[str], accounting: bool = False) -> list[str]:
    """The arm's overlay, the preset's settings, the rung's sizes, then the command line's: one override
    per key, the last given winning."""
    from runtime.sweep_job import split_override

    base = preset.overrides + (preset.accounting_overrides if accounting else [])
    merged: dict[str, str] = {}
    for override in [*arm, *base, *rung.overrides(), *extra]:
        merged[split_override(override)[0]] = override
    return list(merged.values())


def run_overrides(run: LadderRun, arm: list[str], preset: Preset, extra: list[str], runs_dir: Path) -> list[str]:
    """The ``train.py`` overrides of one run of the ladder."""
    lr = run.lr if run.lr is not None else preset.lr_base * (run.lr_factor or 1.0)
    out = [
        *arm_overrides(arm, run.rung, preset, []),
        "schedule=wsd",
        f"schedule.decay_fraction={preset.decay_fraction}",
        f"optimizer.lr={lr:.6g}",
        f"optimizer.warmup_steps={run.warmup}",
        f"trainer.max_steps={run.steps}",
        # validation at the end only: the same validation bytes score every run of the ladder
        f"trainer.val_check_interval={run.steps}",
        "trainer.max_time_minutes=null",
        f"seed={run.seed}",
        f"name={run.name}",
        "ckpt_path=last",
    ]
    if run.checkpoint_every:
        out += [f"trainer.checkpoint_every_n_steps={run.checkpoint_every}", "trainer.keep_last_checkpoints=null"]
    if run.branch_of:
        out += [f"init_from={run.init_from or runs_dir / run.branch_of}", f"init_step={run.init_step}"]
    return [*out, *extra]


# -- state ---------------------------------------------------------------------------------------------
def finished_summary(runs_dir: Path, name: str) -> Optional[dict[str, Any]]:
    """The summary of ``name``'s finished run (all its planned steps), if there is one."""
    for folder in [runs_dir / name, *sorted(runs_dir.glob(f"{glob.escape(name)}-[0-9]*"))]:
        path = folder / "summary.json"
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if summary.get("steps") and summary.get("steps") == summary.get("planned_steps"):
            return summary
    return None


def _val_loss(summary: dict[str, Any]) -> float:
    return float(summary["val"]["loss"])


def best_log_lr(trials: list[tuple[float, float]]) -> float:
    """The best log learning rate of a sweep's ``(log lr, loss)`` trials: the vertex of the parabola
    through the best trial and its two neighbours, kept between those neighbours (a sweep of factors 2
    apart would otherwise round the optimum to a factor of 2, and two rungs whose optima differ by less
    would look equal: a rate fitted flat across sizes). At an edge of the sweep, or where the three do not
    bend upwards, the best trial itself."""
    ordered = sorted(trials)
    losses = [loss if math.isfinite(loss) else math.inf for _, loss in ordered]
    i = min(range(len(ordered)), key=lambda j: (losses[j], j))
    if i == 0 or i == len(ordered) - 1 or not math.isfinite(losses[i - 1] + losses[i + 1]):
        return ordered[i][0]
    (x0, y0), (x1, y1), (x2, y2) = ordered[i - 1], ordered[i], ordered[i + 1]
    # the parabola's vertex through three points (Newton's divided differences)
    d01, d12 = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
    curvature = (d12 - d01) / (x2 - x0)
    if curvature <= 0:
        return x1
    vertex = 0.5 * (x0 + x1) - d01 / (2 * curvature)
    return min(max(vertex, x0), x2)


def choose_learning_rates(
    runs: list[LadderRun], summaries: dict[str, dict[str, Any]], preset: Preset
) -> dict[str, tuple[dict[str, float], dict[str, str]]]:
    """Per arm: ({rung name: learning rate}, {swept rung name: "low" / "high" where its best rate sat at
    that edge of the sweep, else ""}). The best rate at each swept rung (``best_log_lr``: between sweep
    points where the losses bend) is fitted as ``log lr = a + b log N`` (N active parameters) and applied
    to every rung."""
    out = {}
    for arm in ARMS:
        swept = {}
        for run in runs:
            if run.phase == "lr" and run.arm == arm and run.name in summaries:
                swept.setdefault(run.rung.name, []).append((_val_loss(summaries[run.name]), run.lr_factor, run))
        points, edges = [], {}
        for rung_name, trials in swept.items():
            loss, factor, run = min(trials, key=lambda t: (t[0], t[1]))
            if not math.isfinite(loss):
                raise LadderError(f"{arm} at {rung_name}: every learning rate of the sweep diverged")
            log_lr = best_log_lr([(math.log(preset.lr_base * f), loss) for loss, f, _ in trials])
            points.append((math.log(run.size.active_params), log_lr))
            edges[rung_name] = ""  # inside the sweep, or the edge it sits at (analysis.ladder flags it)
            if len(preset.lr_factors) > 1 and factor == preset.lr_factors[0]:
                edges[rung_name] = "low"
            elif len(preset.lr_factors) > 1 and factor == preset.lr_factors[-1]:
                edges[rung_name] = "high"
        if not points:
            raise LadderError(f"{arm}: no finished learning-rate runs")
        if len(points) == 1:
            slope, intercept = 0.0, points[0][1]
        else:
            xs, ys = zip(*points)
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            sxx = sum((x - mx) ** 2 for x in xs)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
            intercept = my - slope * mx
        rates = {}
        for run in runs:
            if run.arm == arm and run.phase != "lr":
                rates[run.rung.name] = math.exp(intercept + slope * math.log(run.size.active_params))
        out[arm] = (rates, edges)
    return out


def ladder_rows(
    decision: str, runs: list[LadderRun], summaries: dict[str, dict[str, Any]], edges: dict[str, dict[str, str]]
) -> list[dict[str, Any]]:
    """One ``ladder.csv`` row per finished stable or branch run: a compute point of one arm."""
    rows = []
    for run in runs:
        if run.phase == "lr" or run.name not in summaries:
            continue
        s = summaries[run.name]
        compute = s.get("compute") or {}
        params = compute.get("params") or {}
        rows.append(
            {
                "decision": decision,
                "arm": run.arm,
                "rung": run.rung.name if run.phase == "stable" else f"{run.rung.name}@tpp{run.tokens_per_param:g}",
                "seed": run.seed,
                "tokens_per_param": run.tokens_per_param,
                "non_embedding_params": params.get("non_embedding", run.size.non_embedding_params),
                "active_params": params.get("active", run.size.active_params),
                "train_tokens": s.get("train_tokens", run.tokens),
                "train_flops": compute.get("train_flops", run.flops),
                "val_bpb": s["val"].get("bpb", float("nan")),
                "val_loss": s["val"]["loss"],
                "lr": run.lr,
                "lr_edge": edges.get(run.arm, {}).get(run.rung.name, ""),
                "run_dir": s.get("run_dir", ""),
                **stability_metrics(s.get("run_dir", "")),
            }
        )
    return rows


# the balancers' mean MaxVio as a run logs it (runtime/lit_module.py logs balancer metrics as balance/<key>)
MAXVIO_KEY = "balance/maxvio/mean"
SPIKE_FACTOR = 3.0  # a logged gradient norm above this many times the run's median counts as a spike


def stability_metrics(run_dir: str) -> dict[str, Any]:
    """The stability columns of a run's row, from its ``metrics.jsonl``: ``maxvio`` (the last logged
    mean MaxVio over routed layers; empty without routed layers), ``grad_norm_spikes`` (logged
    gradient norms after the first tenth of the run above ``SPIKE_FACTOR`` x the run's median) and
    ``max_activation`` (the largest GLU intermediate at the last validation, ``act/glu_max``)."""
    from runtime.json_records import read_json_lines

    path = Path(run_dir) / "metrics.jsonl"
    records = read_json_lines(path) if path.is_file() else []
    maxvio = [r[MAXVIO_KEY] for r in records if isinstance(r.get(MAXVIO_KEY), (int, float))]
    activation = [r["act/glu_max"] for r in records if isinstance(r.get("act/glu_max"), (int, float))]
    norms = [
        (r.get("step", 0), r["train/grad_norm"]) for r in records if isinstance(r.get("train/grad_norm"), (int, float))
    ]
    spikes: Any = ""
    if norms:
        last = max(step for step, _ in norms)
        kept = [n for step, n in norms if step >= last / 10]
        median = sorted(kept)[len(kept) // 2]
        spikes = sum(n > SPIKE_FACTOR * median for n in kept)
    return {
        "maxvio": maxvio[-1] if maxvio else "",
        "grad_norm_spikes": spikes,
        "max_activation": activation[-1] if activation else "",
    }


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    from analysis.ladder import REQUIRED, STABILITY  # the table's schema is the report's

    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*REQUIRED, "tokens_per_param", "lr_edge", *STABILITY])
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


# -- measuring and printing ----------------------------------------------------------------------------
def measure_rate(overrides: list[str], steps: int, jobs: int = 1) -> Rate:
    """A rung's rate with ``jobs`` copies training at once, as the ladder will run them."""
    try:
        return probe_rate(overrides, steps, copies=jobs)
    except RuntimeError as err:
        raise LadderError(f"measuring the rate failed: {err}") from None


def _fmt_seconds(s: float) -> str:
    return f"{s / 3600:.2f} h" if s >= 3600 else f"{s / 60:.1f} min"


def print_plan(runs: list[LadderRun], preset: Preset, rates: dict[str, Rate], jobs: int) -> None:
    gpu = preset.peak_flops is not None and preset.mfu is not None
    print(
        f"{'run':<44} {'phase':<6} {'non-emb':>10} {'active':>10} {'tokens':>12} {'FLOPs':>10} "
        + ("GPU-hours" if gpu else "est. time")
    )
    total_flops, total_seconds = 0.0, 0.0
    for run in runs:
        total_flops += run.cost_flops
        if gpu:
            hours = run.cost_flops / (preset.peak_flops * preset.mfu) / 3600
            est = f"{hours:.2f}"
            total_seconds += hours * 3600
        elif run.rung.name in rates:
            seconds = rates[run.rung.name].seconds((run.steps - (run.init_step or 0)) * run.size.tokens_per_step)
            total_seconds += seconds
            est = _fmt_seconds(seconds)
        else:
            est = "-"
        lr = f" lr x{run.lr_factor:g}" if run.lr_factor is not None else ""
        print(
            f"{run.name:<44} {run.phase:<6} {run.size.non_embedding_params:>10,} {run.size.active_params:>10,} "
            f"{run.tokens:>12,} {run.cost_flops:>10.2e} {est}{lr}"
        )
    print(f"{len(runs)} runs, {total_flops:.3e} training FLOPs in all")
    if gpu:
        print(
            f"GPU-hours: {total_seconds / 3600:.1f} at {preset.peak_flops:.3g} FLOP/s peak and "
            f"{100 * preset.mfu:.0f}% MFU"
        )
    elif rates:
        rate_text = ", ".join(f"{k} {v.tokens_per_s:,.0f} tokens/s + {v.overhead_s:.0f} s" for k, v in rates.items())
        print(
            f"estimated time with --jobs {jobs}: {_fmt_seconds(scheduled_seconds(runs, rates, jobs))} "
            f"({_fmt_seconds(total_seconds)} of runs; per rung and job, as measured with {jobs} at once: "
            f"{rate_text} a run)"
        )


def scheduled_seconds(runs: list[LadderRun], rates: dict[str, Rate], jobs: int) -> float:
    """Wall time of the ladder: each phase waits for the one before (the learning rates, then the stable
    runs the branches start from), and within a phase runs start in plan order as slots free up."""
    total = 0.0
    for phase in ("lr", "stable", "branch"):
        slots = [0.0] * max(1, jobs)
        for run in runs:
            if run.phase == phase and run.rung.name in rates:
                i = slots.index(min(slots))
                slots[i] += rates[run.rung.name].seconds((run.steps - (run.init_step or 0)) * run.size.tokens_per_step)
        total += max(slots)
    return total


# -- running -------------------------------------------------------------------------------------------
def _launch(
    runs: list[LadderRun], arms: dict[str, list[str]], preset: Preset, extra: list[str], runs_dir: Path, jobs: int
) -> dict[str, dict[str, Any]]:
    """Run every unfinished run (up to ``jobs`` at once); returns the summaries of all finished ones."""
    from sweeps.run import run_points

    summaries = {r.name: s for r in runs if (s := finished_summary(runs_dir, r.name)) is not None}
    todo = [r for r in runs if r.name not in summaries]
    if todo:
        print(f"{len(todo)} to run ({len(runs) - len(todo)} finished): {', '.join(r.name for r in todo)}")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        cmds = [(r.name, run_overrides(r, arms[r.arm], preset, extra, runs_dir)) for r in todo]
        failed = run_points(cmds, runs_dir, env, jobs)
        if failed:
            raise LadderError(f"runs failed: {', '.join(failed)} (rerun the same command to retry them)")
        for r in todo:
            s = finished_summary(runs_dir, r.name)
            if s is None:
                raise LadderError(f"run {r.name} ended without finishing its steps (see {runs_dir / r.name})")
            summaries[r.name] = s
    return summaries


def _trained_lr(folder: Path) -> Optional[float]:
    """The learning rate a run folder was trained at (its composed config), if it records one."""
    try:
        return float(yaml.safe_load((folder / ".hydra" / "config.yaml").read_text())["optimizer"]["lr"])
    except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError):
        return None


def set_aside_stale_runs(runs: list[LadderRun], runs_dir: Path) -> list[Path]:
    """Move aside the folders of stable and branch runs trained (or begun) at another learning rate than
    the one chosen now, so they are trained again instead of being taken as finished or resumed: a
    changed rate rule, or learning-rate runs that changed, would otherwise leave old rates in the table.
    A folder moves to ``stale/<folder>-lr<rate>`` in the runs folder, never deleted. Returns the new paths."""
    moved = []
    for run in runs:
        if run.phase == "lr" or run.lr is None:
            continue
        planned = float(f"{run.lr:.6g}")  # as run_overrides passes it
        for folder in [runs_dir / run.name, *sorted(runs_dir.glob(f"{glob.escape(run.name)}-[0-9]*"))]:
            trained = _trained_lr(folder)
            if trained is None or math.isclose(trained, planned, rel_tol=1e-5):
                continue
            target = runs_dir / "stale" / f"{folder.name}-lr{trained:.6g}"
            n = 1
            while target.exists():
                n += 1
                target = runs_dir / "stale" / f"{folder.name}-lr{trained:.6g}-{n}"
            target.parent.mkdir(exist_ok=True)
            folder.rename(target)
            print(
                f"{folder.name}: trained at lr {trained:.6g}, the ladder now chooses {planned:.6g}: moved to {target}"
            )
            moved.append(target)
    return moved


def _hold_runs_folder(runs_dir: Path):
    """An exclusive lock on a preset's runs folder for the ladder's lifetime: two ladders sharing an arm
    would otherwise train the same run into the same folder at once."""
    import fcntl

    handle = open(runs_dir / ".lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise LadderError(
            f"another ladder is training in {runs_dir} (its runs are shared by every decision at this preset); "
            "run ladders of one preset one after another, or give this one its own --output-root"
        ) from None
    return handle


def run_ladder(
    decision: str, preset: Preset, extra: list[str], output_root: Path, jobs: int, report: bool = True
) -> Path:
    arms = {arm: load_decision(decision)[arm] for arm in ARMS}
    runs = plan(decision, preset, extra, arms)
    folder = output_root / "ladders" / f"{decision}-{preset.name}"
    runs_dir = runs_folder(output_root, preset, extra)
    runs_dir.mkdir(parents=True, exist_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    print(f"runs of preset {preset.name}: {runs_dir}")
    lock = _hold_runs_folder(runs_dir)  # noqa: F841 (held until the ladder returns)
    lr_runs = [r for r in runs if r.phase == "lr"]
    summaries = _launch(lr_runs, arms, preset, extra, runs_dir, jobs)
    chosen = choose_learning_rates(runs, summaries, preset)
    for run in runs:
        if run.phase != "lr":
            run.lr = chosen[run.arm][0][run.rung.name]
    (folder / "learning_rates.json").write_text(
        json.dumps({arm: {"lr": rates, "edge": edges} for arm, (rates, edges) in chosen.items()}, indent=1)
    )
    set_aside_stale_runs(runs, runs_dir)
    stable = [r for r in runs if r.phase == "stable"]
    summaries.update(_launch(stable, arms, preset, extra, runs_dir, jobs))
    branches = [r for r in runs if r.phase == "branch"]
    for run in branches:
        run.init_from = summaries[run.branch_of]["run_dir"]
    summaries.update(_launch(branches, arms, preset, extra, runs_dir, jobs))
    edges = {arm: edge for arm, (_, edge) in chosen.items()}
    write_csv(folder / "ladder.csv", ladder_rows(decision, runs, summaries, edges))
    print(f"ladder folder: {folder}\nladder table: {folder / 'ladder.csv'}")
    if report:  # one fit per token multiple: each is one compute frontier (analysis/ladder.py)
        for multiple in [preset.tokens_per_param, *preset.branch_multiples]:
            out = folder / f"tpp{multiple:g}"
            cmd = [sys.executable, "-m", "analysis.ladder", str(folder / "ladder.csv")]
            cmd += ["--tokens-per-param", f"{multiple:g}", "--out", str(out)]
            if subprocess.run(cmd, cwd=REPO).returncode != 0:
                raise LadderError(f"the report failed; rerun: python {' '.join(cmd[1:])}")
            print(f"report at {multiple:g} tokens per parameter: {out / 'table.md'}")
    return folder


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sweeps.run ladder", description=__doc__.splitlines()[0])
    p.add_argument("decision", help="one of: " + ", ".join(decision_names()))
    p.add_argument(
        "--preset", default="cpu", help="one of: " + ", ".join(_names(PRESETS)) + "; or the path of a preset YAML file"
    )
    p.add_argument("--jobs", type=int, default=1, help="runs at once (default 1)")
    p.add_argument("--dry-run", action="store_true", help="print every run, its FLOPs and estimated time")
    p.add_argument(
        "--measure-steps", type=int, default=8, help="dry-run: steady-state steps timed per rung (0: do not time)"
    )
    p.add_argument("--output-root", default="outputs", help="the ladder folder goes under <output-root>/ladders/")
    p.add_argument("--no-report", action="store_true", help="stop after ladder.csv (no fits or figures)")
    args, extra = p.parse_known_args(argv)
    try:
        if args.jobs < 1:
            raise LadderError(f"--jobs must be at least 1, got {args.jobs}")
        if args.measure_steps < 0:
            raise LadderError(f"--measure-steps must be 0 or more, got {args.measure_steps}")
        preset = load_preset(args.preset)
        decision = load_decision(args.decision)
        if args.dry_run:
            runs = plan(args.decision, preset, extra, {arm: decision[arm] for arm in ARMS})
            rates: dict[str, Rate] = {}
            if preset.peak_flops is None and args.measure_steps:
                for rung in preset.rungs:
                    probe = replace(next(r for r in runs if r.rung == rung and r.arm == "variant"), lr=None)
                    overrides = run_overrides(probe, decision["variant"], preset, extra, Path("."))
                    overrides = [
                        o for o in overrides if not o.startswith(("name=", "ckpt_path=", "trainer.max_steps="))
                    ]
                    rates[rung.name] = measure_rate(overrides, args.measure_steps, args.jobs)
            print(f"ladder {args.decision} ({decision.get('description', '')}), preset {preset.name}")
            print_plan(runs, preset, rates, args.jobs)
            return 0
        run_ladder(args.decision, preset, extra, Path(args.output_root).resolve(), args.jobs, not args.no_report)
    except LadderError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        from components.base import ConfigError

        if isinstance(err, ConfigError):
            print(f"error: {err}", file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
