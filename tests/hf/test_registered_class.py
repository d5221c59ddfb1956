"""Every export loads through ``AutoModelForCausalLM``: the models no transformers class computes go
through the project's registered class, the project's own decoder behind transformers' interface. All
mixer x FFN x residual combinations of the registries match the sandbox's logits exactly; a K3 export
with every decision on matches, cached ``generate()`` included; with the release's multimodal prefix it
reads as the release (``model_type: kimi_k3``, the text backbone under ``text_config``); and the folder's
``auto_map`` reaches the same classes with ``trust_remote_code=True`` in a process that never imported
the project."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

from components.hf import native
from components.hf.key_map import MULTIMODAL_PREFIX
from components.hf.safetensors_files import read_header
from components.registry import FFNS, MIXERS, RESIDUALS
from components.sampling import generate
from tests.helpers import REPO
from tests.hf.transformers_helpers import assert_close, ids, tiny, write

transformers = pytest.importorskip("transformers")

from components.hf.transformers_model import (  # noqa: E402
    K3SandboxForCausalLM,
    KimiK3SandboxConfig,
    KimiK3SandboxForConditionalGeneration,
    SandboxCache,
    transformers_has_kimi_k3,
)

COMBINATIONS = list(itertools.product(MIXERS.names(), FFNS.names(), RESIDUALS.names()))
# small settings for whichever member has the field (components not listed keep their defaults)
SMALL = {"n_heads": 2, "head_dim": 16, "num_experts": 4, "top_k": 2, "expert_hidden_dim": 16}


def _small(group: str, registry, name: str) -> list[str]:
    fields = {f.name for f in dataclasses.fields(registry.get(name).config_cls)}
    return [f"{group}.{k}={v}" for k, v in SMALL.items() if k in fields]


def test_the_combinations_come_from_the_registries():
    assert len(COMBINATIONS) == len(MIXERS.names()) * len(FFNS.names()) * len(RESIDUALS.names()) >= 60


@pytest.mark.parametrize("mixer,ffn,residual", COMBINATIONS)
def test_every_combination_loads_through_auto_model_and_matches(tmp_path, mixer, ffn, residual):
    root, model = tiny(
        "model=tiny",
        f"mixer={mixer}",
        f"ffn={ffn}",
        f"residual={residual}",
        *_small("mixer", MIXERS, mixer),
        *_small("ffn", FFNS, ffn),
    )
    written = write(tmp_path, root, model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    expected = K3SandboxForCausalLM if written.layout.architecture == native.SANDBOX else None
    assert expected is None or type(hf) is expected, written.layout
    x = ids(length=12)
    with torch.no_grad():
        assert torch.equal(hf(x).logits, model(x)) if expected else assert_close(model(x), hf(x).logits)


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    """experiment=k3_tiny: every K3 decision on (KDA with the lower-bound gate and full-rank output gate,
    gated NoPE MLA, dense first layer, Stable LatentMoE, SiTU-GLU, block AttnRes, one MTP depth)."""
    return tiny("experiment=k3_tiny")


def test_a_k3_export_loads_through_the_registered_class_and_generates_with_its_cache(tmp_path, k3):
    root, model = k3
    written = write(tmp_path, root, model)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["K3SandboxForCausalLM"] and cfg["model_type"] == "k3_sandbox"  # never Kimi-Linear's
    assert "not KimiLinearForCausalLM: residual=block_attnres" in written.summary()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert type(hf) is K3SandboxForCausalLM
    x = ids(length=70)
    with torch.no_grad():
        assert torch.equal(hf(x).logits, model(x))
        out = hf(x[:, :10], use_cache=True)
        assert isinstance(out.cache, SandboxCache) and out.cache.get_seq_length() == 10
        step = hf(x[:, 10:11], cache=out.cache, use_cache=True).logits  # one token after a cached prefix
        assert_close(model(x[:, :11])[:, -1:], step)
    prompt = x[:1, :12]
    ours = generate(model, prompt, 24)[0, 12:].tolist()
    ours = ours[: ours.index(256) + 1] if 256 in ours else ours
    cached = hf.generate(prompt, max_new_tokens=24, do_sample=False)[0, 12:].tolist()
    uncached = hf.generate(prompt, max_new_tokens=24, do_sample=False, use_cache=False)[0, 12:].tolist()
    assert cached == ours == uncached and len(set(ours)) > 3


def test_labels_give_the_projects_own_next_token_loss(tmp_path):
    from components.objective import IGNORE_INDEX, cross_entropy

    root, model = tiny("mixer=gqa", "ffn=dense")
    write(tmp_path, root, model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    x = ids(length=16)
    labels = x.clone()
    labels[0, 5:9] = IGNORE_INDEX  # ignored positions are left out of the mean, as transformers does
    with torch.no_grad():
        loss = hf(x, labels=labels).loss
        logits = model(x)
    per_token = cross_entropy(logits[:, :-1], labels[:, 1:])
    expected = per_token.sum() / (labels[:, 1:] != IGNORE_INDEX).sum()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)


def test_a_multimodal_k3_export_reads_as_the_release(tmp_path, k3):
    root, model = k3
    written = write(tmp_path, root, model, prefix=MULTIMODAL_PREFIX)
    assert written.layout.architecture == native.KIMI_K3
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK3ForConditionalGeneration"] and cfg["model_type"] == "kimi_k3"
    text = cfg["text_config"]
    assert text["model_type"] == "kimi_linear" and text["hidden_size"] == 64 and text["num_hidden_layers"] == 4
    assert text["linear_attn_config"]["kda_layers"] == [1, 2, 3] and text["attn_res_block_size"] == 2
    assert text["num_nextn_predict_layers"] == 1 and text["hidden_act"] == "situ"
    assert "hidden_size" not in cfg  # the text fields live under text_config only, as in the release
    assert all(k.startswith("language_model.") for k in read_header(str(tmp_path / "model.safetensors")))

    config = transformers.AutoConfig.from_pretrained(str(tmp_path))
    assert config.model_type == "kimi_k3" and config.text_config.hidden_size == 64
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert isinstance(hf, KimiK3SandboxForConditionalGeneration) or transformers_has_kimi_k3()
    x = ids(length=20)
    with torch.no_grad():
        assert_close(model(x), hf(x).logits)


def test_the_export_follows_transformers_own_kimi_k3_the_day_it_has_one(tmp_path, k3):
    """While transformers has no kimi_k3, the project's class is what the model type resolves to. The
    day a release has its own, that class must compute the project's K3 export (and is then used: the
    project no longer registers kimi_k3); if it does not, this fails, naming the version."""
    if not transformers_has_kimi_k3():
        assert transformers.AutoConfig.for_model("kimi_k3").__class__ is KimiK3SandboxConfig
        return
    root, model = k3
    write(tmp_path, root, model, prefix=MULTIMODAL_PREFIX)
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).float().eval()
        x = ids(length=20)
        with torch.no_grad():
            assert_close(model(x), hf(x).logits)
    except Exception as err:
        pytest.fail(
            f"transformers {transformers.__version__} has its own kimi_k3 and it does not compute the project's K3 "
            f"export ({type(err).__name__}: {err}); align components/hf/export_folder.py with its schema"
        )


def test_trust_remote_code_reaches_the_project_through_auto_map(tmp_path, k3):
    root, model = k3
    folder = tmp_path / "out"
    write(folder, root, model)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_k3_sandbox.K3SandboxForCausalLM"
    x = ids(length=16)
    torch.save(x, tmp_path / "ids.pt")
    script = f"""
import sys, torch
from transformers import AutoModelForCausalLM
assert not any(m == "components" or m.startswith("components.") for m in sys.modules)
try:
    AutoModelForCausalLM.from_pretrained({str(folder)!r})
    raise SystemExit("loaded without trust_remote_code")
except ValueError as err:
    assert "trust_remote_code" in str(err), err
model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
with torch.no_grad():
    torch.save(model(torch.load({str(tmp_path / "ids.pt")!r})).logits, {str(tmp_path / "logits.pt")!r})
print(type(model).__module__, type(model).__name__)
"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "K3SandboxForCausalLM" in proc.stdout
    with torch.no_grad():
        assert torch.equal(torch.load(tmp_path / "logits.pt"), model(x))


def test_save_pretrained_writes_a_folder_that_loads_again_and_padding_is_refused(tmp_path, k3):
    root, model = k3
    write(tmp_path / "a", root, model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "a"))
    hf.save_pretrained(str(tmp_path / "b"))
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "b"))
    x = ids(length=12)
    with torch.no_grad():
        assert torch.equal(again(x).logits, model(x))
        mask = torch.ones_like(x)
        assert torch.equal(hf(x, attention_mask=mask).logits, model(x))
        mask[1, :3] = 0
        with pytest.raises(ValueError, match="padded batches are not supported"):
            hf(x, attention_mask=mask)
