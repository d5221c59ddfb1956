"""The default run's training speed on a busy machine, with PyTorch's threads spinning or sleeping.

    python -m benchmarks.busy_machine [--steps 12 --rounds 2 --competitors 1]

PyTorch's OpenMP threads spin while they wait for work. Beside other busy processes on a small machine
(the 2-core case: a test suite or a second run next to the training) the spinning threads steal the
cores their own siblings need, and a run slows down several-fold. ``OMP_WAIT_POLICY=PASSIVE`` makes
waiting threads sleep instead. This measures the default run's steady-state tokens/s (``train.py`` with
the README's configuration, a few steps after the warm ones) under both policies, on an idle machine and
beside ``--competitors`` processes that each multiply matrices on every core with the default policy (an
ordinary PyTorch workload). Conditions run in interleaved rounds, order rotated, so drift hits all alike.
Run it on an otherwise idle machine: the competitors are the only load it should see.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from runtime.rate_probe import REPO, probe_rate

COMPETITOR = "import torch\na = torch.randn(384, 384)\nwhile True:\n    a = torch.tanh(a @ a)\n"


def start_competitors(n: int) -> list[subprocess.Popen]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    procs = [subprocess.Popen([sys.executable, "-c", COMPETITOR], env=env) for _ in range(n)]
    time.sleep(3.0)  # their torch import done, their threads busy
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="steady-state steps timed per measurement")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of all conditions")
    p.add_argument("--competitors", type=int, default=1, help="busy PyTorch processes beside the run")
    p.add_argument("overrides", nargs="*", help="train.py overrides (default: the README's run)")
    args = p.parse_args(argv)

    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    policies = {"spin (OMP_WAIT_POLICY unset)": {**base}, "passive": {**base, "OMP_WAIT_POLICY": "PASSIVE"}}
    conditions = [(load, policy) for load in ("idle", "busy") for policy in policies]
    rates: dict[tuple[str, str], list[float]] = {c: [] for c in conditions}
    for r in range(args.rounds):
        for i in range(len(conditions)):
            load, policy = conditions[(i + r) % len(conditions)]
            competitors = start_competitors(args.competitors) if load == "busy" else []
            try:
                env = {**policies[policy], "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO)}
                rate = probe_rate(["logger=csv", *args.overrides], args.steps, env=env, warm=3)
            finally:
                stop(competitors)
            rates[(load, policy)].append(rate.tokens_per_s)
            print(f"round {r}: {load:<4} {policy:<28} {rate.tokens_per_s:8,.0f} tokens/s", flush=True)

    reference = statistics.median(rates[("idle", next(iter(policies)))])
    print(f"\ndefault run, {args.steps} steady steps, {args.rounds} rounds, {args.competitors} competitor(s) when busy")
    print(f"{'machine':<6} {'wait policy':<28} {'tokens/s':>10} {'vs idle spin':>13}")
    for load, policy in conditions:
        median = statistics.median(rates[(load, policy)])
        print(f"{load:<6} {policy:<28} {median:>10,.0f} {median / reference:>12.2f}x")
    for load in ("idle", "busy"):
        spin, passive = (statistics.median(rates[(load, q)]) for q in policies)
        print(f"passive / spin, {load}: {passive / spin:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
