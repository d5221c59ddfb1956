"""Exports a transformers class computes exactly are that class: Llama for MHA/GQA/MQA + RoPE + dense
SwiGLU + plain residual, Kimi Linear for its subset of K3. transformers' own classes load them with no
missing or unexpected tensor and match the sandbox's logits (fp32, relative 1e-5) and greedy
continuations. Anything such a class cannot express is labelled as the project's class, and the reason
names the feature that decided (a SiTU-GLU GQA model is not Llama)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from components.hf import native
from components.hf.key_map import MULTIMODAL_PREFIX, TEXT_PREFIX
from components.hf.safetensors_files import read_header
from components.model import build_on_meta
from runtime.load_run import load_run
from tests.helpers import compose_root
from tests.hf.transformers_helpers import assert_close, assert_same_greedy, ids, tiny, write

transformers = pytest.importorskip("transformers")

LLAMA = {
    "mha": ["model=tiny", "mixer=mha", "mixer.n_heads=4", "ffn.activation=swiglu", "mixer.rope_theta=5000.0"],
    "gqa": ["model=tiny", "mixer=gqa", "mixer.n_heads=4", "mixer.n_kv_heads=2", "ffn.activation=swiglu",
            "model.tie_embeddings=false", "mixer.head_dim=24"],
    "mqa": ["model=tiny", "mixer=mqa", "mixer.n_heads=4", "ffn.activation=swiglu", "model.norm_eps=1e-6"],
}  # fmt: skip
KIMI = [
    "model=tiny",
    "model.n_layers=3",
    "model.tie_embeddings=false",
    "mixer=kda",
    "mixer.gate_lower_bound=null",
    "mixer.full_rank_gate=false",
    "mixer.n_heads=2",
    "mixer.head_dim=16",
    "+mixer@mixers.mla=mla",
    "mixers.mla.output_gate=false",
    "mixers.mla.n_heads=2",
    "+model.mixer_plan.at={-1:mla}",
    "ffn=moe",
    "ffn.activation=swiglu",
    "ffn.num_experts=4",
    "ffn.top_k=2",
    "ffn.expert_hidden_dim=16",
    "+ffn@ffns.dense=dense",
    "ffns.dense.activation=swiglu",
    "ffns.dense.hidden_dim=64",
    "+model.ffn_plan.at={0:dense}",
]


def changed(base: list[str], *changes: str) -> list[str]:
    """``base`` with each ``key=value`` of ``changes`` replacing the entry for that key (or added)."""
    out = list(base)
    for change in changes:
        key = change.split("=", 1)[0]
        hits = [i for i, o in enumerate(out) if o.split("=", 1)[0] == key]
        if hits:
            out[hits[0]] = change
        else:
            out.append(change)
    return out


def _load(folder, cls):
    model, info = cls.from_pretrained(str(folder), output_loading_info=True)
    assert type(model) is cls
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.float().eval()


@pytest.mark.parametrize("kind", sorted(LLAMA))
def test_llama_expressible_models_are_llama(tmp_path, kind):
    root, model = tiny(*LLAMA[kind], scale=0.2)
    written = write(tmp_path, root, model)
    assert written.layout == native.Layout(native.LLAMA)
    cfg = json.loads((tmp_path / "config.json").read_text())
    attn = model.layers[0].mixer
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
        attn.n_heads,
        attn.n_kv_heads,
        attn.head_dim,
    )
    assert cfg["rope_theta"] == attn.cfg.rope_theta and cfg["rms_norm_eps"] == root.model.norm_eps
    assert cfg["tie_word_embeddings"] == root.model.tie_embeddings and cfg["vocab_size"] == 257
    assert (cfg["eos_token_id"], cfg["bos_token_id"], cfg["pad_token_id"]) == (256, 256, 256)
    assert "auto_map" not in cfg  # transformers' own class, no project code needed

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert type(hf) is transformers.LlamaForCausalLM
    hf = _load(tmp_path, transformers.LlamaForCausalLM)
    x = ids()
    with torch.no_grad():
        assert_close(model(x), hf(x).logits)
    continuation = assert_same_greedy(model, hf, x[:1, :8], 24, 256)
    assert len(set(continuation)) > 3  # not a degenerate repetition


@pytest.mark.parametrize("variant", ["q-lora, top-2", "no q-lora, top-1"])
def test_kimi_linear_expressible_models_are_kimi_linear(tmp_path, variant):
    overrides = KIMI if variant == "q-lora, top-2" else changed(KIMI, "mixers.mla.q_lora_rank=null", "ffn.top_k=1")
    root, model = tiny(*overrides, scale=0.1)
    written = write(tmp_path, root, model)
    assert written.layout == native.Layout(native.KIMI_LINEAR)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["KimiLinearForCausalLM"] and cfg["model_type"] == "kimi_linear"
    assert cfg["layer_types"] == ["linear_attention", "linear_attention", "full_attention"]
    assert cfg["mlp_layer_types"] == ["dense", "sparse", "sparse"]
    assert cfg["pad_token_id"] == 256  # inside the vocabulary (the class's default 163839 is not)
    header = read_header(str(tmp_path / "model.safetensors"))
    assert header["model.layers.0.self_attn.A_log"][1] == (1, 1, 2, 1)  # the class's shape

    hf = _load(tmp_path, transformers.KimiLinearForCausalLM)
    x = ids(length=70)  # past one 64-token KDA chunk
    with torch.no_grad():
        assert_close(model(x), hf(x).logits)
    continuation = assert_same_greedy(model, hf, x[:1, :8], 16, 256)
    assert len(set(continuation)) > 3
    _, back = load_run(str(tmp_path))  # and the project reads its native-class export back exactly
    with torch.no_grad():
        assert torch.equal(back(x), model(x))


REFUSED = [
    (["model=tiny"], TEXT_PREFIX, native.SANDBOX, r"not LlamaForCausalLM: ffn\.activation=situ_glu \(SiTU-GLU"),
    (changed(LLAMA["gqa"], "residual=block_attnres"), TEXT_PREFIX, native.SANDBOX, r"residual=block_attnres"),
    (changed(LLAMA["gqa"], "mixer.rope=false"), TEXT_PREFIX, native.SANDBOX, r"NoPE"),
    (changed(LLAMA["gqa"], "model.mtp_depth=1"), TEXT_PREFIX, native.SANDBOX, r"model\.mtp_depth=1"),
    (changed(LLAMA["gqa"], "ffn=moe"), TEXT_PREFIX, native.SANDBOX, r"not LlamaForCausalLM: layer 0 has ffn moe"),
    (LLAMA["gqa"], MULTIMODAL_PREFIX, native.SANDBOX, r"multimodal prefix"),
    (changed(KIMI, "mixer.gate_lower_bound=-5.0"), TEXT_PREFIX, native.SANDBOX, r"lower-bound KDA gate"),
    (changed(KIMI, "mixer.full_rank_gate=true"), TEXT_PREFIX, native.SANDBOX, r"full-rank KDA output gate"),
    (changed(KIMI, "mixers.mla.output_gate=true"), TEXT_PREFIX, native.SANDBOX, r"output_gate=true \(K3's gated MLA"),
    (changed(KIMI, "mixers.mla.rope=true"), TEXT_PREFIX, native.SANDBOX, r"MLA with rope=true"),
    (changed(KIMI, "ffn.activation=situ_glu"), TEXT_PREFIX, native.SANDBOX, r"SiTU-GLU"),
    (changed(KIMI, "ffn=latent_moe"), TEXT_PREFIX, native.SANDBOX, r"ffn latent_moe \(LatentMoE\)"),
    (changed(KIMI, "model.tie_embeddings=true"), TEXT_PREFIX, native.SANDBOX, r"tie_embeddings=true"),
    (changed(KIMI, "ffn.num_shared_experts=0"), TEXT_PREFIX, native.SANDBOX, r"num_shared_experts=0"),
    (changed(KIMI, "ffn.router_activation=softmax"), TEXT_PREFIX, native.SANDBOX, r"routes by sigmoid"),
    (changed(KIMI, "residual=full_attnres"), TEXT_PREFIX, native.SANDBOX, r"residual=full_attnres"),
    (KIMI, MULTIMODAL_PREFIX, native.KIMI_K3, r"multimodal prefix"),
    (["experiment=k3_tiny"], TEXT_PREFIX, native.SANDBOX, r"not KimiLinearForCausalLM: residual=block_attnres"),
    (["experiment=k3_tiny"], MULTIMODAL_PREFIX, native.KIMI_K3, r"residual=block_attnres"),
    (
        ["model=tiny", "+mixer@mixers.linear=kda", "+model.mixer_plan.at={-1:linear}"],
        TEXT_PREFIX,
        native.SANDBOX,
        r"no transformers class mixes gqa and kda layers",
    ),
]


@pytest.mark.parametrize("overrides,prefix,architecture,reason", REFUSED, ids=[r[3] for r in REFUSED])
def test_a_class_that_cannot_express_the_model_is_not_claimed(overrides, prefix, architecture, reason):
    model = build_on_meta(compose_root("data=corpus", *overrides).decoder_config())
    layout = native.choose(model, prefix)
    assert layout.architecture == architecture
    assert layout.reason is not None and re.search(reason, layout.reason), layout.reason


def test_mxfp4_experts_keep_a_kimi_linear_model_on_the_projects_class():
    root, model = tiny(*KIMI)
    layout = native.choose(model, TEXT_PREFIX, mxfp4_experts=True)
    assert layout.architecture == native.SANDBOX and "--mxfp4-experts" in layout.reason
