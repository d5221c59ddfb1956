"""Multi-token prediction: the loss is the cross-entropy of the shifted targets computed by hand, its
gradients reach the shared embedding and head, and generation and cached decoding never run it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from components.model import Decoder
from components.sampling import generate
from tests.helpers import compose_root, tiny_model


def _by_hand(model: Decoder, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Depth k at position i: the block's input is [norm(h_i); norm(E x_{i+k})], its target x_{i+k+1};
    written position by position from the definition."""
    B, T = x.shape
    h = model.hidden_states(x)
    out = []
    for k, depth in enumerate(model.mtp, start=1):
        rows = [
            torch.cat([depth.hidden_norm(h[:, i]), depth.embed_norm(model.embed.weight[x[:, i + k]])], dim=-1)
            for i in range(T - k)
        ]
        z = depth.proj(torch.stack(rows, dim=1))  # [B, T-k, d]
        z = z + depth.mixer(depth.mixer_norm(z))
        z = z + depth.ffn(depth.ffn_norm(z))
        logp = torch.log_softmax(model.lm_head(model.norm(z)), dim=-1)  # [B, T-k, V]
        total = 0.0
        for b in range(B):
            for i in range(T - k):
                target = int(x[b, i + k + 1]) if i + k + 1 < T else int(y[b, T - 1])
                assert target == int(y[b, i + k])
                total -= float(logp[b, i, target])
        out.append(total)
        h = z
    return out


@pytest.mark.parametrize(
    "overrides", [["mixer=mha", "ffn=dense"], ["experiment=k3_tiny"]], ids=["mha-dense", "k3_tiny"]
)
def test_mtp_loss_is_the_shifted_cross_entropy(overrides):
    model = tiny_model(*overrides, "model.mtp_depth=2")
    assert len(model.mtp) == 2
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.vocab_size, (2, 13), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        got = model.mtp_losses(model.hidden_states(x), x, y)
        want = _by_hand(model, x, y)
    assert [int(n) for _, n in got] == [2 * 11, 2 * 10]
    for (loss_sum, _), ref in zip(got, want):
        assert float(loss_sum) == pytest.approx(ref, rel=1e-6)  # cross-entropy runs in fp32, as the main loss


def test_mtp_gradients_reach_the_shared_embedding_and_head():
    model = tiny_model("mixer=gqa", "model.mtp_depth=1").train()
    ids = torch.randint(0, model.vocab_size, (2, 17))
    x, y = ids[:, :-1], ids[:, 1:]
    ((loss_sum, _),) = model.mtp_losses(model.hidden_states(x), x, y)
    loss_sum.backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    ahead = x[:, 1:].unique()
    assert model.embed.weight.grad[ahead].abs().sum(-1).gt(0).all()  # the embedding of every token read ahead
    assert all(p.grad is not None for p in model.mtp.parameters())


def test_generation_and_cached_decoding_ignore_the_mtp_layer():
    with_mtp = tiny_model("mixer=kda", "model.mtp_depth=1")
    plain = tiny_model("mixer=kda")
    missing, unexpected = plain.load_state_dict(with_mtp.state_dict(), strict=False)
    assert not missing and unexpected and all(k.startswith("mtp.") for k in unexpected)
    prompt = torch.randint(0, plain.vocab_size, (1, 9))
    with torch.no_grad():
        assert torch.equal(with_mtp(prompt), plain(prompt))
    a = generate(with_mtp, prompt, max_new_tokens=6, temperature=0.0)
    b = generate(plain, prompt, max_new_tokens=6, temperature=0.0)
    assert torch.equal(a, b)


def test_k3_full_counts_mtp_apart():
    from analysis.model_report import report

    r = report(["experiment=k3_full", "model.mtp_depth=1"])
    assert r["total_params"] == 2_779_484_476_000  # the released checkpoint's count, MTP excluded
    assert r["mtp_params"] > 0 and r["mtp_active_params"] < r["mtp_params"]
    plain = report(["experiment=k3_full"])
    assert plain["mtp_params"] == 0 and plain["active_params"] == r["active_params"]


def test_mtp_options_are_checked():
    from components.registry import ConfigError

    with pytest.raises(ConfigError, match="model.mtp_depth"):
        compose_root("model.mtp_depth=-1")
    with pytest.raises(ConfigError, match="model.mtp_weight"):
        compose_root("model.mtp_weight=-0.5")


def test_training_logs_the_mtp_loss_per_depth(train_run):
    result = train_run(
        "model=tiny",
        "data=corpus",
        "model.mtp_depth=2",
        "data.seq_len=32",
        "data.batch_size=4",
        "data.val_tokens=256",
        "trainer.max_steps=3",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "trainer.compile=false",
        "trainer.max_time_minutes=null",
        "logger=csv",
    )
    run_dir = result.run_dir
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "train/mtp_loss" in r]
    assert len(logged) == 3 and all({"train/mtp_loss_1", "train/mtp_loss_2"} <= set(r) for r in logged)
    assert all(
        r["train/mtp_loss"] == pytest.approx((r["train/mtp_loss_1"] + r["train/mtp_loss_2"]) / 2, rel=1e-5)
        for r in logged
    )
    assert all(F.relu(torch.tensor(r["train/mtp_loss_1"])) > 0 for r in logged)


def test_layer_compilation_covers_the_mtp_depths_with_the_same_losses():
    from runtime.compile import compiled_hidden

    torch._dynamo.reset()
    eager = tiny_model("experiment=k3_tiny", "model.mtp_depth=1").float()
    compiled = tiny_model("experiment=k3_tiny", "model.mtp_depth=1").float()
    hidden = compiled_hidden(compiled, "layers", backend="aot_eager")
    ids = torch.randint(0, eager.vocab_size, (2, 33), generator=torch.Generator().manual_seed(3))
    x, y = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        ((want, _),) = eager.mtp_losses(eager.hidden_states(x), x, y)
        ((got, _),) = compiled.mtp_losses(hidden(x), x, y)
    assert compiled.mtp[0]._compiled_call_impl is not None  # the depth runs compiled
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
