"""CPU thread settings for runs that share a machine.

PyTorch's OpenMP threads spin while they wait for work; when more of them run than there are cores (two
runs of two threads on two cores, or a run beside other busy processes) the spinning threads steal each
other's time and a run slows down several-fold.
"""

from __future__ import annotations

import os

from runtime.cpu_wait_policy import CHOICE


def threads_per_job(jobs: int, env: dict[str, str]) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for each of ``jobs`` concurrent runs: the cores split between them. A thread
    count the caller set is kept."""
    if jobs <= 1 or "OMP_NUM_THREADS" in env:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // jobs))}


# PyTorch's Linux CPU wheels run their OpenMP regions (and MKL's) on GNU libgomp, which reads these when
# it loads, with torch: they can only be set before the process imports torch (an environment variable of
# the command that starts it). libgomp ignores Intel's KMP_BLOCKTIME and KMP_AFFINITY.
WAIT_POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def describe_wait_policy(env: dict[str, str] | os._Environ) -> str:
    """How this process's idle OpenMP threads wait, from its environment: libgomp's default (spin a
    while, about 300,000 polls, then sleep; 1,000 polls when threads outnumber the cores the process may
    use), ``OMP_WAIT_POLICY`` (active: spin; passive: sleep at once) or ``GOMP_SPINCOUNT``."""
    if env.get(CHOICE):
        return env[CHOICE]  # chosen at start-up, with its reason (runtime/cpu_wait_policy.py)
    policy = env.get("OMP_WAIT_POLICY", "").strip().lower()
    spins = env.get("GOMP_SPINCOUNT", "").strip()
    parts = [f"OMP_WAIT_POLICY={policy}"] if policy else []
    if spins:
        parts.append(f"GOMP_SPINCOUNT={spins}")
    return ", ".join(parts) if parts else "spin, then sleep (libgomp default)"
