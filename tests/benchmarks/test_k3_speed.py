"""benchmarks/k3_speed.py: its fixed reference rows (the baseline's short convolution computes what the trainer's does,
and the swap that installs it is undone after the row runs."""

from __future__ import annotations

import pytest
import torch

import benchmarks.k3_speed as k3_speed
import components.mixers.kda as kda
from benchmarks.k3_speed import as_before, strided_taps_conv
from components.nn.segments import Segments


@pytest.mark.parametrize("case", ["zero prefix", "prefix", "documents"])
def test_the_baseline_convolution_equals_the_trainers(case):
    gen = torch.Generator().manual_seed(0)
    B, T, P, W = 2, 9, 6, 4
    x = torch.randn(B, T, P, generator=gen, dtype=torch.float64)
    w = torch.randn(P, 1, W, generator=gen, dtype=torch.float64)
    prefix = torch.randn(B, W - 1, P, generator=gen, dtype=torch.float64) if case == "prefix" else None
    xp = torch.cat([prefix if prefix is not None else x.new_zeros(B, W - 1, P), x], dim=1)
    segments = Segments(torch.tensor([[0] * 4 + [1] * 5, [0] * 7 + [1] * 2])) if case == "documents" else None
    want = kda.shifted_depthwise_conv(x, w, xp if prefix is not None else None, segments)
    got = strided_taps_conv(x, w, xp if prefix is not None else None, segments)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_as_before_swaps_the_convolution_only_while_it_runs():
    current = kda.shifted_depthwise_conv
    with as_before():
        assert kda.shifted_depthwise_conv is strided_taps_conv
    assert kda.shifted_depthwise_conv is current
    with pytest.raises(RuntimeError), as_before():
        raise RuntimeError("a failing step")
    assert kda.shifted_depthwise_conv is current


def test_ablations_are_the_k3_small_experiments_with_what_each_swaps():
    from benchmarks.k3_speed import ablations
    from runtime.compose import compose_root

    found = ablations()
    assert {"all_mla", "no_mtp", "plain_residual", "swiglu"} <= set(found)
    for name, swaps in found.items():
        assert swaps.startswith(("with ", "without ")), (name, swaps)
    assert found["swiglu"] == "with SwiGLU instead of SiTU-GLU in every FFN"
    # each one composes: the fast path can be built from it
    root = compose_root(["experiment=k3_small_plain_residual"])
    assert root.residual.name == "plain"


def test_an_unknown_ablation_or_one_without_the_fast_path_is_refused_before_any_model_is_built(capsys):
    from benchmarks.k3_speed import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--ablations", "swiglu,bogus"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--ablations: unknown ['bogus']" in err and "plain_residual" in err
    with pytest.raises(SystemExit):
        main(["--paths", "eager bf16", "--ablations"])
    assert "keep 'fast' in --paths" in capsys.readouterr().err


def test_the_eager_rows_and_the_baseline_run_the_reference_kernels():
    import components.mixers.kda as kda_mixer
    import components.ops.activations as activations
    import components.ops.attnres as attnres_ops
    import components.ops.kda as kda_ops
    from benchmarks.k3_speed import BASELINE, PATHS, _run_as_before, _run_reference, _runner

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, generator=gen) * 6, torch.randn(64, generator=gen) * 60
    seen = []

    def step(ids):
        exact = torch.equal(activations.situ_glu(a, b), activations.situ_glu_reference(a, b))
        natives = (kda_ops.native_available(), kda_mixer.short_conv_native_available(), attnres_ops.native_available())
        seen.append((*natives, exact))
        return ids

    for name in PATHS:
        _runner(name)(step, 0)
    exp_form_exact = torch.equal(activations.situ_glu(a, b), activations.situ_glu_reference(a, b))
    natives = (kda_ops.native_available(), kda_mixer.short_conv_native_available(), attnres_ops.native_available())
    fast = (*natives, exp_form_exact)
    assert fast[-1] is False  # the exp form rounds differently from the reference
    assert seen == [fast if name == "fast" else (False, False, False, True) for name in PATHS]
    assert _runner(BASELINE) is _run_as_before and _runner("eager bf16") is _run_reference


@pytest.mark.parametrize("native,expected", [(True, "bf16"), (False, "fp32")])
def test_the_bf16_rows_run_in_fp32_where_bf16_products_are_emulated(monkeypatch, native, expected):
    monkeypatch.setattr(k3_speed, "cpu_has_native_bf16", lambda: native)
    assert k3_speed.low_precision("auto") == expected
    assert k3_speed.low_precision("bf16") == "bf16"  # forced
    assert k3_speed.low_precision("fp32") == "fp32"


def test_the_table_names_the_precision_each_row_ran_in(monkeypatch, capsys):
    """Where bf16 is emulated the "eager bf16" row runs in fp32, and its line says so."""
    monkeypatch.setattr(k3_speed, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(k3_speed, "matmul_peak", lambda seconds=1.0, dtype=None: 1e11)
    argv = ["--batch", "2", "--seq", "16", "--rounds", "1", "--warmup", "0", "--curve-steps", "0", "--no-default"]
    assert k3_speed.main([*argv, "--paths", "eager fp32,eager bf16", "model.n_layers=4"]) in (0, None)
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("path"))
    assert header.split()[1:3] == ["runs", "in"]
    rows = {line[:14].strip(): line[14:].split()[0] for line in lines if line[:14].strip() in k3_speed.PATHS}
    assert rows == {"eager fp32": "fp32", "eager bf16": "fp32"}
