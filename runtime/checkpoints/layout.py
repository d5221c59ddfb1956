"""Where a run's checkpoints live and what they hold, and the newest readable one.

    <run folder>/checkpoints/last.ckpt      the latest step (a file, or an FSDP2 sharded folder)
    <run folder>/checkpoints/step=N.ckpt    periodic checkpoints
    <run folder>/checkpoints/.last.ckpt.old a sharded last.ckpt is swapped in by two renames; a crash between
                                            them leaves the previous one here

Every checkpoint holds the training module's weights (keys ``model.*``) and the run's composed config
(``run_config``), so a checkpoint alone rebuilds its model.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Optional

from runtime.checkpoints.read import CorruptCheckpointError, load_checkpoint_file, verify_checkpoint

FOLDER = "checkpoints"
LAST = "last.ckpt"
PREVIOUS_LAST = ".last.ckpt.old"
PERIODIC_NAME = "step={step}"  # the periodic checkpoints' file name, without the suffix
CONFIG_KEY = "run_config"
MODULE_PREFIX = "model."  # the training module holds the decoder as .model

_STEP = re.compile(r"^step=(\d+)\.ckpt$")


class NoReadableCheckpoint(CorruptCheckpointError):
    """A run folder whose checkpoints are all unreadable; the message says how many were refused."""


def folder_of(run_dir: str) -> str:
    return os.path.join(run_dir, FOLDER)


def is_sharded(path: str) -> bool:
    """An FSDP2 sharded checkpoint folder (torch.distributed.checkpoint's index in it)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata"))


def periodic_steps(run_dir: str) -> list[int]:
    """The steps of a run folder's periodic checkpoints, ascending."""
    folder = folder_of(run_dir)
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return sorted(int(m.group(1)) for m in map(_STEP.match, names) if m)


def periodic_path(run_dir: str, step: int) -> str:
    return os.path.join(folder_of(run_dir), f"{PERIODIC_NAME.format(step=step)}.ckpt")


def candidates(run_dir: str) -> list[str]:
    """A run folder's checkpoints, newest first: ``last.ckpt`` (and the previous one a crash may have left),
    then the periodic ones from the newest step down."""
    folder = folder_of(run_dir)
    lasts = [os.path.join(folder, name) for name in (LAST, PREVIOUS_LAST)]
    periodic = [periodic_path(run_dir, step) for step in reversed(periodic_steps(run_dir))]
    return [p for p in lasts if os.path.exists(p)] + periodic


def has_checkpoint(run_dir: str) -> bool:
    return bool(candidates(run_dir))


def _newest(run_dir: str, on_refused: Callable[[str], None], read: Callable[[str], Any]) -> Optional[tuple[str, Any]]:
    """(path, ``read(path)``) of the newest checkpoint of ``run_dir`` that ``read`` accepts; each refusal
    reported through ``on_refused`` and skipped; NoReadableCheckpoint when every one is refused."""
    found = candidates(run_dir)
    for path in found:
        try:
            return path, read(path)
        except (CorruptCheckpointError, FileNotFoundError) as err:
            on_refused(str(err))
    if found:
        raise NoReadableCheckpoint(f"no readable checkpoint in {folder_of(run_dir)} (all {len(found)} refused)")
    return None


def newest_readable_content(
    run_dir: str, on_refused: Callable[[str], None] = lambda message: None
) -> Optional[tuple[str, dict[str, Any]]]:
    """(path, verified content) of the newest checkpoint of ``run_dir`` that reads completely (None when it has
    none), read once; each unreadable one is reported through ``on_refused`` and skipped; NoReadableCheckpoint
    when every one is refused."""
    return _newest(run_dir, on_refused, load_checkpoint_file)


def newest_readable(run_dir: str, on_refused: Callable[[str], None] = lambda message: None) -> Optional[str]:
    """The path of the newest checkpoint of ``run_dir`` that reads completely, verified without keeping its
    content (``verify_checkpoint``: the load that follows does not check its bytes again)."""
    newest = _newest(run_dir, on_refused, verify_checkpoint)
    return None if newest is None else newest[0]


def resume_point(ckpt_path: Optional[str], run_dir: str, log: Callable[[str], None] = print) -> Optional[str]:
    """The checkpoint a run given ``ckpt_path`` resumes from: None for a fresh run; for ``last`` the newest
    readable one of ``run_dir`` (each refusal reported, None when the run never saved one); otherwise the
    file named, verified."""
    if ckpt_path is None:
        return None
    if ckpt_path != "last":
        verify_checkpoint(ckpt_path)  # CorruptCheckpointError / FileNotFoundError naming it
        return ckpt_path
    newest = newest_readable(run_dir, on_refused=lambda message: log(f"refusing {message}; trying an older checkpoint"))
    if newest is None:
        log(f"ckpt_path=last: no checkpoint in {folder_of(run_dir)} yet; starting from scratch")
    return newest
