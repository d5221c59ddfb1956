"""The plan of a scaling ladder: its definitions (decisions and presets), the size of every run, the runs
themselves with their budgets and schedules, and the learning rates chosen from the rate sweep's losses.

Nothing here trains, writes or starts a process (``sweeps/ladder.py`` does); it reads the decision and
preset files and composes configurations to count parameters and FLOPs.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import yaml

from components.optim.schedules.wsd import decay_start
from runtime.rate_probe import Rate
from runtime.sweep_job import split_override
from sweeps.ladder_rungs import Rung

LADDERS = Path(__file__).resolve().parent / "ladders"
PRESETS = LADDERS / "presets"
ARMS = ("baseline", "variant")
LR_RULES = ("baseline", "per_arm")


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
    check_keys(path.name, data, allowed, required)
    return data


def check_keys(where: str, data: dict, allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> None:
    """Refuse a section with keys outside ``allowed`` or without one of ``required``, naming them."""
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise LadderError(f"{where}: unknown keys {', '.join(unknown)}; allowed: {', '.join(allowed)}")
    missing = [k for k in required if k not in data]
    if missing:
        raise LadderError(f"{where}: missing {', '.join(missing)}")


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
    # the rung rule (``batch:``): each rung's batch in rows, the largest power of two that still gives
    # ``min_steps`` optimizer steps at the smallest token budget (at most ``max_rows``); None: the batch of
    # ``overrides`` at every rung
    min_steps: Optional[int] = None
    max_rows: Optional[int] = None
    # the learning-rate rule: "baseline" (the baseline's sweep fitted across sizes serves both arms) or
    # "per_arm" (each arm's own sweep fitted); either way both arms get the same check at the largest rung
    lr_rule: str = "per_arm"
    lr_check_factors: list[float] = field(default_factory=list)
    # the local comparison (``local:``, ``--local``): the rung (default the largest), the baseline's
    # compute spread around the variant's, and the paired seeds
    local_rung: Optional[Rung] = None
    local_spread: float = 1.3
    local_seeds: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    # the learning-rate sensitivity study (``sensitivity:``, ``--rate-sensitivity``; sweeps/rate_sensitivity.py)
    sensitivity: dict = field(default_factory=dict)
    # associative recall beside the loss (``recall:``, ``--recall``; sweeps/recall_study.py)
    recall: dict = field(default_factory=dict)
    # GPU presets: dry-run accounting composes with these instead of the data the runs read
    accounting_overrides: list[str] = field(default_factory=list)
    peak_flops: Optional[float] = None
    mfu: Optional[float] = None
    description: str = ""


PRESET_KEYS = (
    "description",
    "rungs",
    "batch",
    "local",
    "sensitivity",
    "recall",
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
    batch = p.get("batch") or {}
    unknown = sorted(set(batch) - {"min_steps", "max_rows"})
    if unknown:
        raise LadderError(f"{where}: batch: unknown keys {', '.join(unknown)}; allowed: min_steps, max_rows")
    unknown = sorted(set(lr) - {"base", "factors", "sweep_rungs", "rule", "check_factors"})
    if unknown:
        raise LadderError(
            f"{where}: lr: unknown keys {', '.join(unknown)}; allowed: base, factors, sweep_rungs, rule, check_factors"
        )
    local = p.get("local") or {}
    unknown = sorted(set(local) - {"rung", "spread", "seeds"})
    if unknown:
        raise LadderError(f"{where}: local: unknown keys {', '.join(unknown)}; allowed: rung, spread, seeds")
    local_rung = Rung(*(int(v) for v in local["rung"])) if "rung" in local else None
    if local_rung is not None:
        try:
            local_rung.check()
        except ValueError as err:
            raise LadderError(f"{where}: local.rung: {err}") from None
    if not 1.0 < float(local.get("spread", 1.3)) <= 2.0:
        raise LadderError(f"{where}: local.spread must lie in (1, 2], got {local['spread']}")
    if len(local.get("seeds", [0, 1])) < 2:
        raise LadderError(f"{where}: local.seeds needs at least 2 seeds for an interval")
    if lr.get("rule", "per_arm") not in LR_RULES:
        raise LadderError(f"{where}: lr.rule must be one of {', '.join(LR_RULES)}, got {lr['rule']!r}")
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
        min_steps=int(batch["min_steps"]) if "min_steps" in batch else None,
        max_rows=int(batch["max_rows"]) if "max_rows" in batch else None,
        lr_rule=lr.get("rule", "per_arm"),
        lr_check_factors=sorted(float(f) for f in lr.get("check_factors") or []),
        local_rung=local_rung,
        local_spread=float(local.get("spread", 1.3)),
        local_seeds=[int(x) for x in local.get("seeds", [0, 1, 2, 3])],
        sensitivity=dict(p.get("sensitivity") or {}),
        recall=dict(p.get("recall") or {}),
        accounting_overrides=list(p.get("accounting_overrides") or []),
        peak_flops=float(gpu["peak_flops"]) if "peak_flops" in gpu else None,
        mfu=float(gpu["mfu"]) if "mfu" in gpu else None,
        description=p.get("description", ""),
    )
    if preset.lr_check_factors and 1.0 not in preset.lr_check_factors:
        raise LadderError(f"{where}: lr.check_factors must include 1 (the chosen rate itself)")
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
    seq_len: int = 0
    accumulate: int = 1


def account(overrides: list[str]) -> Size:
    """Parameters, training FLOPs per token and tokens per step of a composition (built on meta)."""
    from components.flop_count import (  # start-up time: torch and the model, only when sizes are counted
        parameter_counts,
        training_flops_per_token,
    )
    from components.model import build_on_meta  # start-up time: torch and the model, only when sizes are counted
    from runtime.compose import compose, strip_hydra  # start-up time: torch and the model, only when sizes are counted
    from runtime.validation import validate  # start-up time: torch and the model, only when sizes are counted

    root = validate(strip_hydra(compose(overrides)))
    model = build_on_meta(root.decoder_config())
    params = parameter_counts(model)
    seq_len = root.data.seq_len
    flops = sum(training_flops_per_token(model, seq_len).values())
    accumulate = root.trainer.accumulate_grad_batches
    tokens_per_step = root.data.batch_size * seq_len * accumulate
    return Size(params["non_embedding"], params["active"], flops, tokens_per_step, seq_len, accumulate)


# -- the plan ------------------------------------------------------------------------------------------
@dataclass
class LadderRun:
    name: str
    phase: str  # lr | lr_check | stable | branch
    arm: str
    rung: Rung
    seed: int  # the replicate: the same in both arms (paired), and what the ladder table lists
    tokens_per_param: float
    steps: int
    warmup: int
    size: Size
    run_seed: int = 0  # what train.py gets: a function of (seed, rung), see run_seed()
    batch_rows: Optional[int] = None  # the rung rule's batch (None: the preset's overrides decide)
    lr_factor: Optional[float] = None  # lr phase: the factor of lr.base; lr_check: of the chosen rate
    lr: Optional[float] = None  # lr_check, stable and branch runs: chosen after the lr phase
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


def batch_rows(tokens: float, tokens_per_row: int, min_steps: int, max_rows: Optional[int] = None) -> int:
    """The rung rule: the batch, in rows of ``tokens_per_row`` tokens (sequence length x accumulation), is
    the largest power of two with which ``tokens`` still take at least ``min_steps`` optimizer steps, and
    at most ``max_rows``. So the batch grows with the rung (about in proportion to its parameters) and every
    rung trains between ``min_steps`` and twice as many steps at its smallest budget: steps no longer grow
    with size (a fixed batch gives the smallest rung a tenth of the largest's steps)."""
    rows = tokens / (min_steps * tokens_per_row)
    if rows < 1:
        raise LadderError(
            f"{tokens:,.0f} tokens give fewer than {min_steps} steps even at one row of {tokens_per_row} tokens; "
            "shorten data.seq_len, or raise tokens_per_param or the smallest branch multiple"
        )
    out = 2 ** math.floor(math.log2(rows) + 1e-12)
    return min(out, max_rows) if max_rows else out


CHECKPOINTS_BEFORE_BRANCHES = 8  # at most this many checkpoints before the first branch point


def checkpoint_interval(starts: list[int]) -> Optional[int]:
    """How often a stable run saves a checkpoint so that each cooldown branch can start from one: the
    greatest common divisor of the branches' decay starts where that is coarse enough (one branch: its
    start), else an eighth of the earliest start. A branch then starts at the last checkpoint at or before
    its decay (``start - start % interval``) and trains the rest of its own stable phase itself, at most
    an interval of steps again: the same updates, since batch ``i`` is a function of (seed, ``i``) and the
    rate is at its peak there."""
    if not starts:
        return None
    divisor = math.gcd(*starts)
    if divisor * CHECKPOINTS_BEFORE_BRANCHES >= min(starts):
        return divisor
    return max(1, math.ceil(min(starts) / CHECKPOINTS_BEFORE_BRANCHES))


# run seeds lie below this: the data's batch generator folds the seed, times about 1e15, into a 64-bit
# generator seed (components/data/base.py batch_generator), which overflows from about 9,200 on
RUN_SEEDS = 9000


def run_seed(seed: int, rung: Rung) -> int:
    """The seed a run of replicate ``seed`` at ``rung`` trains with: its batch order (and initialisation) is
    a function of (seed, rung), the same in both arms, so the arms stay paired at a rung while a seed's
    luck in its batches no longer repeats at every rung (the per-rung bootstrap takes rungs as independent)."""
    digest = hashlib.sha256(f"ladder-seed/{seed}/{rung.name}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % RUN_SEEDS


def plan(decision: str, preset: Preset, extra: list[str], arms_overrides: dict[str, list[str]]) -> list[LadderRun]:
    """Every run of the ladder, the learning rates of the check, stable and branch runs still open.

    Per rung, both arms share the batch (``batch_rows`` from the smaller arm's active parameters at the
    smallest token budget), the warmup (``warmup_fraction`` of the smallest budget's tokens, in steps of
    that batch) and the run seeds (``run_seed``); each run decays over the last ``decay_fraction`` of its
    own budget, so warmup and cooldown are fixed shares of tokens at every rung."""
    runs: list[LadderRun] = []
    arm_slugs = {arm: arm_slug(arms_overrides[arm]) for arm in ARMS}
    if arm_slugs["baseline"] == arm_slugs["variant"]:  # an A/A ladder: the same runs twice would be one set
        arm_slugs = {arm: f"{arm_slugs[arm]}-{arm}" for arm in ARMS}
    smallest = preset.branch_multiples[0] if preset.branch_multiples else preset.tokens_per_param
    swept = ARMS if preset.lr_rule == "per_arm" else ("baseline",)
    sizes = {
        (arm, rung): account(arm_overrides(arms_overrides[arm], rung, preset, extra, accounting=True))
        for rung in preset.rungs
        for arm in ARMS
    }
    seeds = {(seed, rung.name): run_seed(seed, rung) for seed in preset.seeds for rung in preset.rungs}
    if len(set(seeds.values())) < len(seeds):
        raise LadderError(f"two (seed, rung) pairs draw the same run seed ({seeds}); choose other seeds")
    for arm in ARMS:
        for i, rung in enumerate(preset.rungs):
            size = sizes[(arm, rung)]
            fewest = min(sizes[(a, rung)].active_params for a in ARMS)
            rows = None
            if preset.min_steps:
                try:
                    rows = batch_rows(
                        smallest * fewest, size.seq_len * size.accumulate, preset.min_steps, preset.max_rows
                    )
                except LadderError as err:
                    raise LadderError(f"rung {rung.name}: {err}") from None
                size = replace(size, tokens_per_step=rows * size.seq_len * size.accumulate)
            total = _steps(preset.tokens_per_param, size)
            warmup = max(1, round(preset.warmup_fraction * smallest * fewest / size.tokens_per_step))
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
            every = checkpoint_interval([s for _, _, s in starts])
            starts = [(m, steps, start - start % every) for m, steps, start in starts]
            common = dict(size=size, batch_rows=rows, warmup=warmup)
            first = dict(seed=preset.seeds[0], run_seed=seeds[(preset.seeds[0], rung.name)])
            lr_steps = _steps(smallest, size)
            if i < preset.lr_sweep_rungs and arm in swept:
                for f in preset.lr_factors:
                    name = f"{arm_slugs[arm]}-{rung.name}-lr{f:g}"
                    runs.append(
                        LadderRun(
                            name,
                            "lr",
                            arm,
                            rung,
                            **first,
                            tokens_per_param=smallest,
                            steps=lr_steps,
                            lr_factor=f,
                            **common,
                        )
                    )
            if i == len(preset.rungs) - 1:  # the same check of the chosen rate for both arms, at the largest
                for f in preset.lr_check_factors:
                    name = f"{arm_slugs[arm]}-{rung.name}-lrcheck{f:g}"
                    runs.append(
                        LadderRun(
                            name,
                            "lr_check",
                            arm,
                            rung,
                            **first,
                            tokens_per_param=smallest,
                            steps=lr_steps,
                            lr_factor=f,
                            **common,
                        )
                    )
            for seed in preset.seeds:
                stable = f"{arm_slugs[arm]}-{rung.name}-s{seed}"
                replicate = dict(seed=seed, run_seed=seeds[(seed, rung.name)])
                runs.append(
                    LadderRun(
                        stable,
                        "stable",
                        arm,
                        rung,
                        **replicate,
                        tokens_per_param=preset.tokens_per_param,
                        steps=total,
                        checkpoint_every=every,
                        **common,
                    )
                )
                for m, branch_steps, start in starts:
                    runs.append(
                        LadderRun(
                            f"{stable}-tpp{m:g}",
                            "branch",
                            arm,
                            rung,
                            **replicate,
                            tokens_per_param=m,
                            steps=branch_steps,
                            branch_of=stable,
                            init_step=start,
                            **common,
                        )
                    )
    return runs


def local_preset(preset: Preset) -> Preset:
    """The preset of a local comparison: one rung (``local.rung``, or the largest), the baseline trained to
    ``spread`` x the token budget with cooldown branches at the budget and at budget / ``spread`` (three
    compute points ``spread`` apart, one lineage per seed), ``local.seeds``, and one learning-rate rule: the
    baseline's sweep at this rung (the check at it applies to both arms). Its settings differ from the
    ladder's, so its runs get their own runs folder."""
    rung = preset.local_rung or preset.rungs[-1]
    tpp, spread = preset.tokens_per_param, preset.local_spread
    return replace(
        preset,
        name=f"{preset.name}-local",
        rungs=[rung],
        tokens_per_param=tpp * spread,
        branch_multiples=[tpp / spread, tpp],
        seeds=list(preset.local_seeds),
        lr_rule="baseline",
        lr_sweep_rungs=1,
    )


def plan_local(decision: str, local: Preset, extra: list[str], arms_overrides: dict[str, list[str]]) -> list[LadderRun]:
    """The runs of a local comparison (``local`` from ``local_preset``): the baseline's three compute points
    per seed as the ladder plans them (a run to the largest budget and its two cooldown branches), and the
    variant at the middle budget alone, as a run of its own with the same batch, warmup and seeds (a
    branch's schedule is that of a run trained to its budget, so the two are comparable)."""
    middle = local.branch_multiples[-1]
    runs = []
    for run in plan(decision, local, extra, arms_overrides):
        if run.arm == "variant" and run.phase in ("stable", "branch"):
            if run.tokens_per_param != middle:
                continue
            run = replace(run, phase="stable", name=run.branch_of, branch_of=None, init_step=None)
            run.name = f"{run.name}-tpp{middle:g}"
        runs.append(run)
    return runs


def arm_slug(arm: list[str]) -> str:
    """A run-name stem that says what an arm trains (``experiment=k3_small`` -> ``k3_small``): runs are
    named by what they train, so two decisions that share an arm share its runs."""
    parts = [o.split("=", 1)[1] if o.startswith("experiment=") else o for o in arm]
    slug = re.sub(r"[^A-Za-z0-9_.=+-]", "_", "+".join(parts)) or "default"
    if len(slug) > 60:
        slug = slug[:48] + "-" + hashlib.sha1(slug.encode()).hexdigest()[:8]
    return slug


def runs_folder(output_root: Path, preset: Preset, extra: list[str], study: Optional[dict] = None) -> Path:
    """Where a preset's runs live, shared by every decision trained at it: ``ladders/runs-<preset>-<hash>``,
    the hash over everything that shapes a run (the preset's settings, the command line's overrides and
    ``study``, the settings of a study whose runs are not the ladder's), so a changed preset or override
    never reuses a run trained under the old one. The ``recall:`` section shapes only the recall study's
    runs (which pass it as ``study``): editing it leaves the ladder's runs folder, and the names of folders
    made before the section existed, as they were."""
    identity = {k: v for k, v in asdict(preset).items() if k not in ("name", "description", "recall")}
    identity["extra"] = list(extra)
    if study is not None:
        identity["study"] = study
    digest = hashlib.sha1(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return output_root / "ladders" / f"runs-{preset.name}-{digest}"


def arm_overrides(arm: list[str], rung: Rung, preset: Preset, extra: list[str], accounting: bool = False) -> list[str]:
    """The arm's overlay, the preset's settings, the rung's sizes, then the command line's: one override
    per key, the last given winning."""
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
        f"seed={run.run_seed}",
        f"name={run.name}",
        "ckpt_path=last",
        "logger.job_type=ladder-rung",
    ]
    if run.batch_rows is not None:
        out.append(f"data.batch_size={run.batch_rows}")
    if run.checkpoint_every:
        out += [f"trainer.checkpoint_every_n_steps={run.checkpoint_every}", "trainer.keep_last_checkpoints=null"]
    if run.branch_of:
        out += [f"init_from={run.init_from or runs_dir / run.branch_of}", f"init_step={run.init_step}"]
    return [*out, *extra]


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
    to every rung: under ``lr.rule`` "per_arm" each arm's own fit, under "baseline" the baseline's fit for
    both arms (the variant's edges are then empty: it was not swept)."""
    fits, out = {}, {}
    for arm in ARMS if preset.lr_rule == "per_arm" else ("baseline",):
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
            edges[rung_name] = ""  # inside the sweep, or the edge it sits at (analysis.ladder_report flags it)
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
        fits[arm] = (intercept, slope, edges)
    for arm in ARMS:
        intercept, slope, edges = fits.get(arm) or fits["baseline"]
        rates = {}
        for run in runs:
            if run.arm == arm and run.phase != "lr":
                rates[run.rung.name] = math.exp(intercept + slope * math.log(run.size.active_params))
        out[arm] = (rates, edges if arm in fits else {})
    return out


def lr_rule_text(preset: Preset) -> str:
    """The learning-rate rule as the ladder table records it with every run."""
    rungs = ", ".join(r.name for r in preset.rungs[: preset.lr_sweep_rungs])
    whose = "of the baseline, for both arms" if preset.lr_rule == "baseline" else "of each arm, for itself"
    return f"log lr = a + b log N fitted to the best rates at {rungs} {whose}"


def check_learning_rates(runs: list[LadderRun], summaries: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per arm, the check at the largest rung: each factor of the chosen rate with its loss, and ``flag``:
    "" where the chosen rate (factor 1) was the best of them, else "low" or "high" (a lower or higher one
    was better: the rule does not suit that arm there)."""
    out = {}
    for arm in ARMS:
        trials = sorted(
            (r.lr_factor, _val_loss(summaries[r.name]))
            for r in runs
            if r.phase == "lr_check" and r.arm == arm and r.name in summaries
        )
        if not trials:
            continue
        finite = [(f, loss) for f, loss in trials if math.isfinite(loss)]
        best = min(finite, key=lambda t: t[1])[0] if finite else None
        flag = "" if best == 1.0 else ("low" if best is not None and best < 1.0 else "high")
        out[arm] = {"losses": {f"{f:g}": loss for f, loss in trials}, "best_factor": best, "flag": flag}
    return out


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
    runs the branches start from, beside the learning-rate checks), and within a phase runs start in plan
    order as slots free up."""
    total = 0.0
    for phases in (("lr",), ("lr_check", "stable", "recall"), ("branch",)):
        slots = [0.0] * max(1, jobs)
        for run in runs:
            if run.phase in phases and run.rung.name in rates:
                i = slots.index(min(slots))
                slots[i] += rates[run.rung.name].seconds((run.steps - (run.init_step or 0)) * run.size.tokens_per_step)
        total += max(slots)
    return total
