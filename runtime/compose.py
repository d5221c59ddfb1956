"""Composing a run config from overrides, exactly as ``train.py`` does, with readable errors.

``compose(overrides)`` is Hydra's composition of ``conf/config.yaml`` (the ``hydra`` node included);
``compose_root(overrides)`` adds the validation (``runtime/validation.py``) and returns the typed
``RootConfig``. Every problem is a ``ConfigError`` naming the full key: an unknown component lists the
registered ones, an unknown group option the YAML files there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import MissingConfigException
from omegaconf import DictConfig, open_dict
from omegaconf.errors import OmegaConfBaseException

from components.registry import ConfigError, unknown_choice_message
from runtime.config import REGISTRIES, RootConfig, register_all
from runtime.validation import validate

CONFIG_NAME = "config"
JOB_NAME = "train"  # what Hydra calls a job of train.py (hydra.job.name)


def conf_dir() -> str:
    return str(Path(__file__).resolve().parent.parent / "conf")


def _find_omegaconf_error(err: BaseException) -> Optional[OmegaConfBaseException]:
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OmegaConfBaseException):
            return err
        err = err.__cause__ or err.__context__
    return None


def translate_compose_error(err: Exception) -> ConfigError:
    """One ConfigError naming the key for whatever Hydra raised while composing."""
    if isinstance(err, MissingConfigException):
        missing = err.missing_cfg_file or ""
        group, _, option = missing.rpartition("/")
        if group in REGISTRIES:
            return ConfigError(
                group, unknown_choice_message(REGISTRIES[group].family, option, REGISTRIES[group].names())
            )
        if group:
            options = sorted(o for o in (err.options or []) if not o.endswith("_schema"))
            return ConfigError(group, unknown_choice_message(f"'{group}' option", option, options, listing="Available"))
        return ConfigError("", str(err).strip().splitlines()[0])
    inner = _find_omegaconf_error(err)
    if inner is not None:
        key = getattr(inner, "full_key", "") or ""
        msg = str(getattr(inner, "msg", inner)).strip().splitlines()[0]
        return ConfigError(key, msg)
    text = str(err).strip()
    return ConfigError("", text.splitlines()[0] if text else type(err).__name__)


def compose(overrides: list[str], config_name: str = CONFIG_NAME) -> DictConfig:
    """The config (with its ``hydra`` node) Hydra composes for ``overrides``; raises ConfigError."""
    register_all()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=conf_dir(), job_name=JOB_NAME, version_base=None):
            return hydra_compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    except ConfigError:
        raise
    except Exception as err:  # Hydra wraps omegaconf errors in several exception types
        raise translate_compose_error(err) from None
    finally:
        GlobalHydra.instance().clear()


def strip_hydra(cfg: DictConfig) -> DictConfig:
    """The run's own config: ``cfg`` without Hydra's node."""
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.pop("hydra", None)
    return cfg


def compose_root(overrides: list[str]) -> RootConfig:
    """Compose and validate one run's config; returns the typed RootConfig (ConfigError on any problem)."""
    return validate(strip_hydra(compose(overrides)))
