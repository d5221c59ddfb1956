"""Every config group option composes, validates and builds; bad configs fail with one clear message."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from components.model import Decoder
from components.registry import DATASETS, MODEL_FAMILIES, ConfigError
from runtime.config import REGISTRIES
from tests.helpers import CONF, compose_root, group_options, train_command_in_process

# groups whose options change the model; the others are checked by composition + validation only
MODEL_GROUPS = [r.group for r in MODEL_FAMILIES] + ["model"]
OTHER_GROUPS = [g for g in REGISTRIES if g not in MODEL_GROUPS and g != DATASETS.group] + ["trainer", "logger"]


def small(*overrides: str) -> list[str]:
    return ["model=tiny", *overrides]


@pytest.mark.parametrize("group,option", [(g, o) for g in MODEL_GROUPS for o in group_options(g)])
def test_model_group_option_composes_and_builds(group, option):
    root = compose_root(*small(f"{group}={option}"))
    model = Decoder(root.decoder_config())
    ids = torch.randint(0, root.model.vocab_size, (2, 16))
    logits = model(ids)
    assert logits.shape == (2, 16, root.model.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("group,option", [(g, o) for g in OTHER_GROUPS for o in group_options(g)])
def test_other_group_option_composes(group, option):
    if (group, option) in MODEL_SPECIFIC:
        compose_root(*MODEL_SPECIFIC[group, option], f"{group}={option}")
    else:
        compose_root(*small(f"{group}={option}"))


# options made for one model: the K3 preset's expert-parallel mesh splits K3's experts (the default model has none)
MODEL_SPECIFIC = {("trainer", "slurm_k3"): ["experiment=k3_full", "data.batch_size=896"]}


def test_the_k3_preset_refuses_a_model_without_routed_experts():
    with pytest.raises(ConfigError, match="trainer.expert_parallel"):
        compose_root(*small("trainer=slurm_k3"))


@pytest.mark.parametrize("option", group_options("data"))
def test_data_option_composes_and_builds(option, tmp_path):
    extra = []
    if option == "memmap":
        path = tmp_path / "tokens.bin"
        (np.arange(50000) % 5000).astype(np.uint16).tofile(path)
        extra = [f"data.path={path}", "data.vocab_size=5000"]
    if option == "mixture":
        from components.data.text.pipeline import PrepareOptions, prepare
        from tests.data.text_fixtures import write_text_folder

        for name in ("a", "b"):
            prepare(
                PrepareOptions(
                    [str(write_text_folder(tmp_path / f"src_{name}", n_files=12))],
                    str(tmp_path / name),
                    val_fraction=0.3,
                    progress=False,
                ),
                log=lambda m: None,
            )
        extra = [f"data.sources={{a: {{path: {tmp_path / 'a'}}}, b: {{path: {tmp_path / 'b'}, weight: 2}}}}"]
    root = compose_root(*small(f"data={option}", *extra))
    dataset = DATASETS.build(root.data, root.seed)
    x, y = dataset.train_batch(0)
    assert x.shape == y.shape == (root.data.batch_size, root.data.seq_len)
    assert int(x.max()) < root.model.vocab_size


@pytest.mark.parametrize("experiment", group_options("experiment"))
def test_experiment_composes(experiment):
    compose_root(f"experiment={experiment}")


# ---- validation errors, in process: the key named is the full dotted key ----------------------
@pytest.mark.parametrize(
    "overrides,key",
    [
        (["mixer=mhaa"], "mixer"),
        (["mixer.n_heads=five"], "mixer.n_heads"),
        (["+mixer.n_head=4"], "mixer.n_head"),
        (["model.d_model=100", "mixer.n_heads=3"], "mixer.n_heads"),
        (["mixer=gqa", "mixer.n_kv_heads=3"], "mixer.n_kv_heads"),
        (["mixer=mqa", "mixer.n_kv_heads=2"], "mixer.n_kv_heads"),
        (["+foo=1"], "foo"),
        (["+model.n_layer=3"], "model.n_layer"),
        (["optimizer.lr=fast"], "optimizer.lr"),
        (["schedule=cosin"], "schedule"),
        (["ffn.activation=gelu"], "ffn.activation"),
        (["trainer=cpuu"], "trainer"),
        (["data=memmap"], "data.path"),
        (["data=memmap", "data.path=/nonexistent"], "data.path"),
        (["model.mixer_plan.repeat=[mixer,nope]"], "model.mixer_plan.repeat[1]"),
        (["mixer.rope=true", "mixer.head_dim=15"], "mixer.head_dim"),
    ],
)
def test_invalid_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        compose_root(*overrides)
    assert err.value.key == key, str(err.value)


def test_unknown_mixer_suggests_closest():
    with pytest.raises(ConfigError) as err:
        compose_root("mixer=mhaa")
    assert "Did you mean 'mha'" in str(err.value) and "gqa" in str(err.value)


@pytest.mark.parametrize("name,content", [("empty.bin", b""), ("odd.bin", b"\x01\x02\x03")])
def test_memmap_refuses_empty_or_truncated_files(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        compose_root("data=memmap", f"data.path={path}")
    assert err.value.key == "data.path"
    assert ("empty" in str(err.value)) or ("truncated" in str(err.value))


# ---- the command line: one line on stderr, exit status 2, nothing written ---------------------
@pytest.mark.parametrize(
    "overrides,key",
    [
        (["mixer=mhaa"], "mixer"),
        (["mixer.n_heads=five"], "mixer.n_heads"),
        (["+mixer.n_head=4"], "mixer.n_head"),
        (["model.d_model=100", "mixer.n_heads=3"], "mixer.n_heads"),
        (["data=memmap", "data.path=/nonexistent"], "data.path"),
        (["-m", "mixer=gqa,mhaa"], "mixer"),
    ],
)
def test_cli_rejects_bad_config_before_writing(tmp_path, overrides, key, capsys):
    out = tmp_path / "outputs"
    status = train_command_in_process(*overrides, f"output_root={out}")  # train.py's command line
    printed = capsys.readouterr()
    assert status == 2, printed.err
    lines = [line for line in printed.err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, printed.err
    assert lines[0].startswith(f"error: {key}:"), lines[0]
    assert not out.exists(), "a folder was written for a config that failed validation"
    assert "Traceback" not in printed.err + printed.out


def test_conf_tree_has_a_yaml_per_group():
    for group in MODEL_GROUPS + OTHER_GROUPS + ["data"]:
        assert group_options(group), f"conf/{group} is empty"
    assert (CONF / "config.yaml").exists()


def test_optimizers_are_a_registry_with_their_own_fields():
    """Muon-only fields are unknown keys under optimizer=adamw; each optimizer composes its own schema."""
    from components.optim.adamw import AdamWConfig
    from components.optim.muon import MuonConfig

    with pytest.raises(ConfigError) as err:
        compose_root("model=tiny", "optimizer=adamw", "optimizer.ns_steps=5")
    assert "ns_steps" in str(err.value)
    assert isinstance(compose_root("model=tiny", "optimizer=adamw").optimizer, AdamWConfig)
    assert isinstance(compose_root("model=tiny", "optimizer=muon", "optimizer.ns_steps=3").optimizer, MuonConfig)
    with pytest.raises(ConfigError) as err:
        compose_root("model=tiny", "optimizer=sgdd")
    assert err.value.key == "optimizer" and "adamw" in str(err.value)
