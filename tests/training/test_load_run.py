"""load_run: a run folder, a checkpoint file alone or an exported folder gives back the run's config and
trained model; an exported folder generates like its run and starts a new run (init_from)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from components.registry import DATASETS, ConfigError
from runtime.config import to_container
from runtime.load_run import RunLoadError, config_from_container, load_run
from tests.helpers import FAST, compose_root, only_run_dir

TRAINED = [
    *FAST,
    "mixer=kda",
    "model.mtp_depth=1",
    "trainer.max_steps=4",
    "trainer.val_check_interval=100",
    "trainer.checkpoint_every_n_steps=2",
    "logger=csv",
]


@pytest.fixture(scope="module")
def trained(trained_run):
    return trained_run(*TRAINED).run_dir


def test_a_checkpoint_alone_gives_the_config_and_the_trained_model(trained, tmp_path):
    alone = tmp_path / "model.ckpt"
    shutil.copy(trained / "checkpoints" / "last.ckpt", alone)  # outside its run folder
    root, model = load_run(str(alone), dtype=torch.float64)
    assert root.mixer.name == "kda" and root.model.mtp_depth == 1 and root.trainer.max_steps == 4
    assert not model.training and next(model.parameters()).dtype == torch.float64
    # the loaded weights give the validation loss the run itself reported at its end
    data = DATASETS.build(root.data, root.seed)
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for x, y in data.val_batches():
            logits = model(x)
            loss_sum += float(F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum"))
            tokens += y.numel()
    final = json.loads((trained / "summary.json").read_text())["val"]["loss"]
    assert loss_sum / tokens == pytest.approx(final, rel=1e-5)
    again, _ = load_run(str(trained))  # the run folder resolves to its newest checkpoint
    assert to_container(again) == to_container(root)


def test_a_run_folder_falls_back_past_an_unreadable_last_checkpoint(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    last = copy / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:1000])
    root, model = load_run(str(copy))
    _, reference = load_run(str(trained / "checkpoints" / "step=4.ckpt"))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))


def test_what_cannot_be_loaded_is_named(tmp_path):
    with pytest.raises(RunLoadError, match="no such run folder or checkpoint file"):
        load_run(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunLoadError, match="no checkpoint in"):
        load_run(str(tmp_path / "empty"))
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(RunLoadError, match="unreadable"):
        load_run(str(bad))


def test_generate_command_streams_a_continuation(trained, capsys):
    from analysis.generate import main

    assert (
        main(
            [
                str(trained),
                "--prompt",
                "def main():",
                "--max-new-tokens",
                "12",
                "--temperature",
                "0.8",
                "--top-p",
                "0.9",
                "--seed",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("def main():") and "new tokens at" in out and "tokens/s" in out and "(kda," in out
    # the same seed gives the same text; greedy decoding equals the library's greedy generate
    assert (
        main(
            [
                str(trained),
                "--prompt",
                "def main():",
                "--max-new-tokens",
                "12",
                "--temperature",
                "0.8",
                "--top-p",
                "0.9",
                "--seed",
                "1",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.split("\n\n[")[0] == out.split("\n\n[")[0]


def test_generate_refuses_what_it_cannot_load(tmp_path, capsys):
    from analysis.generate import main

    assert main([str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "analysis.generate: error:" in capsys.readouterr().err


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    from analysis.export import main

    out = tmp_path_factory.mktemp("exported") / "model"
    assert main([str(trained), str(out)]) == 0
    return out


def test_an_exported_folder_loads_and_generates_like_its_run(trained, exported, capsys):
    from analysis.generate import main

    assert (exported / "tokenizer.json").is_file()  # the run's BPE travels with the weights
    root, model = load_run(str(exported))
    run_root, run_model = load_run(str(trained))
    assert to_container(root) == to_container(run_root)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), run_model.state_dict().values()))
    texts = []
    for source in (trained, exported):
        assert main([str(source), "--prompt", "import os\n", "--max-new-tokens", "16", "--seed", "3"]) == 0
        texts.append(capsys.readouterr().out.split("\n\n[")[0])
    assert texts[0] == texts[1] and len(texts[0]) > len("import os\n")


def test_a_run_starts_from_exported_weights(trained, exported, tmp_path, train_run):
    # a learning rate of 1e-30 leaves every non-zero weight bit-identical: what the run holds after its
    # step is what it loaded
    result = train_run(
        *FAST,
        "mixer=kda",
        "model.mtp_depth=1",
        "trainer.max_steps=1",
        "trainer.val_check_interval=100",
        f"init_from={exported}",
        "optimizer.lr=1e-30",
        "logger=csv",
    )
    assert f"initial weights from {exported}" in result.stdout
    _, started = load_run(str(only_run_dir(tmp_path)))
    _, source = load_run(str(exported))
    for (key, a), b in zip(started.state_dict().items(), source.state_dict().values()):
        assert torch.allclose(a, b, rtol=0, atol=1e-20), key
    assert (
        json.loads((only_run_dir(tmp_path) / "summary.json").read_text())["steps"] == 1
    )  # a new run: step 0, not the source's step


def test_exported_weights_that_do_not_fit_the_composed_model_are_refused_before_training(exported):
    with pytest.raises(ConfigError, match=r"init_from: .*model\.embed_tokens\.weight.*shape"):
        compose_root("model=tiny", "mixer=kda", "model.mtp_depth=1", "model.d_model=96", f"init_from={exported}")
    with pytest.raises(ConfigError, match="init_step: init_from=.* is a folder of exported weights"):
        compose_root("model=tiny", "mixer=kda", "model.mtp_depth=1", f"init_from={exported}", "init_step=2")


def test_top_p_keeps_the_smallest_nucleus():
    from components.sampling import generate

    class Fixed(torch.nn.Module):  # a "model" whose next-token distribution is fixed: p = [0.5, 0.3, 0.15, 0.05]
        def new_cache(self):
            return None

        def forward(self, ids, cache=None):
            logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
            return logits.expand(ids.shape[0], ids.shape[1], 4)

    g = torch.Generator().manual_seed(0)
    out = generate(Fixed(), torch.zeros(1, 1, dtype=torch.long), 400, temperature=1.0, top_p=0.75, generator=g)[0, 1:]
    assert set(out.tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.75; tokens 2 and 3 are never drawn
    assert 0.55 < (out == 0).float().mean() < 0.70  # renormalised: 0.5 / 0.8 = 0.625


def test_a_run_config_saved_with_the_schedule_in_the_optimizer_still_loads():
    """Runs saved before the schedule became its own group kept it in the optimizer node."""
    root = compose_root("schedule=wsd", "schedule.decay_fraction=0.5")
    saved = to_container(root)
    old = {k: v for k, v in saved.items() if k != "schedule"}
    old["optimizer"] = {**saved["optimizer"], "schedule": "wsd", "min_lr_ratio": 0.1, "decay_fraction": 0.5}
    old["optimizer"]["decay_shape"] = "linear"
    assert config_from_container(old) == config_from_container(saved) == root
    cosine = {**old, "optimizer": {**old["optimizer"], "schedule": "cosine"}}
    assert config_from_container(cosine).schedule == compose_root().schedule
