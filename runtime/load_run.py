"""A trained model back out of a run: ``load_run(RUN_DIR or CHECKPOINT) -> (config, model)``.

Every checkpoint carries the run's composed config (``run_config``, written by the training module), so
a checkpoint file alone is enough. A run folder resolves to its newest readable checkpoint (``last.ckpt``,
then the periodic ones from the newest down). The model comes back in eval mode on the device and dtype
asked for; the config is the typed ``RootConfig`` the run was trained with.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import torch
from omegaconf import OmegaConf

from components.config import ModelConfig
from components.model import Decoder
from components.registry import FAMILIES
from runtime.checkpoint_io import CorruptCheckpointError, load_checkpoint_file
from runtime.config import LoggerConfig, RootConfig, TrainerConfig

CONFIG_KEY = "run_config"
_COMPONENTS = {"mixer": "mixer", "ffn": "ffn", "residual": "residual", "balancer": "balancer", "data": "data", "optimizer": "optimizer"}


class RunLoadError(ValueError):
    """A run folder or checkpoint that cannot be loaded; the message names it and why."""


def _typed(schema: type, node: dict) -> Any:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), node))


def config_from_container(data: dict) -> RootConfig:
    """The typed ``RootConfig`` of ``runtime.config.to_container``'s plain dict: each component under its
    registered schema (no file checks: the data need not exist where the model is loaded)."""
    fields: dict[str, Any] = {}
    for key, group in _COMPONENTS.items():
        fields[key] = _typed(FAMILIES[group].get(data[key]["name"], key=f"{key}.name").config_cls, data[key])
    fields["mixers"] = {slot: _typed(FAMILIES["mixer"].get(n["name"]).config_cls, n) for slot, n in (data.get("mixers") or {}).items()}
    fields["ffns"] = {slot: _typed(FAMILIES["ffn"].get(n["name"]).config_cls, n) for slot, n in (data.get("ffns") or {}).items()}
    fields["model"] = _typed(ModelConfig, data["model"])
    fields["trainer"] = _typed(TrainerConfig, data["trainer"])
    fields["logger"] = _typed(LoggerConfig, data["logger"])
    plain = {f.name for f in dataclasses.fields(RootConfig)} - set(fields)
    return RootConfig(**fields, **{k: data[k] for k in plain if k in data})


def resolve_checkpoint(path: str) -> str:
    """The checkpoint file ``path`` names: itself, or a run folder's newest readable one."""
    from runtime.run import checkpoint_candidates

    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise RunLoadError(f"{path}: no such run folder or checkpoint file")
    if os.path.isfile(os.path.join(path, ".metadata")):
        raise RunLoadError(f"{path} is a sharded (FSDP2) checkpoint folder; loading one outside a distributed run is not supported yet")
    candidates = checkpoint_candidates(path)
    if not candidates:
        raise RunLoadError(f"{path}: no checkpoint in {os.path.join(path, 'checkpoints')} (not a run folder, or it never saved one)")
    for candidate in candidates:
        try:
            load_checkpoint_file(candidate)
            return candidate
        except (CorruptCheckpointError, FileNotFoundError):
            continue
    raise RunLoadError(f"{path}: none of its {len(candidates)} checkpoints is readable")


def load_run(path: str, device: str | torch.device = "cpu", dtype: Optional[torch.dtype] = None) -> tuple[RootConfig, Decoder]:
    """(the run's config, its trained model in eval mode on ``device``, in ``dtype`` if given)."""
    ckpt_path = resolve_checkpoint(path)
    try:
        ckpt = load_checkpoint_file(ckpt_path)
    except CorruptCheckpointError as err:
        raise RunLoadError(str(err)) from None
    if CONFIG_KEY not in ckpt:
        raise RunLoadError(f"{ckpt_path} holds no run config (written before checkpoints carried one); resume it once with ckpt_path to write a new checkpoint")
    root = config_from_container(ckpt[CONFIG_KEY])
    model = Decoder(root.decoder_config())
    prefix = "model."
    state = {k[len(prefix):]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise RunLoadError(f"{ckpt_path}: its weights do not fit the model its config builds: {str(err).splitlines()[0]}") from None
    model = model.to(device=device)
    if dtype is not None:
        model = model.to(dtype=dtype)
    return root, model.eval()


def load_exported(folder: str) -> tuple[RootConfig, Decoder]:
    """(config, model with the folder's weights) of a folder ``analysis.export`` wrote."""
    from components.hf.checkpoint import import_weights
    from components.hf.config_json import SANDBOX_KEY, read_config

    cfg = read_config(folder)
    if SANDBOX_KEY not in cfg:
        raise RunLoadError(f"{os.path.join(folder, 'config.json')} has no '{SANDBOX_KEY}' section (not exported by this "
                           "project): load it into a composed model with components.hf.checkpoint.import_weights")
    root = config_from_container(cfg[SANDBOX_KEY])
    model = Decoder(root.decoder_config())
    import_weights(folder, model)
    return root, model.eval()
