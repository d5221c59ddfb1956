"""CPU thread counts for runs that share a machine (the wait policy: runtime/cpu_wait_policy.py).

PyTorch's OpenMP threads spin while they wait for work; when more of them run than there are cores (two
runs of two threads on two cores, or a run beside other busy processes) the spinning threads steal each
other's time and a run slows down several-fold.
"""

from __future__ import annotations

from runtime.cpu_wait_policy import usable_cpus


def threads_per_job(jobs: int, env: dict[str, str]) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for each of ``jobs`` concurrent runs: the cores this process may use (its
    affinity mask, not the machine's count: a ``taskset`` or a container's cpuset) split between them. A
    thread count the caller set is kept."""
    if jobs <= 1 or "OMP_NUM_THREADS" in env:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, len(usable_cpus()) // jobs))}
