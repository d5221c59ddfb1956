"""How a command's idle OpenMP threads wait, chosen once when it starts, from how busy the machine is.

libgomp (the OpenMP runtime of PyTorch's Linux CPU wheels) reads its wait policy when it loads, with torch,
so it can only be chosen before the process imports torch: ``choose_at_startup`` is the first thing
``train.py`` and the analysis tools that run a model do. Measured on the default run (2 threads on 2
cores; the table in docs/training.md): libgomp's default (spin about 300,000 polls, then sleep) is fastest
alone and keeps 0.4-0.66 of the run's fair share beside busy processes, whose cores its spinning threads
take from their own siblings. Sleeping at once (``OMP_WAIT_POLICY=passive``) costs 11% alone and is best
beside a process that leaves a core free; a brief spin (``GOMP_SPINCOUNT=1000``) is as fast as the default
alone and the steadier beside processes that take every core. So: other processes busy on at least half a
core and leaving at least half a core free, passive; otherwise (idle, every core taken, load unknown) the
brief spin, which also meets load that arrives after start-up without a spinning team. The thread count
adapts as the run goes (``runtime/cpu_thread_tuning.py``). The wait policy never changes a result, only
how long a thread waits for work.

The choice and its reason travel in the environment (``CHOICE``), so processes a command starts (Lightning's
ranks, a study's jobs) inherit it instead of measuring again; an ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``
the user set is kept. Nothing here imports torch.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Mapping, MutableMapping, Optional

CHOICE = "K3_CPU_WAIT_POLICY"  # the environment variable holding what was chosen and why
USER_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # libgomp reads these when it loads (it ignores KMP_*)
BUSY_CORES = 0.5  # other processes using at least this many cores at start-up: the machine is busy
SAMPLE_SECONDS = 0.25
# polls an idle thread makes before it sleeps, unless passive waiting is chosen: as fast alone as libgomp's
# default 300,000 (by libgomp's own estimate about 3 ms of spinning; 1,000 are about 10 us), and a thread
# that waits for a sibling the scheduler put aside soon gives its core back, so load that arrives later
# finds no spinning team
BRIEF_SPINS = 1000


def usable_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity mask: a ``taskset`` or a container's cpuset), which
    is also how many threads OpenMP starts by default."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def cpu_times(stat: str, cpus: set[int]) -> Optional[tuple[float, float]]:
    """(busy, total) jiffies since boot of the ``cpus`` among the ``cpuN`` lines of /proc/stat's text
    ``stat`` (None when it names none of them)."""
    busy = total = 0.0
    found = False
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus):
            continue
        fields = [float(x) for x in rest.split()]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
        busy, total, found = busy + sum(fields) - idle, total + sum(fields), True
    return (busy, total) if found else None


def _read_stat() -> str:
    try:
        with open("/proc/stat") as f:
            return f.read()
    except OSError:
        return ""


def other_busy_cores(sample_seconds: float = SAMPLE_SECONDS) -> Optional[float]:
    """How many of this process's usable cores other processes kept busy over ``sample_seconds`` (its own
    CPU time taken out); None where the machine does not say (no /proc/stat)."""
    cpus = usable_cpus()
    before, own_before = cpu_times(_read_stat(), cpus), os.times()
    time.sleep(sample_seconds)
    after, own_after = cpu_times(_read_stat(), cpus), os.times()
    if before is None or after is None or after[1] <= before[1]:
        return None
    busy = (after[0] - before[0]) / (after[1] - before[1]) * len(cpus)  # cores' worth of busy time
    own = (own_after.user + own_after.system - own_before.user - own_before.system) / sample_seconds
    return max(0.0, busy - own)


def choose_at_startup(
    env: MutableMapping[str, str] = os.environ,
    measure: Callable[[], Optional[float]] = other_busy_cores,
    imported: Optional[set[str]] = None,
) -> Optional[str]:
    """Set the wait policy in ``env`` for this process (and those it starts) and return why, or None when it
    is too late (torch already imported: in-process callers keep what their process has)."""
    modules = sys.modules if imported is None else imported
    if "torch" in modules:
        return None
    if CHOICE in env:
        return env[CHOICE]  # decided by the process that started this one
    set_by_user = [f"{k}={env[k]}" for k in USER_VARIABLES if env.get(k)]
    if set_by_user:
        reason = f"{', '.join(set_by_user)} (set by the environment)"
    elif env.get("OMP_NUM_THREADS", "").strip() == "1":
        reason = "one thread: no team waits"
    else:
        busy = measure()
        cores = len(usable_cpus())
        if busy is not None and BUSY_CORES <= busy < cores - BUSY_CORES:
            env["OMP_WAIT_POLICY"] = "passive"
            reason = f"OMP_WAIT_POLICY=passive ({busy:.1f} of {cores} cores busy with other processes at start-up)"
        else:
            env["GOMP_SPINCOUNT"] = str(BRIEF_SPINS)
            if busy is None:
                load = "the machine's load is unknown"
            elif busy < BUSY_CORES:
                load = f"{busy:.1f} of {cores} cores busy at start-up"
            else:
                load = f"{busy:.1f} of {cores} cores busy with other processes at start-up: every core taken"
            reason = f"GOMP_SPINCOUNT={BRIEF_SPINS}: spin briefly, then sleep ({load})"
    env[CHOICE] = reason
    return reason


def describe_wait_policy(env: Mapping[str, str]) -> str:
    """How this process's idle OpenMP threads wait, from its environment: libgomp's default (spin a
    while, about 300,000 polls, then sleep; 100 polls when its threads outnumber the cores the process may
    use), ``OMP_WAIT_POLICY`` (active: spin; passive: sleep at once) or ``GOMP_SPINCOUNT``."""
    if env.get(CHOICE):
        return env[CHOICE]  # chosen at start-up (choose_at_startup), with its reason
    policy = env.get("OMP_WAIT_POLICY", "").strip().lower()
    spins = env.get("GOMP_SPINCOUNT", "").strip()
    parts = [f"OMP_WAIT_POLICY={policy}"] if policy else []
    if spins:
        parts.append(f"GOMP_SPINCOUNT={spins}")
    return ", ".join(parts) if parts else "spin, then sleep (libgomp default)"
