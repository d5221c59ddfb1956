"""A trained model back out of a run: ``load_run(RUN_DIR, CHECKPOINT or EXPORTED_FOLDER) -> (config, model)``.

Every checkpoint carries the run's composed config (``run_config``, written by the training module), so
a checkpoint alone is enough: a ``.ckpt`` file, or an FSDP2 sharded ``.ckpt`` folder (read on one
process, every rank's shard reassembled). A run folder resolves to its newest readable checkpoint
(``last.ckpt``, then the periodic ones from the newest down). A folder ``analysis.export`` wrote
(safetensors + ``config.json`` with the composed config) loads too. The model comes back in eval mode
on the device and dtype asked for; the config is the typed ``RootConfig`` the run was trained with.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf.errors import OmegaConfBaseException

from components.config import ModelConfig
from components.config_from_dict import typed
from components.data.base import NoTextTokenizer
from components.data.text.tokenizers import (
    TOKENIZER_FILE,
    TextTokenizer,
    TokenizerError,
    load_prepared_tokenizer,
    load_tokenizer_file,
)
from components.hf.config_json import SANDBOX_KEY, TOKENIZER_KEY, read_config
from components.hf.foreign_config import ForeignConfigError, composition_overrides
from components.hf.safetensors_files import CheckpointError
from components.hf.weights_folder import WeightsMismatch, import_weights, is_checkpoint_folder
from components.model import Decoder
from runtime.checkpoints import layout
from runtime.checkpoints.layout import CONFIG_KEY, MODULE_PREFIX, NoReadableCheckpoint
from runtime.checkpoints.read import CorruptCheckpointError, load_checkpoint_file
from runtime.compose import compose_root
from runtime.config import COMPONENT_KEYS, REGISTRIES, LoggerConfig, RootConfig, TrainerConfig


class RunLoadError(ValueError):
    """A run folder or checkpoint that cannot be loaded; the message names it and why."""


# what runs saved before the schedule became its own group kept in the optimizer node
_OLD_SCHEDULE_KEYS = {
    "schedule": "name",
    "min_lr_ratio": "min_lr_ratio",
    "decay_fraction": "decay_fraction",
    "decay_shape": "decay_shape",
}


def _with_schedule_node(data: dict) -> dict:
    """``data`` with a ``schedule`` node: an old run config's schedule fields moved out of its optimizer,
    keeping those the named schedule has."""
    if "schedule" in data:
        return data
    optimizer = {k: v for k, v in data["optimizer"].items() if k not in _OLD_SCHEDULE_KEYS}
    old = {new: data["optimizer"][k] for k, new in _OLD_SCHEDULE_KEYS.items() if k in data["optimizer"]}
    old.setdefault("name", "cosine")
    schema = REGISTRIES["schedule"].get(old["name"], key="optimizer.schedule").config_cls
    kept = {f.name for f in dataclasses.fields(schema)}
    return {**data, "optimizer": optimizer, "schedule": {k: v for k, v in old.items() if k in kept}}


def config_from_container(data: dict) -> RootConfig:
    """The typed ``RootConfig`` of ``runtime.config.to_container``'s plain dict: each component under its
    registered schema (no file checks: the data need not exist where the model is loaded)."""
    data = _with_schedule_node(data)
    fields: dict[str, Any] = {}
    for key in COMPONENT_KEYS:
        fields[key] = typed(REGISTRIES[key].get(data[key]["name"], key=f"{key}.name").config_cls, data[key])
    fields["mixers"] = {
        slot: typed(REGISTRIES["mixer"].get(n["name"]).config_cls, n) for slot, n in (data.get("mixers") or {}).items()
    }
    fields["ffns"] = {
        slot: typed(REGISTRIES["ffn"].get(n["name"]).config_cls, n) for slot, n in (data.get("ffns") or {}).items()
    }
    fields["model"] = typed(ModelConfig, data["model"])
    fields["trainer"] = typed(TrainerConfig, data["trainer"])
    fields["logger"] = typed(LoggerConfig, data["logger"])
    plain = {f.name for f in dataclasses.fields(RootConfig)} - set(fields)
    return RootConfig(**fields, **{k: data[k] for k in plain if k in data})


def _composed(data: Any, where: str) -> tuple[RootConfig, Decoder]:
    """(config, freshly built model) of a saved composed config; RunLoadError naming ``where`` when it
    no longer builds one (a damaged file, or a config this version of the project does not know)."""
    try:
        root = config_from_container(data)
        return root, Decoder(root.decoder_config())
    except (ValueError, KeyError, TypeError, AttributeError, OmegaConfBaseException) as err:
        detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RunLoadError(f"{where}: its composed config does not build a model ({detail})") from None


def read_checkpoint(path: str) -> tuple[str, dict[str, Any]]:
    """(path, verified content) of the checkpoint ``path`` names: itself, or a run folder's newest readable one,
    each read once."""
    try:
        if os.path.isfile(path) or layout.is_sharded(path):
            return path, load_checkpoint_file(path)
        if not os.path.isdir(path):
            raise RunLoadError(f"{path}: no such run folder or checkpoint file")
        newest = layout.newest_readable_content(path)
    except NoReadableCheckpoint:
        raise RunLoadError(f"{path}: none of its {len(layout.candidates(path))} checkpoints is readable") from None
    except CorruptCheckpointError as err:
        raise RunLoadError(str(err)) from None
    if newest is None:
        raise RunLoadError(
            f"{path}: no checkpoint in {layout.folder_of(path)} (not a run folder, or it never saved one)"
        )
    return newest


def _sharded_model_state(ckpt_path: str, model: Decoder) -> dict[str, torch.Tensor]:
    """The model weights of an FSDP2 sharded checkpoint folder, read on this one process into tensors
    shaped like ``model``'s (torch.distributed.checkpoint reassembles every rank's shards)."""
    from torch.distributed.checkpoint import FileSystemReader, load  # start-up time: DCP, sharded checkpoints only

    wanted = {f"{MODULE_PREFIX}{k}": torch.empty_like(v) for k, v in model.state_dict().items()}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            load({"state_dict": wanted}, storage_reader=FileSystemReader(ckpt_path))
    except Exception as err:  # a key or shape the folder's index does not have
        raise RunLoadError(
            f"{ckpt_path}: its weights do not fit the model its config builds: {str(err).strip().splitlines()[-1]}"
        ) from None
    return wanted


def load_run(
    path: str, device: str | torch.device = "cpu", dtype: Optional[torch.dtype] = None
) -> tuple[RootConfig, Decoder]:
    """(the run's config, its trained model in eval mode on ``device``, in ``dtype`` if given)."""
    if is_checkpoint_folder(path):
        root, model = load_exported(path)
        return root, model.to(device=device, dtype=dtype).eval()
    ckpt_path, ckpt = read_checkpoint(path)
    if CONFIG_KEY not in ckpt:
        raise RunLoadError(
            f"{ckpt_path} holds no run config (written before checkpoints carried one); resume it once with "
            "ckpt_path to write a new checkpoint"
        )
    root, model = _composed(ckpt[CONFIG_KEY], ckpt_path)
    weights = _sharded_model_state(ckpt_path, model) if os.path.isdir(ckpt_path) else ckpt["state_dict"]
    state = {k[len(MODULE_PREFIX) :]: v for k, v in weights.items() if k.startswith(MODULE_PREFIX)}
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise RunLoadError(
            f"{ckpt_path}: its weights do not fit the model its config builds: {str(err).splitlines()[0]}"
        ) from None
    model = model.to(device=device)
    if dtype is not None:
        model = model.to(dtype=dtype)
    return root, model.eval()


def load_exported(folder: str) -> tuple[RootConfig, Decoder]:
    """(config, model with the folder's weights) of a folder ``analysis.export`` wrote."""
    where = os.path.join(folder, "config.json")
    try:
        cfg = read_config(folder)
    except ValueError as err:
        raise RunLoadError(str(err)) from None
    if not isinstance(cfg, dict):
        raise RunLoadError(f"{where} is not a JSON object")
    if SANDBOX_KEY in cfg:
        root, model = _composed(cfg[SANDBOX_KEY], where)
    else:  # a folder transformers saved: its composition from its config (components/hf/foreign_config.py)
        root = _foreign_composition(folder, cfg)
        model = Decoder(root.decoder_config())
    try:
        import_weights(folder, model)
    except (WeightsMismatch, CheckpointError) as err:
        raise RunLoadError(str(err)) from None
    return root, model.eval()


def _foreign_composition(folder: str, cfg: dict) -> RootConfig:
    """The composition of a folder transformers saved (a Llama model): components/hf/foreign_config.py."""
    try:
        overrides = composition_overrides(cfg)
    except (ForeignConfigError, KeyError) as err:
        raise RunLoadError(
            f"{os.path.join(folder, 'config.json')} has no '{SANDBOX_KEY}' section (not exported by this "
            f"project) and does not map onto a composition ({err}): train from it with init_from=FOLDER and "
            "the overrides that compose its model (e.g. experiment=k3_full)"
        ) from None
    return compose_root(["data=corpus", *overrides])  # the data only completes the config


class NoTokenizerError(RunLoadError):
    """The run's data has no tokenizer to turn text into tokens."""


def load_tokenizer(path: str, root: RootConfig) -> TextTokenizer:
    """The tokenizer of the run ``path`` names (``root`` is its config): the one an exported folder
    records (its ``tokenizer.json``, or bytes), else the one the run's data says it is tokenized with."""
    folder = is_checkpoint_folder(path)
    cfg = read_config(path) if folder else {}
    described = cfg.get(TOKENIZER_KEY)
    try:
        if described:  # an exported folder: its own tokenizer, checked against the hash export recorded
            return load_prepared_tokenizer(Path(path), described)
        if folder and SANDBOX_KEY not in cfg and (Path(path) / TOKENIZER_FILE).is_file():
            return load_tokenizer_file(Path(path) / TOKENIZER_FILE)  # a folder transformers saved
        return root.data.text_tokenizer()
    except (TokenizerError, NoTextTokenizer) as err:
        raise NoTokenizerError(str(err)) from None
