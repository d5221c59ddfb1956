"""The default run's share of a busy machine: tuned CPU threads against a fixed thread count, side by side.

    python -m benchmarks.busy_machine            # 0, 1 and 2 competitors of each kind, 2 rounds (about 25 min)
    python -m benchmarks.busy_machine --quick    # 0 and 1 competitor, fewer steps, 1 round (about 5 min)

PyTorch's OpenMP threads spin while they wait for work; beside other busy processes the run's threads
wait for siblings the scheduler has put aside, and a run slows down several-fold. ``trainer.cpu_threads=auto``
times steps at each thread count and keeps the fastest (runtime/cpu_thread_tuning.py), and every run's
OpenMP wait policy is chosen at start-up from the machine's load (passive when other processes are busy, a
brief spin otherwise: runtime/cpu_wait_policy.py); the baseline ``fixed (before)`` is the behaviour before
both (one thread per core, libgomp's default wait policy). This measures the default run's steady-state
throughput (``train.py`` with the README's configuration; the tokens of the steps after the warm steps and
the tuner's first probe over their time) under both, alone and beside 1 and 2 competitors of two kinds: a
single-threaded pure-Python busy loop, and a PyTorch matmul loop on every core with the default settings.

A run's fair share beside competitors is the part of the cores it would get if every busy thread got an
equal slice, against what it uses alone: its ``cores`` threads among ``cores`` + the competitors' threads
(one per Python loop, one per core per PyTorch loop), at most all of them. The table gives each rate as a
fraction of that share of the fixed run's rate alone, the median over rounds. Conditions run in
interleaved rounds, order rotated, so drift hits all alike. Run it on an otherwise idle machine: the
competitors are the only load it should see.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from runtime.cpu_thread_tuning import TuningPlan, candidate_threads
from runtime.cpu_wait_policy import CHOICE, USER_VARIABLES, usable_cpus
from runtime.rate_probe import REPO, Rate, probe_rate

COMPETITORS = {
    "python": "while True:\n    pass\n",
    "matmul": "import torch\na = torch.randn(384, 384)\nwhile True:\n    a = torch.tanh(a @ a)\n",
}
SETUPS = {"fixed (before)": "trainer.cpu_threads=fixed", "auto": "trainer.cpu_threads=auto"}
BEFORE, TUNED = SETUPS
# the baseline keeps libgomp's default wait policy: marked as chosen already, train.py does not choose one
BASELINE_ENV = {CHOICE: "spin, then sleep (libgomp default: the benchmark's baseline)"}


def warm_steps(cores: int, plan: TuningPlan = TuningPlan()) -> int:
    """Steps left out of each rate: the first steps (compilation) and the tuner's first probe (its warm
    steps, ``probe_steps`` on each candidate count, and the step after it sets the kept count): 11 on 2
    cores."""
    return plan.warm_steps + plan.probe_steps * len(candidate_threads(cores)) + plan.settle_steps


HELD_WITH_COMPETITORS = 0.8  # the must-show: share of the fair share kept beside competitors
KEPT_ALONE = 0.95  # and of the fixed run's speed alone


@dataclass(frozen=True)
class Load:
    kind: str  # "idle", "python" or "matmul"
    competitors: int

    @property
    def label(self) -> str:
        return "alone" if self.competitors == 0 else f"{self.competitors} x {self.kind}"

    def competitor_threads(self, cores: int) -> int:
        return self.competitors * (1 if self.kind == "python" else cores)


def fair_share(cores: int, competitor_threads: int) -> float:
    """The part of its quiet speed a run of ``cores`` threads is owed beside ``competitor_threads`` busy
    threads: its threads' equal slice of the cores."""
    return min(1.0, cores / (cores + competitor_threads))


def loads(max_competitors: int) -> list[Load]:
    return [Load("idle", 0)] + [Load(k, n) for n in range(1, max_competitors + 1) for k in COMPETITORS]


@dataclass(frozen=True)
class Row:
    load: Load
    setup: str
    tokens_per_s: float
    fair: float  # fair share of the fixed run's speed alone
    of_fair: float  # tokens/s as a fraction of that share
    vs_before: float  # tokens/s against the fixed run's under the same load


def share_rows(rates: dict[tuple[Load, str], float], cores: int) -> list[Row]:
    """One row per (load, setup), from the median tokens/s of each: the fraction of its fair share and
    against the fixed run under the same load."""
    alone = rates[(Load("idle", 0), BEFORE)]
    rows = []
    for load, setup in rates:
        fair = fair_share(cores, load.competitor_threads(cores))
        rate = rates[(load, setup)]
        rows.append(Row(load, setup, rate, fair, rate / (alone * fair), rate / rates[(load, BEFORE)]))
    return rows


def format_table(rows: list[Row]) -> str:
    lines = [
        "| machine | threads | tokens/s | fair share | of fair share | vs fixed |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        shares = f"{r.fair:.2f} | {r.of_fair:.2f} | {r.vs_before:.2f}x"
        cells = [r.load.label, r.setup, f"{r.tokens_per_s:,.0f}", shares]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdicts(rows: list[Row]) -> list[str]:
    """The must-show, checked on the tuned rows: each line says what held and by how much."""
    out = []
    for r in rows:
        if r.setup != TUNED:
            continue
        if r.load.competitors == 0:
            ok = r.vs_before >= KEPT_ALONE
            verdict = "ok" if ok else "FAIL"
            out.append(f"{verdict}: alone, auto keeps {r.vs_before:.2f} of the fixed run's speed (>= {KEPT_ALONE})")
        else:
            ok = r.of_fair >= HELD_WITH_COMPETITORS
            out.append(
                f"{'ok' if ok else 'FAIL'}: beside {r.load.label}, auto holds {r.of_fair:.2f} of its fair share "
                f"(>= {HELD_WITH_COMPETITORS})"
            )
    return out


def start_competitors(load: Load) -> list[subprocess.Popen]:
    env = {k: v for k, v in os.environ.items() if k not in (*USER_VARIABLES, "OMP_NUM_THREADS")}
    procs = [subprocess.Popen([sys.executable, "-c", COMPETITORS[load.kind]], env=env) for _ in range(load.competitors)]
    if procs:
        time.sleep(3.0)  # their torch import done, their threads busy
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def chosen(rate: Rate) -> str:
    """What a tuned run chose, for the log: its steps on each thread count."""
    record = rate.cpu_threads or {}
    if record.get("mode") != "auto":
        return ""
    steps = ", ".join(f"{n}: {k}" for n, k in record.get("steps_by_threads", {}).items())
    return f"  (steps by thread count {steps})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=24, help="steady-state steps timed per measurement")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of all conditions (median of them)")
    p.add_argument("--max-competitors", type=int, default=2, help="competitors of each kind: 0 up to this many")
    cores = len(usable_cpus())  # the cores this process may use, as the wait policy counts them
    p.add_argument("--warm", type=int, default=warm_steps(cores), help="steps left out of each rate")
    p.add_argument("--quick", action="store_true", help="alone and 1 competitor of each kind, 6 steps")
    p.add_argument("overrides", nargs="*", help="train.py overrides (default: the README's run)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.max_competitors = 6, 1, 1

    unset = (*USER_VARIABLES, "OMP_NUM_THREADS", CHOICE)
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(WANDB_MODE="disabled", PYTHONPATH=str(REPO))
    conditions = [(load, setup) for load in loads(args.max_competitors) for setup in SETUPS]
    measured: dict[tuple[Load, str], list[float]] = {c: [] for c in conditions}
    for r in range(args.rounds):
        for i in range(len(conditions)):
            load, setup = conditions[(i + r) % len(conditions)]
            competitors = start_competitors(load)
            try:
                overrides = ["logger=csv", SETUPS[setup], *args.overrides]
                setup_env = {**env, **(BASELINE_ENV if setup == BEFORE else {})}
                rate = probe_rate(overrides, args.steps, env=setup_env, warm=args.warm, throughput=True)
            finally:
                stop(competitors)
            measured[(load, setup)].append(rate.tokens_per_s)
            print(
                f"round {r}: {load.label:<12} {setup:<16} {rate.tokens_per_s:8,.0f} tokens/s{chosen(rate)}", flush=True
            )

    rows = share_rows({c: statistics.median(v) for c, v in measured.items()}, cores)
    print(f"\ndefault run, {cores} cores, {args.steps} steady steps after {args.warm}, {args.rounds} round(s)")
    print(format_table(rows))
    print("\n".join(verdicts(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
