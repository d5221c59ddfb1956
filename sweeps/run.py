"""Launch a study: ``python -m sweeps.run STUDY [--smoke] [--dry-run] [hydra overrides...]``.

A study is ``sweeps/<STUDY>.yaml``:

    description: one line
    points:            # named override sets: the alternatives compared (a union, not a grid)
      mha: [mixer=mha]
      k3_hybrid: [mixer=kda, +mixer@mixers.mla=mla, ...]
    grid:              # optional Hydra basic-sweeper axes crossed with every point (comma lists)
      ffn.activation: swiglu,situ_glu
    seeds: [0]         # each point repeated over these seeds (a `seed` axis when more than one)
    overrides: [...]   # fixed, CPU-friendly scale; anything on the command line comes after and wins
    smoke: [...]       # added by --smoke: a few steps, for the test suite

Every point runs as one Hydra multirun (``train.py -m``) into the same sweep folder
``<output_root>/sweeps/<STUDY>-<time>/<point>/<job>``: all jobs share one W&B group, carry ``point=<name>``
and the varied options as tags, and land in the folder's ``index.jsonl`` for ``python -m analysis.compare``.
GPU scale: pass e.g. ``trainer=gpu model.d_model=1024`` after the study name.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from components.sweep_job import POINT_ENV, split_override

STUDIES = Path(__file__).resolve().parent
REPO = STUDIES.parent


def study_names() -> list[str]:
    return sorted(p.stem for p in STUDIES.glob("*.yaml"))


def load_study(name: str) -> dict[str, Any]:
    path = STUDIES / f"{name}.yaml"
    if not path.exists():
        raise SystemExit(f"error: study '{name}' not found; studies: {', '.join(study_names())}")
    study = yaml.safe_load(path.read_text()) or {}
    unknown = set(study) - {"description", "points", "grid", "seeds", "overrides", "smoke"}
    if unknown:
        raise SystemExit(f"error: {path.name}: unknown keys {', '.join(sorted(unknown))}; allowed: description, points, grid, seeds, overrides, smoke")
    if not study.get("points"):
        raise SystemExit(f"error: {path.name}: 'points' must name at least one override set")
    return study


def commands(name: str, study: dict[str, Any], extra: list[str], smoke: bool, sweep_dir: Path) -> list[tuple[str, list[str]]]:
    """(point, train.py argv) for every point of the study."""
    grid = [f"{k}={v}" for k, v in (study.get("grid") or {}).items()]
    seeds = study.get("seeds") or [0]
    seed_axis = [f"seed={','.join(str(s) for s in seeds)}"]
    fixed = list(study.get("overrides") or []) + (list(study.get("smoke") or []) if smoke else [])
    out = []
    for point, overrides in study["points"].items():
        merged: dict[str, str] = {}  # one override per key, the last one given wins
        for o in [*overrides, *grid, *seed_axis, *fixed, *extra]:
            merged[split_override(o)[0]] = o
        argv = ["-m", *merged.values(), f"hydra.sweep.dir={sweep_dir}", f"hydra.sweep.subdir={point}/${{hydra.job.num}}"]
        out.append((point, argv))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("study", help="one of: " + ", ".join(study_names()))
    p.add_argument("--smoke", action="store_true", help="add the study's smoke overrides (a few steps)")
    p.add_argument("--dry-run", action="store_true", help="print the train.py commands without running them")
    p.add_argument("--output-root", default="outputs", help="the sweep folder goes under <output-root>/sweeps/")
    args, extra = p.parse_known_args(argv)
    study = load_study(args.study)
    sweep_dir = Path(args.output_root).resolve() / "sweeps" / f"{args.study}{'-smoke' if args.smoke else ''}-{time.strftime('%Y%m%d-%H%M%S')}"
    cmds = commands(args.study, study, extra, args.smoke, sweep_dir)
    if args.dry_run:
        for point, cmd in cmds:
            print(f"{point}: python train.py " + " ".join(cmd))
        return 0
    print(f"study {args.study}: {study.get('description', '')}\nsweep folder: {sweep_dir}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    failed = []
    for point, cmd in cmds:
        result = subprocess.run([sys.executable, str(REPO / "train.py"), *cmd, f"output_root={Path(args.output_root).resolve()}"],
                                cwd=REPO, env={**env, POINT_ENV: point})
        if result.returncode != 0:
            failed.append(point)
            if result.returncode == 2:  # a configuration error: the other points would fail alike
                break
    print(f"sweep folder: {sweep_dir}\ncompare: python -m analysis.compare {sweep_dir}")
    if failed:
        print(f"error: points failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
