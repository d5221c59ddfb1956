"""An exported folder's config.json names the exact composed model again, including the parts JSON
cannot keep as they are: the layer plans' integer keys (K3's ``mixer_plan.at: {-1: mla}``)."""

from __future__ import annotations

import json

import pytest
import torch

from components.hf.config_json import SANDBOX_KEY, checkpoint_config, write_config
from components.hf.key_map import PREFIXES
from components.hf.weights_folder import export_weights
from components.model import Decoder
from runtime.config import to_container
from runtime.load_run import config_from_container, load_run
from tests.helpers import compose_root

K3_PLANS = [
    ("experiment=k3_tiny",),
    ("experiment=k3_tiny", "model.n_layers=6", "model.mixer_plan.repeat=[mixer,mla,mixer]", "model.mtp_depth=1"),
]


@pytest.mark.parametrize("overrides", K3_PLANS, ids=["k3_tiny", "k3_tiny-plan-overrides"])
def test_a_k3_export_loads_back_as_the_same_model(tmp_path, overrides):
    root = compose_root(*overrides)
    assert any(isinstance(k, int) for k in root.model.mixer_plan.at)
    torch.manual_seed(0)
    model = Decoder(root.decoder_config()).eval()
    export_weights(model, str(tmp_path), PREFIXES["text"], 1 << 30, None, False)
    write_config(checkpoint_config(root, model, to_container(root)), str(tmp_path))
    written = json.loads((tmp_path / "config.json").read_text())[SANDBOX_KEY]["model"]["mixer_plan"]["at"]
    assert all(isinstance(k, str) for k in written)  # what JSON keeps: the case this guards

    loaded_root, loaded = load_run(str(tmp_path))
    assert loaded_root.model.mixer_plan.at == root.model.mixer_plan.at
    assert loaded_root.model.ffn_plan.at == root.model.ffn_plan.at
    assert loaded_root.decoder_config() == root.decoder_config()
    ids = torch.randint(0, model.embed.weight.shape[0], (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_a_plan_key_that_is_not_a_layer_index_is_refused_naming_it():
    data = json.loads(json.dumps(to_container(compose_root("experiment=k3_tiny"))))
    data["model"]["mixer_plan"]["at"] = {"last": "mla"}
    with pytest.raises(Exception, match="last"):
        config_from_container(data)
