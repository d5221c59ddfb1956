"""What a launcher hands to the processes it starts: every environment variable and argv rewrite, here.

Three hand-offs cross process boundaries:

* the run folder (``K3_RUN_DIR``): a training run pins it for the ranks Lightning spawns, which re-run
  ``train.py`` and must write into the same folder;
* a multirun's varied keys (``K3_SWEEP_VARIED``, a JSON list): set by the launch before Hydra expands
  the sweep, read by each job to tag its W&B run;
* the study point (``K3_SWEEP_POINT``): set by ``sweeps.run`` for the multirun of one point.

And one rewrite of ``sys.argv``: Hydra reads its overrides from there, and Lightning's spawned ranks
re-run the script with it, so the launch (and a multirun job, for its ranks) sets it to exactly the
overrides the process stands for.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from typing import Iterator, Mapping, Optional

RUN_DIR_ENV = "K3_RUN_DIR"
VARIED_ENV = "K3_SWEEP_VARIED"
POINT_ENV = "K3_SWEEP_POINT"


# -- run folder --------------------------------------------------------------------------------------
def pinned_run_dir(env: Mapping[str, str] = os.environ) -> Optional[str]:
    """The run folder a parent process pinned for this one, if any."""
    return env.get(RUN_DIR_ENV) or None


@contextmanager
def pin_run_dir(run_dir: str) -> Iterator[None]:
    """Pin ``run_dir`` for processes started inside the block; restore what was there after, so a later
    run started from this process chooses its own folder."""
    before = os.environ.get(RUN_DIR_ENV)
    os.environ[RUN_DIR_ENV] = run_dir
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(RUN_DIR_ENV, None)
        else:
            os.environ[RUN_DIR_ENV] = before


# -- sweeps ------------------------------------------------------------------------------------------
def publish_varied_keys(keys: list[str]) -> None:
    os.environ[VARIED_ENV] = json.dumps(keys)


def varied_keys(env: Mapping[str, str] = os.environ) -> list[str]:
    return json.loads(env.get(VARIED_ENV, "[]"))


def point_env(point: str) -> dict[str, str]:
    """Environment entries that tell a multirun which study point it runs."""
    return {POINT_ENV: point}


def sweep_point(env: Mapping[str, str] = os.environ) -> Optional[str]:
    return env.get(POINT_ENV) or None


# -- argv --------------------------------------------------------------------------------------------
def set_script_args(args: list[str]) -> None:
    """``sys.argv`` = this script followed by ``args`` (what Hydra parses and spawned ranks re-run)."""
    sys.argv = [sys.argv[0], *args]
