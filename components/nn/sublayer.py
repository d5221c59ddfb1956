"""What every decoder sublayer (mixer or FFN) holds and declares, shared by both contracts."""

from __future__ import annotations

from typing import Any

from components.nn.build_context import BuildContext
from components.nn.matrix_layout import HasMatrixLayouts
from components.nn.weight_decay import HasNoWeightDecay


class Sublayer(HasMatrixLayouts, HasNoWeightDecay):
    """A sublayer built from its config at one layer of a ``d_model``-wide decoder."""

    # False when forward holds eager islands (torch.compiler.disable'd code with data-dependent sizes or
    # host-side state: KDA's chunk choice, MoE routing plans and balancing statistics): the trainer then
    # compiles the model layer by layer around them instead of as one graph (runtime/compile.py)
    compile_friendly: bool = True

    def __init__(self, cfg: Any, ctx: BuildContext):
        super().__init__()
        self.cfg = cfg
        self.d_model = ctx.d_model
        self.layer_idx = ctx.layer_idx
