"""Branching from another run: the checkpoint or weights folder ``init_from`` / ``init_step`` name."""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from components.hf.config_json import SANDBOX_KEY, read_config
from components.hf.foreign_config import composition_overrides, merged_overrides
from components.hf.weights_folder import WeightsMismatch, check_weights, is_checkpoint_folder
from components.model import Decoder
from components.registry import ConfigError
from runtime.checkpoints import layout
from runtime.checkpoints.read import CorruptCheckpointError, load_checkpoint_file, verify_checkpoint
from runtime.config import RootConfig


def check(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(key, message)


def check_weights_fit(folder: str, root: RootConfig) -> None:
    """Every tensor of the weights folder fits the composed model (names, shapes, dtypes from the files'
    headers, the model built on the meta device): a ConfigError naming the first that does not."""
    with torch.device("meta"):
        model = Decoder(root.decoder_config())
    try:
        check_weights(folder, model)
    except (WeightsMismatch, ValueError) as err:
        raise ConfigError(
            "init_from",
            f"{err}; compose the model the folder holds (its config.json, or its "
            "k3_sandbox section for a folder this project exported)",
        ) from None


def with_folder_composition(overrides: list[str]) -> tuple[list[str], Optional[str]]:
    """``overrides`` preceded by the composition of the folder ``init_from`` names when transformers saved
    it (a Llama model, components/hf/foreign_config.py), minus what the overrides set themselves; and a
    line saying so (None when nothing was added)."""
    path = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("init_from=")), None)
    if not path or not is_checkpoint_folder(path):
        return overrides, None
    try:
        cfg = read_config(path)
        if SANDBOX_KEY in cfg:
            return overrides, None
        derived = composition_overrides(cfg)
    except (ValueError, KeyError):  # not a transformers model folder: check_weights_fit names what differs
        return overrides, None
    merged = merged_overrides(derived, overrides)
    added = [o for o in merged if o not in overrides]
    arch = (cfg.get("architectures") or [cfg.get("model_type")])[0]
    return merged, f"init_from={os.path.basename(path.rstrip(os.sep))}: {arch}, composed as {' '.join(added)}"


@functools.lru_cache(maxsize=8)
def _checkpoint_weights(path: str, size: int, mtime_ns: int) -> dict[str, tuple[tuple[int, ...], bool]]:
    """``{model key: (shape, floating)}`` of a checkpoint, read completely once per file version (every
    job of a sweep branching from it is checked against the same read); CorruptCheckpointError naming a
    truncated or corrupt file."""
    if os.path.isdir(path):  # a sharded checkpoint: every shard's byte range, the weights from the index
        import torch.distributed.checkpoint as dcp  # start-up time: DCP, sharded checkpoints only

        verify_checkpoint(path)
        entries = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        prefix = f"state_dict.{layout.MODULE_PREFIX}"
        return {
            k[len(prefix) :]: (tuple(m.size), m.properties.dtype.is_floating_point)
            for k, m in entries.items()
            if k.startswith(prefix) and isinstance(m, dcp.metadata.TensorStorageMetadata)
        }
    state = load_checkpoint_file(path, mmap=True).get("state_dict")  # every byte checked, none kept in memory
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"checkpoint {path} holds no model weights (no state_dict)")
    return {
        k[len(layout.MODULE_PREFIX) :]: (tuple(v.shape), v.is_floating_point())
        for k, v in state.items()
        if k.startswith(layout.MODULE_PREFIX) and hasattr(v, "shape")
    }


def check_checkpoint_fits(path: str, key: str, root: RootConfig) -> None:
    """The checkpoint a branch starts from reads completely and its weights fit the composed model
    (every key, each shape, floating where the model's are): a ConfigError on ``key`` naming the file
    and the first tensor that does not, before any run folder exists."""
    stat = os.stat(path)
    try:
        found = _checkpoint_weights(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
    except CorruptCheckpointError as err:
        raise ConfigError(key, str(err)) from None
    with torch.device("meta"):
        model = Decoder(root.decoder_config())
    expected = model.state_dict()
    hint = "compose the model the run was trained with (the overrides of the run branched from)"
    for name, tensor in expected.items():
        if name not in found:
            raise ConfigError(key, f"{path} has no {name} (a tensor of the composed model); {hint}")
        shape, floating = found[name]
        if shape != tuple(tensor.shape):
            raise ConfigError(
                key, f"{path}: {name} has shape {list(shape)}, the composed model needs {list(tensor.shape)}; {hint}"
            )
        if floating != tensor.is_floating_point():
            raise ConfigError(key, f"{path}: {name} is {'' if floating else 'not '}floating-point, unlike the model's")
    unknown = sorted(set(found) - set(expected))
    if unknown:
        more = f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""
        raise ConfigError(key, f"{path}: {unknown[0]}{more} is not a tensor of the composed model; {hint}")


def branch_checkpoint(root: RootConfig) -> Optional[str]:
    """The checkpoint ``init_from`` / ``init_step`` name (None without ``init_from``, or when it names a
    folder of weights: the run then starts at step 0 from those weights); ConfigError naming the key
    when it does not exist."""
    if root.init_from is None:
        check(root.init_step is None, "init_step", "needs init_from (the run folder to branch from)")
        return None
    check(
        root.ckpt_path in (None, "last"),
        "init_from",
        f"a run either branches (init_from) or resumes a checkpoint (ckpt_path={root.ckpt_path}), not both; "
        "ckpt_path=last resumes a branch",
    )
    path = root.init_from
    if is_checkpoint_folder(path):
        check(
            root.init_step is None,
            "init_step",
            f"init_from={path} is a folder of exported weights; init_step applies to a run folder",
        )
        return None  # weights only: the run starts at step 0 (the training run loads them)
    if os.path.isfile(path) or layout.is_sharded(path):
        check(
            root.init_step is None,
            "init_step",
            f"init_from={path} is a checkpoint already; init_step applies to a run folder",
        )
        return path
    check(
        os.path.isdir(layout.folder_of(path)),
        "init_from",
        f"{path} is neither a checkpoint, a run folder (no checkpoints/ in it) nor a folder of exported weights "
        "(config.json beside model.safetensors)",
    )
    steps = layout.periodic_steps(path)
    check(
        root.init_step is not None,
        "init_step",
        f"init_from={path} is a run folder: name the step to branch at (checkpoints at steps {steps})",
    )
    ckpt = layout.periodic_path(path, root.init_step)
    check(os.path.exists(ckpt), "init_step", f"{path} has no checkpoint at step {root.init_step}; it has steps {steps}")
    return ckpt


def check_branch(root: RootConfig) -> None:
    """ConfigError naming the key when ``init_from`` / ``init_step`` name no checkpoint, or a checkpoint
    or weights folder that is damaged or that the composed model does not fit: everything a branch reads
    is verified here, before a run folder is created (``ckpt_path=last`` too: its first launch branches)."""
    ckpt = branch_checkpoint(root)  # raises for a missing run folder or step; refuses another ckpt_path
    if root.init_from is None:
        return
    if ckpt is not None:
        check_checkpoint_fits(ckpt, "init_step" if root.init_step is not None else "init_from", root)
    elif is_checkpoint_folder(root.init_from):
        check_weights_fit(root.init_from, root)
