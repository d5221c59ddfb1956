"""One-process tools (generation, export) refuse a model split over ranks, naming a split parameter, instead of
waiting forever in its first collective; the same run read back by ``load_run`` is whole and works with them
(tests/distributed/test_expert_parallel_training.py exports expert-parallel runs that way)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.gloo_ranks import run_ranks


def _tools_on_a_split_model(rank: int, world: int, ep: int, folder: str) -> dict[str, str]:
    """k3_tiny sharded by FSDP2 (experts over ``ep`` ranks); every rank calls each tool, so a tool that did not
    refuse would run collectively and return, and the test would see no error (rather than hang)."""
    from torch.distributed.device_mesh import init_device_mesh

    from components.distributed import ShardedModelError
    from components.hf.weights_folder import export_weights
    from components.model import Decoder
    from components.sampling import generate
    from runtime.strategies import shard_fsdp2
    from tests.helpers import compose_root

    torch.manual_seed(0)
    model = Decoder(compose_root("experiment=k3_tiny").decoder_config())
    shard_fsdp2(model, init_device_mesh("cpu", (world,)), None, ep)
    errors = {}
    tools = {
        "generate": lambda: generate(model, torch.zeros(1, 4, dtype=torch.long), 2),
        "export": lambda: export_weights(model, f"{folder}/export_{rank}"),
    }
    for name, call in tools.items():
        try:
            call()
            errors[name] = "no error"
        except ShardedModelError as err:
            errors[name] = str(err)
    return errors


@pytest.mark.parametrize("ep", [pytest.param(1, id="fsdp2", marks=pytest.mark.slow), pytest.param(2, id="fsdp2-ep2")])
def test_generate_and_export_refuse_a_model_split_over_ranks(tmp_path, ep):
    per_rank = run_ranks(_tools_on_a_split_model, 2, tmp_path, ep, str(tmp_path))
    for errors in per_rank:
        for tool, message in errors.items():
            assert message.startswith(f"{tool} runs on one process, but parameter '"), message
            assert "split over 2 ranks" in message and "load_run" in message, message
    assert not list(tmp_path.glob("export_*/*.safetensors"))  # refused before anything was written


def test_a_whole_model_is_not_refused():
    from components.distributed import require_whole_model
    from components.model import Decoder
    from tests.helpers import compose_root

    require_whole_model(Decoder(compose_root("experiment=k3_tiny").decoder_config()), "generate")
