"""The GPU check rehearsed on a CPU: every row of ``benchmarks.gpu_check`` runs at ``--tiny`` sizes on the
paths a GPU takes (the back-ends resolved as on CUDA, tests/kernel_fakes.py), fla's and the project's
Triton kernels executed by Triton's interpreter (with tests/reference/triton_shims.py), FSDP2 on two gloo
ranks, the compiled rows with ``aot_eager``. A row that would crash, or fail its measured tolerance, on the
first GPU fails here first.

Run as a script by the tests (``TRITON_INTERPRET=1`` must be set before Triton is imported):
``python tests/benchmarks/test_gpu_check_rehearsal.py [--only NAMES]`` prints the rows as JSON; under
``RANK`` / ``WORLD_SIZE`` each process joins a gloo group first (rank 0 prints)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PASSING = {"pass", "ok"}


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return env


def _rows(stdout: str) -> dict[str, list[dict]]:
    rows: dict[str, list[dict]] = {}
    for row in json.loads(stdout.strip().splitlines()[-1]):
        rows.setdefault(row["check"], []).append(row)
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_every_single_process_row_runs_on_a_cpu():
    out = subprocess.run(
        [sys.executable, __file__, "--skip", "fsdp2"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rows = _rows(out.stdout)
    from benchmarks import gpu_check as G

    expected = {c.name for c in G.build_checks(G.parse_args(["--tiny"]))} - {"fsdp2"}
    assert set(rows) == expected
    failed = [r for rs in rows.values() for r in rs if r["status"] not in PASSING]
    assert not failed, "\n".join(f"{r['check']} {r['size']}: {r['status']} {r['note']}" for r in failed)
    for name in ("train_default_compiled", "train_k3_small_compiled"):
        (row,) = rows[name]
        assert "0 breaks" in row["note"] or "breaks (" in row["note"], row["note"]
    (compiled,) = rows["train_default_compiled"]
    assert ": 1 graphs, 0 breaks" in compiled["note"], compiled["note"]  # one graph on the kernel paths


@pytest.mark.slow
def test_fsdp2_row_on_two_gloo_ranks():
    env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2")
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--only", "fsdp2"],
            cwd=REPO,
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    (row,) = _rows(outs[0][0])["fsdp2"]
    assert row["status"] == "pass", f"{row['status']}: {row['note']}"
    assert "world size 2, gloo" in row["note"]


def main(argv: list[str]) -> None:
    import torch

    from tests.reference.triton_shims import install_triton_cpu_shims

    install_triton_cpu_shims()
    torch.set_num_threads(1)
    from benchmarks import gpu_check as G
    from tests.kernel_fakes import fake_cuda

    fake_cuda(pytest.MonkeyPatch())  # the back-ends a GPU run resolves
    skip = set(argv[argv.index("--skip") + 1].split(",")) if "--skip" in argv else set()
    only = ["--only", argv[argv.index("--only") + 1]] if "--only" in argv else []
    args = G.parse_args(["--tiny", "--compile-backend", "aot_eager", "--peak-tflops", "1", *only])
    checks = [c for c in G.build_checks(args) if c.name not in skip]
    if "RANK" in os.environ:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    rows = G.run_checks(checks, G.Context(args, torch.device("cpu")), log=lambda s: print(s, file=sys.stderr))
    print(G.format_table(rows), file=sys.stderr)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps([dataclasses.asdict(r) for r in rows]))
    if "RANK" in os.environ:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
