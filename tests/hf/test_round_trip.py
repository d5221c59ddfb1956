"""A run exported by ``analysis.export`` loads back through ``load_run`` with bit-identical weights and
logits, for every registered mixer x FFN x residual at tiny size and for K3 (layer plans, MTP); names and
shapes follow the documented layout; a tensor the model lacks, a missing one or a wrong shape is refused
by name."""

from __future__ import annotations

import itertools

import pytest
import torch

from analysis.export import export
from components.hf.key_map import MULTIMODAL_PREFIX, TEXT_PREFIX, UnmappedKey, checkpoint_mappings
from components.hf.safetensors_files import read_header
from components.hf.weights_folder import WeightsMismatch, check_weights, export_weights, import_weights
from components.model import Decoder
from components.registry import FFNS, MIXERS, RESIDUALS
from components.residual.base import CheckpointName
from runtime.config import to_container
from runtime.load_run import load_run
from tests.helpers import compose_root, save_run

# every registered composition: a new mixer, FFN or residual scheme joins the round trip by registering
COMPOSITIONS = list(itertools.product(MIXERS.names(), FFNS.names(), RESIDUALS.names()))
TINY = ["model.d_model=32", "model.n_layers=3", "model.tie_embeddings=false"]
SIZES = {
    "mla": [
        "mixer.n_heads=2",
        "mixer.q_lora_rank=16",
        "mixer.kv_lora_rank=8",
        "mixer.qk_nope_head_dim=8",
        "mixer.qk_rope_head_dim=8",
        "mixer.v_head_dim=8",
    ],
    "kda": ["mixer.n_heads=2", "mixer.head_dim=16"],
    "moe": ["ffn.num_experts=4", "ffn.top_k=2", "ffn.expert_hidden_dim=16"],
    "latent_moe": ["ffn.num_experts=4", "ffn.top_k=2", "ffn.expert_hidden_dim=16", "ffn.latent_dim=16"],
    "stable_latent_moe": ["ffn.num_experts=4", "ffn.top_k=2", "ffn.expert_hidden_dim=16", "ffn.latent_dim=16"],
}


def _overrides(mixer: str, ffn: str, residual: str, *extra: str) -> list[str]:
    return [
        f"mixer={mixer}",
        f"ffn={ffn}",
        f"residual={residual}",
        "data=corpus",
        *TINY,
        *SIZES.get(mixer, []),
        *SIZES.get(ffn, []),
        *extra,
    ]


def _perturbed(model: Decoder) -> Decoder:
    with torch.no_grad():  # break the zero inits (AttnRes queries, selection bias) so every tensor matters
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.add_(torch.randn_like(t) * 0.05)
    return model


def _model(mixer: str, ffn: str, residual: str, seed: int, *extra: str) -> Decoder:
    root = compose_root(*_overrides(mixer, ffn, residual, *extra))
    torch.manual_seed(seed)
    return _perturbed(Decoder(root.decoder_config()).eval())


def _assert_export_round_trips(tmp_path, overrides: list[str]) -> None:
    """A run folder holding the composed model (saved as train.py saves it), exported by analysis.export,
    loads back through load_run as the run's config, weights and logits."""
    root = compose_root(*overrides)
    torch.manual_seed(0)
    model = _perturbed(Decoder(root.decoder_config()).eval())
    run = save_run(root, model, tmp_path / "run")
    assert export(str(run), str(tmp_path / "export"), "text", None, 5.0, False) == 0  # export loads the run
    exported_root, from_export = load_run(str(tmp_path / "export"))
    assert to_container(exported_root) == to_container(root)
    for (key, a), b in zip(from_export.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), key
    ids = torch.randint(0, model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(from_export(ids), model(ids))


@pytest.mark.parametrize("mixer,ffn,residual", COMPOSITIONS)
def test_an_exported_run_loads_back_with_identical_logits(tmp_path, mixer, ffn, residual):
    extra = ["model.mtp_depth=1"] if residual == "block_attnres" else []
    _assert_export_round_trips(tmp_path, _overrides(mixer, ffn, residual, *extra))


K3_RUNS = {
    "k3_tiny": ["experiment=k3_tiny"],  # MTP depth 1, KDA x 3 then MLA, dense layer 0
    "k3_tiny-plan-overrides": [
        "experiment=k3_tiny",
        "model.n_layers=6",
        "model.mixer_plan.repeat=[mixer,mla,mixer]",
        "model.mtp_depth=2",
    ],
}


@pytest.mark.parametrize("case", K3_RUNS)
def test_an_exported_k3_run_loads_back_with_identical_logits(tmp_path, case):
    assert compose_root(*K3_RUNS[case]).model.mtp_depth >= 1
    _assert_export_round_trips(tmp_path, K3_RUNS[case])


K3_TINY = [
    "experiment=k3_small",
    "model.d_model=32",
    "model.n_layers=3",
    "mixer.n_heads=2",
    "mixer.head_dim=16",
    "mixers.mla.n_heads=2",
    "mixers.mla.q_lora_rank=16",
    "mixers.mla.kv_lora_rank=8",
    "mixers.mla.qk_nope_head_dim=8",
    "mixers.mla.qk_rope_head_dim=8",
    "mixers.mla.v_head_dim=8",
    "ffn.num_experts=4",
    "ffn.top_k=2",
    "ffn.expert_hidden_dim=16",
    "ffn.latent_dim=16",
    "ffns.dense.hidden_dim=64",
]


def test_k3_layout_names_and_shapes(tmp_path):
    torch.manual_seed(0)
    model = Decoder(compose_root(*K3_TINY).decoder_config())  # KDA, KDA, MLA; dense first; block AttnRes; one MTP depth
    export_weights(model, str(tmp_path), prefix=MULTIMODAL_PREFIX)
    header = read_header(str(tmp_path / "model.safetensors"))
    P = MULTIMODAL_PREFIX
    assert header[f"{P}embed_tokens.weight"][1] == (257, 32)
    assert "language_model.lm_head.weight" in header
    assert f"{P}layers.0.mlp.gate_proj.weight" in header  # dense first layer
    assert f"{P}layers.0.self_attn.A_log" in header and f"{P}layers.1.self_attn.f_a_proj.weight" in header  # KDA
    assert (
        f"{P}layers.2.self_attn.kv_a_proj_with_mqa.weight" in header
        and f"{P}layers.2.self_attn.g_proj.weight" in header
    )  # MLA
    assert header[f"{P}layers.2.block_sparse_moe.experts.3.w2.weight"][1] == (16, 16)  # [latent, hidden] per expert
    assert f"{P}layers.2.block_sparse_moe.gate.e_score_correction_bias" in header
    assert header[f"{P}layers.2.self_attention_res_proj.weight"][1] == (1, 32)
    assert header[f"{P}output_attn_res_proj.weight"][1] == (1, 32)
    assert header[f"{P}layers.3.eh_proj.weight"][1] == (32, 64)  # the MTP depth after the 3 decoder layers
    assert check_weights(str(tmp_path), model) == MULTIMODAL_PREFIX


def test_mismatches_are_named(tmp_path):
    model = _model("gqa", "moe", "plain", 0)
    export_weights(model, str(tmp_path))
    more = _model("gqa", "moe", "plain", 0, "ffn.num_experts=8")
    with pytest.raises(WeightsMismatch, match=r"block_sparse_moe\.gate\.weight has shape \[4, 32\].*needs \[8, 32\]"):
        import_weights(str(tmp_path), more)
    with_mtp = _model("gqa", "moe", "plain", 0, "model.mtp_depth=1")
    with pytest.raises(WeightsMismatch, match=r"model\.layers\.3\.\w+\.weight is missing \(the model's mtp\.0\."):
        check_weights(str(tmp_path), with_mtp)
    (tmp_path / "mtp").mkdir()
    export_weights(with_mtp, str(tmp_path / "mtp"))
    with pytest.raises(WeightsMismatch, match=r"model\.layers\.3\..* is not a parameter of this model"):
        import_weights(str(tmp_path / "mtp"), model)


def test_a_parameter_without_a_rule_is_an_error():
    model = _model("gqa", "dense", "plain", 0)
    model.register_parameter("stray", torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(UnmappedKey, match="'stray'"):
        checkpoint_mappings(model, TEXT_PREFIX)


def test_residual_tensors_take_the_names_their_scheme_declares(monkeypatch):
    model = _model("gqa", "dense", "full_attnres", 0)
    declared = {k: CheckpointName(f"renamed.{v.key}", v.shape) for k, v in model.residual.checkpoint_names().items()}
    monkeypatch.setattr(model.residual, "checkpoint_names", lambda: declared)
    state = model.state_dict()
    residual_keys = [k for k in state if k.startswith("residual.")]
    assert residual_keys
    for key, mapping in checkpoint_mappings(model, TEXT_PREFIX).items():
        if key in residual_keys:
            (name,) = mapping.keys
            assert name == f"model.{declared[key.removeprefix('residual.')].key}"
            stored = mapping.to_checkpoint(state[key])[0]
            assert tuple(stored.shape) == (declared[key.removeprefix("residual.")].shape or tuple(state[key].shape))
            assert torch.equal(mapping.from_checkpoint([stored]), state[key])
    del declared["output_attn_res_proj"]
    with pytest.raises(UnmappedKey, match="'residual.output_attn_res_proj'"):
        checkpoint_mappings(model, TEXT_PREFIX)


def test_sharded_export_has_an_index(tmp_path):
    model = _model("gqa", "moe", "plain", 0)
    files = export_weights(model, str(tmp_path), max_shard_bytes=20_000)
    assert "model.safetensors.index.json" in files and len(files) > 3
    target = _model("gqa", "moe", "plain", 1)
    import_weights(str(tmp_path), target)
    for a, b in zip(model.state_dict().values(), target.state_dict().values()):
        assert torch.equal(a, b)
