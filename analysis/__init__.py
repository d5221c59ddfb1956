"""Run analysis tools: ``python -m analysis.<tool> RUN_DIR``.

Tools that run a model on the CPU (``MODEL_TOOLS``: evaluate, generate, the harness) start like
``train.py``: the OpenMP wait policy is chosen from the machine's load before torch loads
(``runtime/cpu_wait_policy.py``; a no-op when torch is already imported). The others (reports, comparisons,
exports) do no parallel work worth the quarter-second sample and skip it.
"""

import sys
from typing import Sequence

from runtime.cpu_wait_policy import choose_at_startup

MODEL_TOOLS = ("analysis.evaluate", "analysis.generate", "analysis.harness")


def runs_a_model(command_line: Sequence[str]) -> bool:
    """Whether the command line (``sys.orig_argv``: the package is imported before ``-m`` sets sys.argv)
    starts one of ``MODEL_TOOLS``."""
    args = list(command_line)
    return "-m" in args[:-1] and args[args.index("-m") + 1] in MODEL_TOOLS


if runs_a_model(getattr(sys, "orig_argv", ())):
    choose_at_startup()
