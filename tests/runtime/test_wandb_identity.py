"""A run's W&B identity (group, name, job type, layer plan), what W&B's limits do to tags and names, the
metric ledger that keeps each step's record once, and the throughput logged over the logging interval."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from runtime.metric_ledger import MetricLedger, record_key
from runtime.run_identity import (
    NAME_LIMIT,
    TAG_LIMIT,
    compress,
    fit_tags,
    identity_overrides,
    job_type_for,
    readable_label,
    run_identity,
)
from tests.helpers import compose_root

ABLATIONS = [
    ["experiment=k3_small"],
    ["experiment=k3_small_swiglu"],
    ["experiment=k3_small_signsgd"],
    ["experiment=k3_small_rope"],
    ["experiment=k3_small_no_mtp"],
    ["mixer=gqa"],
    ["mixer=gqa", "optimizer.lr=0.001"],
    ["mixer=gqa", "ffn.activation=swiglu"],
]


def test_eight_ablations_get_eight_groups_and_seeds_share_one():
    identities = [run_identity(compose_root(*o), o) for o in ABLATIONS]
    groups = [i.group for i in identities]
    assert len(set(groups)) == 8, groups
    assert len({i.name for i in identities}) == 8
    # the name says what distinguishes the run, with the run folder's config hash
    assert identities[1].name.startswith("k3_small_swiglu ") and identities[6].name.startswith("mixer=gqa lr=0.001 ")
    assert all(i.name.endswith(i.config_hash) for i in identities)
    seeds = [run_identity(compose_root("mixer=gqa", f"seed={s}"), ["mixer=gqa", f"seed={s}"]) for s in (1, 2)]
    assert seeds[0].group == seeds[1].group == identities[5].group  # seed 1337 (the default) too
    assert seeds[0].name != seeds[1].name and seeds[0].config_hash != seeds[1].config_hash
    # where or how a run is observed is not part of its group
    watched = ["mixer=gqa", "output_root=/elsewhere", "trainer.log_every_n_steps=1", "logger=csv"]
    assert run_identity(compose_root(*watched), watched).group == identities[5].group


def test_layer_plan_is_a_config_field_in_readable_form():
    identity = run_identity(compose_root("experiment=k3_small"), ["experiment=k3_small"])
    fields = identity.config_fields()
    assert fields["layer_plan"] == "KKKM x 2" and fields["ffn_plan"] == "D + S x 7"
    assert fields["plan_letters"] == "K=kda M=mla D=dense S=stable_latent_moe"
    assert fields["config_hash"] == identity.config_hash and fields["job_type"] == "train"
    assert compress(list("KKKM" * 23 + "M")) == "KKKM x 23 + M"
    assert compress(list("KKKM")) == "KKKM" and compress(list("G" * 24)) == "G x 24"


def test_sweep_and_ladder_job_types_and_a_shared_group():
    assert job_type_for(None) == "train" and job_type_for({"point": "a"}) == "sweep-point"
    assert job_type_for({"point": "a"}, ladder=True) == "ladder-rung"
    root = compose_root("mixer=gqa")
    shared = run_identity(root, ["mixer=gqa"], job_type="sweep-point", group="sweep-x")
    assert shared.group == "sweep-x" and shared.job_type == "sweep-point"
    with pytest.raises(ValueError, match="job_type"):
        run_identity(root, ["mixer=gqa"], job_type="nonsense")


def test_long_values_are_fitted_to_wandb_limits_with_a_hash():
    long_tag = "model.mixer_plan.repeat=" + "mixer," * 40 + "mla"
    tags, cut = fit_tags(["mixer:kda", long_tag, "", long_tag])
    assert tags[0] == "mixer:kda" and len(tags) == 2 and all(1 <= len(t) <= TAG_LIMIT for t in tags)
    assert cut == {tags[1]: long_tag}
    other, _ = fit_tags([long_tag + "x"])
    assert other[0] != tags[1]  # two long values with one head stay apart
    overrides = identity_overrides(["experiment=k3_tiny", "model.mixer_plan.repeat=[" + "mixer," * 40 + "mla]"])
    label = readable_label(overrides)
    assert label.startswith("k3_tiny repeat=[mixer,") and len(label) < 60
    root = compose_root("model=tiny")
    identity = run_identity(root, ["model=tiny", *[f"+x{i}={'v' * 30}" for i in range(10)]])
    assert len(identity.name) <= NAME_LIMIT and len(identity.group) <= NAME_LIMIT


def test_ledger_keeps_each_steps_record_once():
    earlier = [{"step": 0, "train/loss": 2.0}, {"step": 1, "train/loss": 1.9}, {"step": 1, "val/loss": 1.8}]
    ledger = MetricLedger(earlier)
    assert not ledger.is_new(1, {"train/loss": 1.9})  # a step the resumed run repeats
    assert not ledger.is_new(1, {"val/loss": 1.8, "act/glu_max": 3.0})
    assert ledger.is_new(2, {"train/loss": 1.7})
    assert ledger.is_new(2, {"val/loss": 1.6}) and not ledger.is_new(2, {"val/loss": 1.6})  # final validation again
    assert record_key(3, {"step": 3, "perf/tokens": 1.0}) == (3, "train")


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_tokens_per_s_is_the_logging_intervals_rate(monkeypatch):
    """Steps of 1, 2 and 3 seconds logged every third step: 3 steps' tokens over 6 s, not the last step's
    rate; the tokens and FLOPs axis counts the steps before the row's, from step 0."""
    from runtime.callbacks import throughput

    clock = _Clock()
    monkeypatch.setattr(throughput.time, "perf_counter", clock)
    callback = throughput.Throughput(flops_per_token=10.0, tokens_per_micro_batch=100, peak=1e9)
    logged: list[dict] = []
    trainer = SimpleNamespace(
        global_step=0,
        accumulate_grad_batches=1,
        world_size=1,
        fit_loop=SimpleNamespace(_should_accumulate=lambda: False),
        _logger_connector=SimpleNamespace(should_update_logs=False),
    )
    module = SimpleNamespace(trainer=trainer, log=lambda key, value, **kw: logged[-1].__setitem__(key, value))
    callback.on_train_start(trainer, module)
    for step, seconds in enumerate([1.0, 2.0, 3.0, 4.0], start=1):
        clock.now += seconds
        trainer.global_step = step
        trainer._logger_connector.should_update_logs = step % 3 == 0
        logged.append({})
        callback.on_train_batch_end(trainer, module, None, None, step - 1)
    assert logged[2]["perf/tokens_per_s"] == pytest.approx(300 / 6.0)  # steps 1-3: the logged row
    assert logged[3]["perf/tokens_per_s"] == pytest.approx(100 / 4.0)  # a new interval after it
    assert logged[2]["perf/tokens"] == 200 and logged[2]["perf/flops"] == 2000  # row 2: two steps trained
    assert callback.total_tokens == 400 and callback.train_seconds == pytest.approx(10.0)


def test_logger_job_type_is_checked():
    from components.registry import ConfigError

    assert compose_root("logger.job_type=ladder-rung").logger.job_type == "ladder-rung"
    with pytest.raises(ConfigError, match="logger.job_type.*choose one of null, train"):
        compose_root("logger.job_type=rung")
