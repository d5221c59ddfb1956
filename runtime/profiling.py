"""``trainer.profiler``: one of Lightning's profilers, writing into the run folder.

    <run folder>/profiler/fit-report.txt        simple / advanced: time (cProfile) per training hook
                                                pytorch: the operator table of the recorded steps
    <run folder>/profiler/*.pt.trace.json       pytorch: Chrome trace (chrome://tracing, Perfetto,
                                                TensorBoard's profiler plugin on this folder)

``validate-report.txt`` (and its traces) come from the final validation. With several processes per node
each local rank writes its own files (``-<local rank>`` in the name); on several nodes the node rank is in
the name too (``report-node<k>``), so ranks sharing a run folder never write the same file.

The PyTorch profiler keeps Lightning's schedule: 1 step skipped, 1 warmup step, 3 recorded steps, once
per stage (training steps and validation steps separately), so the trace stays small whatever the run's
length; input shapes, stacks and memory are not recorded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

PROFILER_FOLDER = "profiler"
REPORT_NAME = "report"
ADVANCED_LINES = 40  # cProfile lines per profiled hook (the full listing runs to thousands of lines)

# where launchers publish the node rank (Lightning's own NODE_RANK, torchrun's GROUP_RANK, SLURM's node id)
NODE_RANK_VARIABLES = ("NODE_RANK", "GROUP_RANK", "SLURM_NODEID")


def report_name(num_nodes: int, env: Mapping[str, str] = os.environ) -> str:
    """The report's base name: ``report``, or ``report-node<k>`` when the run spans nodes."""
    if num_nodes <= 1:
        return REPORT_NAME
    node = next((env[v] for v in NODE_RANK_VARIABLES if env.get(v)), "0")
    return f"{REPORT_NAME}-node{node}"


def build_profiler(trainer_cfg: Any, run_dir: str) -> Any:
    """The Lightning profiler ``trainer.profiler`` names, writing under ``<run_dir>/profiler``; None when off."""
    choice = trainer_cfg.profiler
    if choice is None:
        return None
    from lightning.pytorch.profilers import (  # start-up time: lightning, only once a run starts
        AdvancedProfiler,
        PyTorchProfiler,
        SimpleProfiler,
    )

    dirpath = os.path.join(run_dir, PROFILER_FOLDER)
    filename = report_name(trainer_cfg.num_nodes)
    if choice == "simple":
        return SimpleProfiler(dirpath=dirpath, filename=filename, extended=True)
    if choice == "advanced":
        return AdvancedProfiler(dirpath=dirpath, filename=filename, line_count_restriction=ADVANCED_LINES)
    if choice == "pytorch":
        # no schedule given: Lightning's default (wait 1, warmup 1, active 3) is the one it shortens
        # safely for stages with fewer than 5 steps
        return PyTorchProfiler(
            dirpath=dirpath,
            filename=filename,
            export_to_chrome=True,
            record_shapes=False,
            profile_memory=False,
            with_stack=False,
        )
    raise ValueError(f"trainer.profiler: unknown profiler '{choice}'")  # validate() refuses it earlier
