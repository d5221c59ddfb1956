"""The parallelism planner: its counts are the meta-device model's, its memory moves the way meshes move it,
its smallest-fit search equals brute force, and its command line refuses bad values by name."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from analysis import parallel_plan
from components.model import Decoder, build_on_meta
from components.optim.adamw import AdamWConfig
from runtime import memory_accounting as accounting
from tests.helpers import compose_root

H100 = accounting.GPUS["h100"].memory_bytes
H200 = accounting.GPUS["h200"].memory_bytes


@pytest.fixture(scope="module")
def k3_full():
    root = compose_root("experiment=k3_full")
    model = build_on_meta(root.decoder_config())
    return root, model, accounting.inventory(model, root.optimizer)


def _routed(model) -> list:
    return [b.ffn.routed_experts() for b in [*model.layers, *model.mtp] if b.ffn.routed_experts() is not None]


def test_counts_are_the_meta_device_models(k3_full):
    root, model, inv = k3_full
    unique = {id(p): p for p in model.parameters()}.values()
    assert inv.total_params == sum(p.numel() for p in unique) == 2_779_484_393_568
    experts = _routed(model)
    assert inv.expert_params == sum(p.numel() for e in experts for p in e.parameters())
    assert inv.moe_layers == len(experts) == 92 and inv.num_experts == 896 and inv.top_k == 16
    assert sum(u.dense + u.experts for u in inv.units) + inv.root == inv.total_params
    # per rank at (efsdp, ep) = (16, 8): 112 experts per ep rank, 7 whole experts stored on each
    p = accounting.plan(inv, accounting.Mesh(128, 8, True, 1, 4096), H200)
    per_expert = sum(p0[0].numel() for p0 in experts[0].parameters())
    assert p.experts_gathered == 112 and p.experts_stored == 7
    assert p.expert_params_per_rank == len(experts) * 7 * per_expert
    # the largest unit, gathered at ep 8: a decoder layer with an eighth of its experts
    sizes = {"embed": model.embed.weight.numel(), "lm_head": model.lm_head.weight.numel()}
    for i, layer in enumerate(model.layers):
        routed = layer.ffn.routed_experts()
        routed_n = sum(t.numel() for t in routed.parameters()) if routed is not None else 0
        sizes[f"layers.{i}"] = sum(t.numel() for t in layer.parameters()) - routed_n + routed_n // 8
    name = max(sizes, key=sizes.get)
    assert (p.largest_unit, p.largest_unit_params) == (name, sizes[name])
    assert name.startswith("layers.") and sizes[name] == 633_681_632 + 29_595_009_024 // 8


def test_optimizer_state_follows_the_optimizer(k3_full):
    root, model, inv = k3_full
    from components.optim.param_groups import muon_partition

    muon, _ = muon_partition(model, root.optimizer.per_head, root.optimizer.per_head_scope)
    assert inv.muon_params == sum(p.numel() for _, p, _ in muon)
    adamw = accounting.inventory(model, AdamWConfig())
    assert adamw.optimizer == "adamw" and adamw.muon_params == 0
    # one GPU, unsharded: Muon 4 B per orthogonalised number and 8 B on the rest; AdamW 8 B on every one
    muon_state = accounting.sharded_numbers(inv, 1)["optimizer"] * 4
    adamw_state = accounting.sharded_numbers(adamw, 1)["optimizer"] * 4
    assert muon_state == 4 * inv.muon_params + 8 * inv.adamw_params
    assert adamw_state == 8 * inv.total_params


def test_sharding_pads_dimension_zero_as_fsdp2_does():
    root = compose_root("experiment=k3_small")
    model = build_on_meta(root.decoder_config())
    inv = accounting.inventory(model, root.optimizer)
    routed = {id(p) for e in _routed(model) for p in e.parameters()}
    for gpus, ep in ((1, 1), (3, 1), (4, 2), (8, 8), (64, 4)):
        expected = 0
        for p in {id(p): p for p in model.parameters()}.values():
            rows = p.shape[0]
            if id(p) in routed:  # E / ep whole experts, then dimension 0 over efsdp
                rows, group = math.ceil(rows / ep), gpus // ep
            else:
                group = gpus
            expected += math.ceil(rows / group) * (p.numel() // p.shape[0])
        assert accounting.sharded_numbers(inv, gpus, ep)["params"] == expected, (gpus, ep)


def test_memory_moves_the_obvious_ways(k3_full):
    _, _, inv = k3_full

    def total(gpus, ep=8, ac=True, mb=1, seq=4096):
        return accounting.plan(inv, accounting.Mesh(gpus, ep, ac, mb, seq), H100)

    counts = [8, 16, 64, 128, 256, 512, 896, 1024, 2048]
    for ep in (1, 8, 64):
        totals = [total(g, ep).total for g in counts if g % ep == 0]
        assert totals == sorted(totals, reverse=True), ep  # more GPUs: never more per GPU
        assert totals[0] > totals[-1]
    gathered = [total(1792, ep).gathered_units for ep in (1, 2, 8, 64, 896)]
    assert gathered == sorted(gathered, reverse=True) and gathered[0] > 5 * gathered[-1]  # larger ep: less
    assert total(512, ac=True).activations < total(512, ac=False).activations / 10
    assert total(512, mb=1).activations < total(512, mb=2).activations < total(512, mb=4).activations
    assert total(512, seq=2048).activations < total(512, seq=4096).activations < total(512, seq=8192).activations
    assert total(512, ep=1).all_to_all == 0 < total(512, ep=8).all_to_all < total(512, ep=8, mb=2).all_to_all
    # a bigger GPU never needs more GPUs
    for seq in (4096, 8192):
        small, big = accounting.smallest_fit(inv, H100, seq), accounting.smallest_fit(inv, H200, seq)
        assert big is not None and (small is None or big.gpus <= small.gpus)


def _brute_force(inv, capacity, seq, max_gpus):
    fits = []
    for gpus, ep, ac in itertools.product(
        accounting.candidate_gpu_counts(8, max_gpus), inv.expert_parallel_sizes(), (False, True)
    ):
        if gpus % ep == 0:
            p = accounting.plan(inv, accounting.Mesh(gpus, ep, ac, 1, seq), capacity)
            if p.fits:
                fits.append(p)
    # fewest GPUs; then no checkpointing; then an ep that tiles 8-GPU nodes; then the smaller ep
    return min(
        fits, key=lambda p: (p.gpus, p.activation_checkpointing, 8 % p.ep != 0 and p.ep % 8 != 0, p.ep), default=None
    )


@pytest.mark.parametrize("capacity", [H100, H200, int(1.6 * H200)], ids=["h100", "h200", "224GiB"])
def test_smallest_fit_agrees_with_brute_force(k3_full, capacity):
    _, _, inv = k3_full
    for seq in (4096, 8192):
        found = accounting.smallest_fit(inv, capacity, seq, max_gpus=1024)
        expected = _brute_force(inv, capacity, seq, 1024)
        assert found == expected, (seq, found, expected)
    assert accounting.smallest_fit(inv, H100, 4096, max_gpus=1024) is not None  # the searches found something


def test_smallest_fit_of_a_small_model_is_within_one_node():
    root = compose_root("experiment=k3_small")
    inv = accounting.inventory_for(root)
    fit = accounting.smallest_fit(inv, H100, 2048)
    assert (fit.gpus, fit.activation_checkpointing) == (1, False)
    tight = accounting.plan(inv, accounting.Mesh(1, 1, False, 1, 2048), H100).total
    # a GPU just below one GPU's need: the search moves to two GPUs or checkpointing, whatever brute force says
    for capacity in (tight - 1, tight // 2, tight // 3):
        assert accounting.smallest_fit(inv, capacity, 2048, max_gpus=64) == _brute_force(inv, capacity, 2048, 64)


def _saved_numbers_per_token(layer, state, residual, tokens: int) -> tuple[float, object]:
    """fp32 numbers per token the layer saves for backward (every saved storage once, weights left out),
    and the layer's output."""
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(state, residual)
    return sum(storages.values()) / 4 / tokens, out


@pytest.mark.parametrize("overrides", [("experiment=k3_tiny",), ("model=small", "mixer=gqa")], ids=["k3_tiny", "gqa"])
def test_activation_rule_bounds_the_saved_tensors_of_the_reference_paths(overrides):
    """The per-layer estimate is at least what the CPU reference path saves for backward, and at most 1.5x:
    KDA with the dense FFN, KDA with Stable LatentMoE, MLA with Stable LatentMoE (k3_tiny's four
    layers), GQA with the dense FFN."""
    torch.manual_seed(0)
    root = compose_root(*overrides, "trainer.precision=32-true")
    model = Decoder(root.decoder_config())
    inv = accounting.inventory(model, root.optimizer)
    tokens = 64
    state = model.residual.start(torch.randn(1, tokens, model.d_model, requires_grad=True))
    for layer, estimate in list(zip(model.layers, inv.layers))[:4]:
        measured, state = _saved_numbers_per_token(layer, state, model.residual, tokens)
        assert measured <= estimate.numbers_per_token <= 1.5 * measured, (estimate, measured)


def test_command_line_table_and_json(k3_full, capsys):
    _, _, inv = k3_full
    assert parallel_plan.main(["experiment=k3_full", "--gpu", "h200", "--seq", "4096", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    fit = accounting.smallest_fit(inv, H200, 4096)
    block = r["micro_batches"][0]
    assert block["smallest_fit"] == fit.as_dict() and r["model"]["total_params"] == inv.total_params
    assert any(row["with_checkpointing"] == fit.as_dict() for row in block["candidates"])
    assert parallel_plan.main(["experiment=k3_full", "--gpu", "h100", "--seq", "4096"]) == 0
    out = capsys.readouterr().out
    assert "smallest mesh that fits" in out and "trainer=fsdp2 trainer.devices=8" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpu", "a100", "--seq", "4096"], "argument --gpu: invalid choice: 'a100' (choose from 'h100', 'h200')"),
        (["--gpu", "h100", "--seq", "0"], "argument --seq: must be >= 1, got 0"),
        (["--gpu", "h100", "--seq", "4k"], "argument --seq: '4k' is not a whole number"),
    ],
)
def test_bad_values_are_refused_with_exit_status_2(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parallel_plan.main(["experiment=k3_full", *args])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_bad_override_is_one_line_with_exit_status_2(capsys):
    assert parallel_plan.main(["experiment=k3_full", "trainer.bogus=1", "--gpu", "h100", "--seq", "4096"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("analysis.parallel_plan: error: trainer.bogus")


def test_the_slurm_preset_is_the_planners_smallest_h100_mesh_for_k3_full(k3_full):
    _, _, inv = k3_full
    root = compose_root("experiment=k3_full", "trainer=slurm_k3", "data.seq_len=4096", "data.batch_size=896")
    t = root.trainer
    fit = accounting.smallest_fit(inv, H100, 4096)
    assert (t.strategy, t.precision, t.devices) == ("fsdp2", "bf16-mixed", 8)
    assert (t.devices * t.num_nodes, t.activation_checkpointing) == (fit.gpus, fit.activation_checkpointing)
    assert t.expert_parallel == fit.ep == 32


def test_traffic_per_micro_step(k3_full):
    _, _, inv = k3_full
    one = accounting.traffic_bytes(inv, accounting.Mesh(1, 1, False, 1, 4096))
    assert one == {"all_gather": 0, "reduce_scatter": 0, "all_to_all": 0}
    # ep over all ranks: experts are never gathered, only the other parameters (bf16 twice, fp32 once)
    dense = inv.total_params - inv.expert_params
    whole_ep = accounting.traffic_bytes(inv, accounting.Mesh(896, 896, False, 1, 4096))
    assert whole_ep["all_gather"] == round(2 * 2 * dense * 895 / 896)
    assert whole_ep["reduce_scatter"] == round(4 * dense * 895 / 896)
    rows = 4096 * 16 * 92 * 3584 * 2  # tokens x top-k x MoE layers x latent width x bf16
    assert whole_ep["all_to_all"] == round(4 * rows * 895 / 896)
    recomputed = accounting.traffic_bytes(inv, accounting.Mesh(896, 896, True, 1, 4096))["all_to_all"]
    assert recomputed == round(6 * rows * 895 / 896)
