"""What a sublayer (mixer, FFN) or residual scheme is built with besides its own config: the decoder-wide
settings and the layer it sits in. The decoder builds one per layer; the defaults (a bare module in a test
or benchmark) are stated here once."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

# the init scale of every weight and the eps of every RMSNorm unless the model config says otherwise
INIT_STD = 0.02
NORM_EPS = 1e-5


@dataclass(frozen=True)
class BuildContext:
    """``Component(cfg, ctx)``: the stream width, the layer index (0-indexed), the depth, the init scales and
    the norm eps. New decoder-wide settings a component needs are added here, not to every constructor."""

    d_model: int
    layer_idx: int = 0
    n_layers: int = 1
    init_std: float = INIT_STD
    # init scale of the projections that write the residual stream; None: init_std
    out_init_std: Optional[float] = None
    norm_eps: float = NORM_EPS

    @classmethod
    def for_model(cls, model: Any) -> BuildContext:
        """The context of a ``components.config.ModelConfig`` (layer 0). Output projections start at
        init_std / sqrt(2 * n_layers) with ``scale_residual_init`` (GPT-2), so the stream does not grow
        with depth at initialisation."""
        out_std = model.init_std / math.sqrt(2 * model.n_layers) if model.scale_residual_init else model.init_std
        return cls(model.d_model, 0, model.n_layers, model.init_std, out_std, model.norm_eps)

    def at_layer(self, layer_idx: int) -> BuildContext:
        return dataclasses.replace(self, layer_idx=layer_idx)
