"""A folder transformers itself saved (``LlamaForCausalLM.save_pretrained`` of a small random config) maps
onto the matching sandbox composition: load_run gives its logits, and ``train.py init_from=FOLDER``
composes the same model and starts from its weights. A Llama the sandbox does not compute the same way
(scaled RoPE) is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from components.hf.weights_folder import import_weights
from components.model import Decoder
from runtime.checkpoints.branching import with_folder_composition
from runtime.compose import compose_root
from runtime.load_run import RunLoadError, load_run
from tests.helpers import FAST, only_run_dir, train_command_in_process
from tests.hf.transformers_helpers import assert_close, ids

transformers = pytest.importorskip("transformers")

SHAPES = {"gqa": (4, 2, False), "mqa": (4, 1, True), "mha": (2, 2, False)}  # heads, kv heads, tied


def _saved_llama(folder, heads: int, kv: int, tied: bool, **extra):
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=5000.0,
        tie_word_embeddings=tied,
        **extra,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(folder))
    return model


@pytest.mark.parametrize("mixer", sorted(SHAPES))
def test_load_run_reads_a_folder_transformers_saved(tmp_path, mixer):
    llama = _saved_llama(tmp_path, *SHAPES[mixer])
    root, model = load_run(str(tmp_path))
    assert root.mixer.name == mixer and root.residual.name == "plain" and root.ffn.activation == "swiglu"
    x = ids(vocab=300)
    with torch.no_grad():
        assert_close(model(x), llama(x).logits)


def test_init_from_composes_the_folders_model(tmp_path, capsys):
    llama = _saved_llama(tmp_path / "llama", *SHAPES["gqa"])
    overrides, note = with_folder_composition(
        [f"init_from={tmp_path / 'llama'}", "data=corpus", "mixer.rope_theta=5000"]
    )
    assert "LlamaForCausalLM, composed as" in note and "mixer=gqa" in note
    assert overrides[-1] == "mixer.rope_theta=5000" and "mixer.rope_theta=5000.0" not in overrides  # given wins
    root = compose_root(overrides)  # checks the folder's tensors against the composed model
    model = Decoder(root.decoder_config()).eval()
    import_weights(str(tmp_path / "llama"), model)
    x = ids(vocab=300)
    with torch.no_grad():
        assert_close(model(x), llama(x).logits)

    # the command line (in this process): a new run from those weights (a learning rate of 1e-30 leaves them
    # as loaded)
    status = train_command_in_process(
        *FAST,
        "data=corpus",  # its 257 byte ids fit the folder's 300-entry vocabulary
        f"init_from={tmp_path / 'llama'}",
        "trainer.max_steps=1",
        "trainer.val_check_interval=100",
        "optimizer.lr=1e-30",
        f"output_root={tmp_path / 'runs'}",
        "logger=csv",
    )
    printed = capsys.readouterr()
    assert status == 0, printed.err[-3000:]
    assert "LlamaForCausalLM, composed as" in printed.err and "initial weights from" in printed.out
    _, started = load_run(str(only_run_dir(tmp_path / "runs")))
    with torch.no_grad():
        assert_close(started(x), llama(x).logits)


def test_a_llama_the_sandbox_does_not_compute_alike_is_refused_by_name(tmp_path):
    _saved_llama(tmp_path, 4, 2, False, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"
    with pytest.raises(RunLoadError, match=r"rope_type=linear"):
        load_run(str(tmp_path))
