"""Random-number-generator state of every rank, saved in checkpoints and restored on resume.

Training batches are a pure function of (seed, batch index) and need no RNG, but anything stochastic
in a model (dropout, noise, sampling) draws from these generators; a resumed run continues their
streams exactly. Stored as tensors and plain values only, so checkpoints still load with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


def capture() -> dict[str, Any]:
    """This process's generator states."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, py_state, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "python": {"version": int(version), "state": torch.tensor(py_state, dtype=torch.int64), "gauss": gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    p = state["python"]
    random.setstate((p["version"], tuple(int(v) for v in p["state"].tolist()), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def gather_all_ranks() -> list[dict[str, Any]]:
    """Every rank's states, indexed by global rank (collective: call on all ranks)."""
    mine = capture()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def restore_for_rank(states: list[dict[str, Any]], rank: int) -> bool:
    """Restore this rank's saved states; False (nothing restored) when the world size changed."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if len(states) != world:
        return False
    restore(states[rank])
    return True
