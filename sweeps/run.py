"""Launch a study: ``python -m sweeps.run STUDY [--smoke] [--dry-run] [hydra overrides...]``.

A study is ``sweeps/<STUDY>.yaml``:

    description: one line
    points:            # named override sets: the alternatives compared (a union, not a grid)
      mha: [mixer=mha]
      k3_hybrid: [mixer=kda, +mixer@mixers.mla=mla, ...]
    grid:              # optional Hydra basic-sweeper axes crossed with every point (comma lists)
      ffn.activation: swiglu,situ_glu
    search:            # optional: an Optuna (TPE) search instead of a grid, per point
      n_trials: 8      #   trials, run one after another so each learns from the previous ones
      direction: minimize   # of the final validation loss each job returns
      params:          #   Hydra's sweep syntax: interval (continuous), tag(log, ...), choice, range
        optimizer.lr: tag(log, interval(1e-3, 3e-2))
    seeds: [0]         # each point repeated over these seeds (a `seed` axis when more than one)
    overrides: [...]   # fixed, CPU-friendly scale; anything on the command line comes after and wins
    smoke: [...]       # with --smoke: this study's additions to the shared SMOKE preset below
                       # ("-KEY" drops the preset's override of KEY, e.g. -data.val_tokens for data=mqar)
    compare_at: tokens # what the points hold equal: tokens (the default: one token budget for all) or
                       # time (each point's budget sized to the same training time, e.g. tokenizers,
                       # whose tokens stand for different amounts of text)

Every point runs as one Hydra multirun (``train.py -m``) into the same sweep folder
``<output_root>/sweeps/<STUDY>-<time>/<point>/<job>``: all jobs share one W&B group, carry ``point=<name>``
and the varied options as tags, and land in the folder's ``index.jsonl`` for ``python -m analysis.compare``.
GPU scale: pass e.g. ``trainer=gpu model.d_model=1024`` after the study name.

``python -m sweeps.run ladder DECISION ...`` launches a scaling ladder instead (``sweeps/ladder.py``). Both
start their ``train.py`` processes through ``sweeps/run_pool.py``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from runtime.sweep_job import split_override
from sweeps import ladder
from sweeps.run_pool import repo_env, run_points

STUDIES = Path(__file__).resolve().parent
REPO = STUDIES.parent

# --smoke: every study at a test-suite scale (a tiny model, two steps, no W&B); a study's own `smoke:`
# list is applied after this and wins for the keys it repeats
SMOKE = [
    "model=tiny",
    "data.seq_len=64",
    "data.batch_size=4",
    "data.val_tokens=1024",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.max_time_minutes=null",
    "trainer.compile=false",
    "trainer.enable_progress_bar=false",
    "logger=csv",
]


def study_names() -> list[str]:
    return sorted(p.stem for p in STUDIES.glob("*.yaml"))


def load_study(name: str) -> dict[str, Any]:
    path = STUDIES / f"{name}.yaml"
    if not path.exists():
        raise SystemExit(f"error: study '{name}' not found; studies: {', '.join(study_names())}")
    study = yaml.safe_load(path.read_text()) or {}
    allowed = ("description", "points", "grid", "search", "seeds", "overrides", "smoke", "compare_at")
    unknown = set(study) - set(allowed)
    if unknown:
        raise SystemExit(
            f"error: {path.name}: unknown keys {', '.join(sorted(unknown))}; allowed: {', '.join(allowed)}"
        )
    search = study.get("search")
    if search is not None:
        bad = set(search) - set(SEARCH_KEYS)
        if bad or not search.get("params"):
            raise SystemExit(
                f"error: {path.name}: search needs 'params' and takes only {', '.join(SEARCH_KEYS)}"
                + (f" (unknown: {', '.join(sorted(bad))})" if bad else "")
            )
        if study.get("grid"):
            raise SystemExit(
                f"error: {path.name}: 'grid' and 'search' cannot be combined (put fixed choices in points)"
            )
        if len(study.get("seeds") or [0]) > 1:
            raise SystemExit(
                f"error: {path.name}: 'seeds' must list one seed in a search study (Optuna would search over the seed)"
            )
        study.setdefault("points", {"search": []})
        if len(study["points"]) > 1:
            raise SystemExit(
                f"error: {path.name}: a search study has one point (each point's search would overwrite the sweep "
                "folder's optimization_results.yaml)"
            )
    if not study.get("points"):
        raise SystemExit(f"error: {path.name}: 'points' must name at least one override set")
    if study.setdefault("compare_at", "tokens") not in ("tokens", "time"):
        raise SystemExit(f"error: {path.name}: compare_at must be tokens or time, got {study['compare_at']!r}")
    return study


SEARCH_KEYS = ("n_trials", "direction", "params", "sampler_seed", "max_failure_rate")


def search_overrides(search: dict[str, Any]) -> list[str]:
    """Hydra overrides that run an Optuna TPE search: the sweeper, its settings, and the search space
    as sweep overrides (which the Optuna sweeper reads as distributions)."""
    return [
        "hydra/sweeper=optuna",
        f"hydra.sweeper.n_trials={int(search.get('n_trials', 8))}",
        f"hydra.sweeper.direction={search.get('direction', 'minimize')}",
        f"hydra.sweeper.sampler.seed={int(search.get('sampler_seed', 0))}",
        "hydra.sweeper.n_jobs=1",
        # a diverging trial (e.g. too high a learning rate) is a failed trial, not the end of the search
        f"hydra.sweeper.max_failure_rate={float(search.get('max_failure_rate', 0.5))}",
        *[f"{k}={v}" for k, v in search["params"].items()],
    ]


def commands(
    name: str, study: dict[str, Any], extra: list[str], smoke: bool, sweep_dir: Path
) -> list[tuple[str, list[str]]]:
    """(point, train.py argv) for every point of the study."""
    grid = [f"{k}={v}" for k, v in (study.get("grid") or {}).items()]
    if study.get("search"):
        grid = search_overrides(study["search"])
    seeds = study.get("seeds") or [0]
    seed_axis = [f"seed={','.join(str(s) for s in seeds)}"]
    fixed = list(study.get("overrides") or [])
    if smoke:
        own = study.get("smoke") or []
        dropped = {o[1:] for o in own if o.startswith("-")}
        fixed += [o for o in SMOKE if split_override(o)[0] not in dropped] + [o for o in own if not o.startswith("-")]
    out = []
    for point, overrides in study["points"].items():
        merged: dict[str, str] = {}  # one override per key, the last one given wins
        for o in [*overrides, *grid, *seed_axis, *fixed, *extra]:
            merged[split_override(o)[0]] = o
        argv = [
            "-m",
            *merged.values(),
            f"hydra.sweep.dir={sweep_dir}",
            f"hydra.sweep.subdir={point}/${{hydra.job.num}}",
        ]
        out.append((point, argv))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["ladder"]:  # a scaling ladder: sweeps/ladder.py
        return ladder.main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("study", help="one of: " + ", ".join(study_names()) + "; or ladder (python -m sweeps.run ladder -h)")
    p.add_argument("--smoke", action="store_true", help="add the study's smoke overrides (a few steps)")
    p.add_argument("--dry-run", action="store_true", help="print the train.py commands without running them")
    p.add_argument("--output-root", default="outputs", help="the sweep folder goes under <output-root>/sweeps/")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="points run at once (default 1; each point's jobs still run one after another)",
    )
    p.add_argument("--points", default=None, help="comma-separated subset of the study's points to run (default: all)")
    args, extra = p.parse_known_args(argv)
    study = load_study(args.study)
    if args.points:
        chosen = [x.strip() for x in args.points.split(",") if x.strip()]
        unknown = [x for x in chosen if x not in study["points"]]
        if unknown:
            raise SystemExit(
                f"error: --points: {', '.join(unknown)} not in study '{args.study}'; its points: "
                f"{', '.join(study['points'])}"
            )
        study["points"] = {k: v for k, v in study["points"].items() if k in chosen}
    sweep_dir = (
        Path(args.output_root).resolve()
        / "sweeps"
        / f"{args.study}{'-smoke' if args.smoke else ''}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    cmds = commands(args.study, study, extra, args.smoke, sweep_dir)
    if args.dry_run:
        for point, cmd in cmds:
            print(f"{point}: python train.py " + " ".join(cmd))
        return 0
    print(f"study {args.study}: {study.get('description', '')}\nsweep folder: {sweep_dir}")
    failed = run_points(cmds, Path(args.output_root).resolve(), repo_env(), args.jobs)
    print(f"sweep folder: {sweep_dir}\ncompare: python -m analysis.compare {sweep_dir}")
    if failed:
        print(f"error: points failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
