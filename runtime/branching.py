"""Branching from another run: the checkpoint or weights folder ``init_from`` / ``init_step`` name."""

from __future__ import annotations

from typing import Optional

from components.hf.checkpoint import is_checkpoint_folder
from components.registry import ConfigError
from runtime.config import RootConfig
from runtime.validation import check


def check_weights_fit(folder: str, root: RootConfig) -> None:
    """Every tensor of the weights folder fits the composed model (names, shapes, dtypes from the files'
    headers, the model built on the meta device): a ConfigError naming the first that does not."""
    import torch

    from components.hf.checkpoint import WeightsMismatch, check_weights
    from components.model import Decoder

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
    import os

    from components.hf.config_json import SANDBOX_KEY, read_config
    from components.hf.foreign_config import composition_overrides, merged_overrides

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


def branch_checkpoint(root: RootConfig) -> Optional[str]:
    """The checkpoint ``init_from`` / ``init_step`` name (None without ``init_from``, or when it names a
    folder of weights: the run then starts at step 0 from those weights); ConfigError naming the key
    when it does not exist."""
    import os

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
        return None  # weights only: the run starts at step 0 (runtime/run.py loads them)
    if os.path.isfile(path) or os.path.isfile(os.path.join(path, ".metadata")):
        check(
            root.init_step is None,
            "init_step",
            f"init_from={path} is a checkpoint already; init_step applies to a run folder",
        )
        return path
    check(
        os.path.isdir(os.path.join(path, "checkpoints")),
        "init_from",
        f"{path} is neither a checkpoint, a run folder (no checkpoints/ in it) nor a folder of exported weights "
        "(config.json beside model.safetensors)",
    )
    steps = sorted(
        int(n[5:-5])
        for n in os.listdir(os.path.join(path, "checkpoints"))
        if n.startswith("step=") and n.endswith(".ckpt")
    )
    check(
        root.init_step is not None,
        "init_step",
        f"init_from={path} is a run folder: name the step to branch at (checkpoints at steps {steps})",
    )
    ckpt = os.path.join(path, "checkpoints", f"step={root.init_step}.ckpt")
    check(os.path.exists(ckpt), "init_step", f"{path} has no checkpoint at step {root.init_step}; it has steps {steps}")
    return ckpt


def check_branch(root: RootConfig) -> None:
    """ConfigError naming the key when ``init_from`` / ``init_step`` name no checkpoint, or a weights
    folder the composed model does not fit."""
    branch_checkpoint(root)  # raises for a missing run folder or step
    if root.init_from is not None and root.ckpt_path is None and is_checkpoint_folder(root.init_from):
        check_weights_fit(root.init_from, root)
