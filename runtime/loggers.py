"""W&B + local JSONL loggers for a run: W&B's name, group and job type from runtime/run_identity.py, tags
from the chosen components, a resumed run's missing history replayed from metrics.jsonl."""

from __future__ import annotations

import netrc
import os
from typing import Any

from runtime.metric_ledger import MetricLedger, record_key
from runtime.run_identity import fit_tags, job_type_for, run_identity
from runtime.wandb_offline import read_run, segments, wait_for_a_new_segment_name


def component_tags(root: Any) -> list[str]:
    """``mixer:gqa``, ``ffn:dense``, ``act:situ_glu``, ``residual:plain``, ... for every distinct choice."""
    plan = root.decoder_config().layers
    mixers = sorted({spec.mixer.name for spec in plan})
    ffns = sorted({spec.ffn.name for spec in plan})
    implied = sorted({tag for spec in plan for comp in (spec.mixer, spec.ffn) for tag in comp.tags()})
    tags = [f"mixer:{m}" for m in mixers] + [f"ffn:{f}" for f in ffns] + implied
    tags += [f"residual:{root.residual.name}", f"balancer:{root.balancer.name}", f"data:{root.data.name}"]
    return tags


def wandb_credentials_present() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        auth = netrc.netrc().authenticators("api.wandb.ai")
        return auth is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def wandb_mode(requested: str) -> str:
    """online / offline / disabled: an explicit WANDB_MODE wins, then the config, then credentials."""
    env = os.environ.get("WANDB_MODE")
    if env in ("online", "offline", "disabled", "dryrun"):
        return "offline" if env == "dryrun" else env
    if requested != "auto":
        return requested
    return "online" if wandb_credentials_present() else "offline"


def _is_global_zero() -> bool:
    from lightning.pytorch.utilities.rank_zero import rank_zero_only  # start-up time: lightning, only once a run starts

    return getattr(rank_zero_only, "rank", 0) == 0


def build_loggers(
    root: Any,
    run_dir: str,
    run_name: str,
    config_dict: dict,
    resume_id: str | None,
    overrides: list[str] | None = None,
    job_type: str | None = None,
) -> tuple[list, Any]:
    """Loggers for the trainer and the W&B logger (or None).

    ``overrides``: the run's command-line overrides (None: the running Hydra job's), which name the W&B
    run and its group (``runtime/run_identity.py``); ``job_type``: None for ``logger.job_type`` where the
    config has one, else ``sweep-point`` when ``config_dict`` has a ``sweep`` node, else ``train``.

    W&B never ends a run: if the online run cannot start (no network, bad credentials, server down)
    the run is recorded offline instead (``wandb sync`` uploads it later); if W&B cannot start at all the
    run goes on without it; if logging fails mid-run W&B is dropped with a warning while metrics.jsonl
    keeps everything. A resumed run's W&B history gets the records of ``metrics.jsonl`` it lacks (the
    steps a killed process logged there but W&B never wrote) before training goes on.
    """
    from runtime.jsonl_logger import JSONLLogger  # start-up time: lightning, only once a run starts

    jsonl = JSONLLogger(run_dir, name=run_name)
    loggers: list = [jsonl]
    lc = root.logger
    mode = wandb_mode(lc.mode)
    if lc.name != "wandb" or mode == "disabled":
        return loggers, None
    from runtime.safe_wandb import SafeWandbLogger  # start-up time: lightning and wandb, only for W&B runs

    job_type = job_type or getattr(lc, "job_type", None) or job_type_for(config_dict.get("sweep"))
    identity = run_identity(root, overrides, run_dir, job_type, group=lc.group or None)
    wanted = [*component_tags(root), f"layers:{identity.plans['layer_plan']}", *lc.tags]
    tags, cut = fit_tags(wanted)
    run_fields = identity.config_fields()
    if cut:
        run_fields["tags_cut"] = cut  # the full value of every tag W&B's 64 characters could not hold
    kwargs = dict(
        name=identity.name,
        project=lc.project,
        entity=lc.entity,
        group=identity.group,
        job_type=identity.job_type,
        tags=tags,
        save_dir=run_dir,
        id=resume_id,
        resume="allow" if resume_id else None,
        config={**config_dict, "run": run_fields},
    )
    earlier = jsonl.ledger.earlier

    def make(offline: bool) -> Any:
        if offline and resume_id and _is_global_zero():  # the rank that starts the run's new segment
            wait_for_a_new_segment_name(os.path.join(run_dir, "wandb"), resume_id)
        # explicit: otherwise the settings an earlier W&B run of this process left would decide
        extra = {"mode": "offline" if offline else "online"}
        return SafeWandbLogger(
            offline=offline,
            settings=wandb_settings(lc.init_timeout_s),
            ledger=MetricLedger(earlier),
            **extra,
            **kwargs,
        )

    wandb_logger = make(mode == "offline")
    if not _is_global_zero():
        loggers.append(wandb_logger)
        return loggers, wandb_logger
    offline = mode == "offline"
    earlier_segments = _offline_history(run_dir, resume_id) if resume_id else None
    try:
        wandb_logger.experiment  # start the run now, so a failure is handled before training
    except Exception as err:  # wandb raises several types for network, auth and settings failures
        _finish_quietly()
        if offline:
            print(f"warning: W&B could not start ({_one_line(err)}); this run goes on without W&B (metrics.jsonl)")
            return loggers, None
        print(
            f"warning: W&B online run could not start ({_one_line(err)}); recording it offline in "
            f"{run_dir}/wandb instead (upload later with `wandb sync`)"
        )
        os.environ["WANDB_MODE"] = "offline"  # also for any later wandb.init in this process
        offline = True
        wandb_logger = make(True)
        try:
            wandb_logger.experiment
        except Exception as err2:
            _finish_quietly()
            print(f"warning: W&B could not start ({_one_line(err2)}); this run goes on without W&B (metrics.jsonl)")
            return loggers, None
    if offline:
        rows_before, present = earlier_segments or (0, set())
        missing = [r for r in earlier if record_key(r.get("step"), r) not in present]
    else:  # W&B's own resume: the server's rows are the first of metrics.jsonl's records, in order
        rows_before = int(getattr(wandb_logger.experiment, "step", 0) or 0)
        missing = earlier[rows_before:]
    wandb_logger.start(rows_before, missing)
    loggers.append(wandb_logger)
    return loggers, wandb_logger


def _offline_history(run_dir: str, run_id: str) -> tuple[int, set] | None:
    """(history rows, their record keys) of the offline segments of run ``run_id`` already in ``run_dir``,
    read with wandb's own reader; None when it cannot read them (the replay then starts from nothing)."""
    folders = segments(os.path.join(run_dir, "wandb"), run_id)
    if not folders:
        return None
    try:
        run = read_run(folders)
    except Exception as err:  # a missing or failing reader: W&B's history may then hold a step twice
        print(f"warning: earlier W&B segments of this run unreadable ({_one_line(err)}); replaying metrics.jsonl")
        return None
    return run.rows, {record_key(r["step"], r) for r in run.history}


def _one_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def log_validation(trainer: Any, metrics: dict[str, float]) -> None:
    """One validation's record to every logger, at ``trainer.global_step``: the step the weights are at
    (inside training Lightning would log it one step early, as the next step's training row), with the
    compute axis of the callbacks that keep one (``compute_axis``: ``perf/tokens``, ``perf/flops``). A final
    validation at the step of the last one is the same record, which the loggers keep once."""
    if trainer.sanity_checking or not trainer.is_global_zero:
        return
    step = trainer.global_step
    record = dict(metrics)
    for callback in trainer.callbacks:
        axis = getattr(callback, "compute_axis", None)
        if axis is not None:
            record.update(axis(trainer, step))
    for logger in trainer.loggers:
        logger.log_metrics(record, step=step)
        logger.save()


def _finish_quietly(exit_code: int = 1) -> None:
    import wandb  # start-up time: wandb, only once W&B is used

    try:
        wandb.finish(exit_code=exit_code)
    except Exception:
        pass


def wandb_settings(init_timeout_s: float = 90.0) -> Any:
    """The settings of every W&B run the project starts (training segments, evaluations)."""
    import wandb  # start-up time: wandb, only once W&B is used

    # no code saving or console capture: runs stay small and never block on the network
    return wandb.Settings(save_code=False, console="off", silent=True, init_timeout=init_timeout_s)
