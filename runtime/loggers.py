"""W&B + local JSONL loggers for a run; names, groups and tags derived from the chosen components."""

from __future__ import annotations

import netrc
import os
from typing import Any

# the summary.json fields a finished run also writes into its W&B summary (analysis/wandb_source.py reads them)
WANDB_SUMMARY_FIELDS = (
    "steps",
    "train_tokens",
    "tokens_per_s",
    "params",
    "active_params",
    "d_model",
    "decode_state_numbers",
    "metric",
)


def component_tags(root: Any) -> list[str]:
    """``mixer:gqa``, ``ffn:dense``, ``act:situ_glu``, ``residual:plain``, ... for every distinct choice."""
    plan = root.decoder_config().layers
    mixers = sorted({spec.mixer.name for spec in plan})
    ffns = sorted({spec.ffn.name for spec in plan})
    implied = sorted({tag for spec in plan for comp in (spec.mixer, spec.ffn) for tag in comp.tags()})
    tags = [f"mixer:{m}" for m in mixers] + [f"ffn:{f}" for f in ffns] + implied
    tags += [f"residual:{root.residual.name}", f"balancer:{root.balancer.name}", f"data:{root.data.name}"]
    return tags


def default_run_name(root: Any) -> str:
    plan = root.decoder_config().layers
    mixers = "+".join(sorted({s.mixer.name for s in plan}))
    ffns = "+".join(sorted({s.ffn.name for s in plan}))
    return f"{root.data.name}-{mixers}-{ffns}-{root.residual.name}-d{root.model.d_model}x{root.model.n_layers}"


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
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0


def build_loggers(root: Any, run_dir: str, run_name: str, config_dict: dict, resume_id: str | None) -> tuple[list, Any]:
    """Loggers for the trainer and the W&B logger (or None).

    W&B never ends a run: if the online run cannot start (no network, bad credentials, server down)
    the run is recorded offline instead (``wandb sync`` uploads it later), and if logging fails
    mid-run W&B is dropped with a warning while metrics.jsonl keeps everything.
    """
    from runtime.jsonl_logger import JSONLLogger

    loggers: list = [JSONLLogger(run_dir, name=run_name)]
    wandb_logger = None
    lc = root.logger
    mode = wandb_mode(lc.mode)
    if lc.name == "wandb" and mode != "disabled":
        from runtime.safe_wandb import SafeWandbLogger

        tags = list(dict.fromkeys(component_tags(root) + list(lc.tags)))
        kwargs = dict(
            name=run_name,
            project=lc.project,
            entity=lc.entity,
            group=lc.group or default_run_name(root),
            tags=tags,
            save_dir=run_dir,
            id=resume_id,
            resume="allow" if resume_id else None,
            config=config_dict,
        )
        wandb_logger = SafeWandbLogger(offline=mode == "offline", settings=_wandb_settings(lc.init_timeout_s), **kwargs)
        if _is_global_zero() and mode == "online":
            try:
                wandb_logger.experiment  # start the run now, so a failure is handled before training
            except Exception as err:  # wandb raises several types for network and auth failures
                print(
                    f"warning: W&B online run could not start ({type(err).__name__}: "
                    f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}); recording it offline in "
                    f"{run_dir}/wandb instead (upload later with `wandb sync`)"
                )
                _finish_quietly()
                os.environ["WANDB_MODE"] = "offline"  # also for any later wandb.init in this process
                wandb_logger = SafeWandbLogger(
                    offline=True, mode="offline", settings=_wandb_settings(lc.init_timeout_s), **kwargs
                )
        loggers.append(wandb_logger)
    return loggers, wandb_logger


def _finish_quietly(exit_code: int = 1) -> None:
    import wandb

    try:
        wandb.finish(exit_code=exit_code)
    except Exception:
        pass


def _wandb_settings(init_timeout_s: float = 90.0) -> Any:
    import wandb

    # no code saving or console capture: runs stay small and never block on the network
    return wandb.Settings(save_code=False, console="off", silent=True, init_timeout=init_timeout_s)
