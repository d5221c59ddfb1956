"""benchmarks/gpu_check.py on a CPU: the dry mode lists every check as skipped with its reason and exits 0;
the parity verdicts, the error handling and the exit status, with fake checks."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import gpu_check as G
from tests.helpers import REPO


def run_script(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", *args],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def table_lines(stdout: str, name: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.split(" ")[0] == name]


def check_names(*argv: str) -> list[str]:
    return list(dict.fromkeys(c.name for c in G.build_checks(G.parse_args(list(argv)))))


def test_without_cuda_every_check_is_skipped_with_the_reason():
    out = run_script(env={"CUDA_VISIBLE_DEVICES": ""})  # no visible GPU even where there is one
    assert out.returncode == 0, out.stderr
    names = check_names()
    assert {
        "kda_fla",
        "kda_fla_varlen",
        "kda_mixer",
        "attnres_fla",
        "situ_glu_triton",
        "moe_experts",
        "moe_vs_dense[stable_latent_moe]",
        "train_default",
        "train_default_compiled",
        "train_k3_small",
        "fsdp2",
    } <= set(names)
    for name in names:
        lines = table_lines(out.stdout, name)
        assert lines, f"{name} missing from:\n{out.stdout}"
        for line in lines:
            assert " skipped " in line and G.NO_CUDA in line, line
    assert len(table_lines(out.stdout, "kda_fla")) == 2  # T = 2048 and 8192
    assert "T=8192" in out.stdout
    assert "exit status 0" in out.stdout


def test_dry_run_flag_and_quick_sizes():
    out = run_script("--dry-run", "--quick", "--only", "kda_fla,fsdp2")
    assert out.returncode == 0, out.stderr
    assert [line.split(" ")[0] for line in out.stdout.splitlines() if " skipped " in line] == [
        "kda_fla",
        "kda_fla",
        "fsdp2",
    ]
    assert G.DRY_RUN in out.stdout and "T=8192" not in out.stdout and "T=1024" in out.stdout


def test_unknown_check_name_is_refused():
    with pytest.raises(SystemExit, match="unknown check"):
        G.build_checks(G.parse_args(["--only", "kda_fla,nonsense"]))


@pytest.mark.parametrize("script", ["kda_ops.py", "mixers.py", "moe.py", "residual.py", "situ_glu.py"])
def test_the_other_benchmarks_still_run_as_scripts(script):
    # benchmarks/ is a package now; the scripts' `from timing import ...` must still resolve
    out = subprocess.run(
        [sys.executable, f"benchmarks/{script}", "--help"],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr


# -- verdicts and exit status -------------------------------------------------------------------------
def test_judge_and_exit_status():
    assert G.judge(G.Row("a", "", rel=1e-3, tol=1e-2)) == "pass"
    assert G.judge(G.Row("a", "", rel=2e-2, tol=1e-2)) == "FAIL"
    assert G.judge(G.Row("a", "", rel=math.nan, tol=1e-2)) == "FAIL"
    assert G.judge(G.Row("a", "", rel=None, tol=1e-2)) == "FAIL"  # a parity row that measured nothing
    assert G.judge(G.Row("a", "", fast_ms=1.0)) == "ok"  # a measurement, no parity
    rows = [G.Row("a", "", status=s) for s in ("pass", "ok", "skipped")]
    assert G.exit_status(rows) == 0
    assert G.exit_status([*rows, G.Row("b", "", status="FAIL")]) == 1
    assert G.exit_status([*rows, G.Row("b", "", status="error")]) == 1
    assert G.exit_status([]) == 0


def test_compare_reports_the_worst_tensor():
    ref = {"out": torch.ones(100), "dx": torch.ones(100)}
    assert G.compare({k: v.clone() for k, v in ref.items()}, ref) == (0.0, 0.0, "out")
    noisy = {"out": torch.ones(100), "dx": torch.ones(100) + 0.1}
    max_abs, rel, worst = G.compare(noisy, ref)
    assert worst == "dx" and max_abs == pytest.approx(0.1, rel=1e-5) and rel == pytest.approx(0.1, rel=1e-5)
    assert G.compare({"out": torch.tensor([math.nan])}, {"out": torch.tensor([1.0])})[1] == math.inf


def test_run_checks_turns_failures_into_rows_and_goes_on(monkeypatch):
    monkeypatch.setitem(G.NEEDS, "fla", ("no_such_module_for_gpu_check",))
    ran = []

    def parity(rel: float):
        def fn(ctx, row):
            ran.append(row.check)
            out = {"out": torch.ones(10) * (1 + rel)}
            G.set_parity(row, out, {"out": torch.ones(10)}, tol=1e-2)

        return fn

    def boom(ctx, row):
        ran.append(row.check)
        raise ValueError("kernel exploded\nsecond line")

    def skip(ctx, row):
        raise G.Skip("grouped_mm does not run here")

    checks = [
        G.Check("good", "s", parity(1e-3)),
        G.Check("boom", "s", boom),
        G.Check("bad", "s", parity(0.5)),
        G.Check("skip", "s", skip),
        G.Check("needs_fla", "s", parity(0.0), ("fla",)),
        G.Check("after", "s", parity(0.0)),
    ]
    ctx = G.Context(G.parse_args([]), torch.device("cpu"))
    rows = G.run_checks(checks, ctx, log=lambda s: None)
    status = {r.check: r.status for r in rows}
    assert status == {
        "good": "pass",
        "boom": "error",
        "bad": "FAIL",
        "skip": "skipped",
        "needs_fla": "skipped",
        "after": "pass",
    }
    assert ran == ["good", "boom", "bad", "after"]  # the checks after the error still ran
    notes = {r.check: r.note for r in rows}
    assert "ValueError: kernel exploded" in notes["boom"] and "second line" not in notes["boom"]
    assert notes["needs_fla"].startswith("fla not importable: no_such_module_for_gpu_check")
    assert G.exit_status(rows) == 1
    assert G.exit_status([r for r in rows if r.check not in ("boom", "bad")]) == 0
    table = G.format_table(rows)
    assert all(name in table for name in status) and "5.00e-01" in table  # rel of the failing row

    late = G.Context(G.parse_args(["--budget-s", "0"]), torch.device("cpu"), deadline=-math.inf)
    (row,) = G.run_checks([G.Check("late", "s", parity(0.0))], late, log=lambda s: None)
    assert row.status == "skipped" and "time budget" in row.note
