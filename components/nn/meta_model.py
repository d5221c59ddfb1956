"""Build a decoder on the meta device: shapes and parameter counts without allocating weights.

Random initialisation means nothing on the meta device, and torch's meta ``normal_`` costs seconds the
first time a process uses it (it loads Python decompositions), which every pre-flight check and model
report would pay. So ``normal_`` is a no-op while the model is built.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch


@contextmanager
def _no_random_normal() -> Iterator[None]:
    original = torch.Tensor.normal_
    torch.Tensor.normal_ = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.normal_ = original  # type: ignore[method-assign]


def build_on_meta(root: Any) -> torch.nn.Module:
    """``Decoder(root)`` with every parameter and buffer on the meta device."""
    from components.model import Decoder

    with torch.device("meta"), _no_random_normal():
        return Decoder(root)
