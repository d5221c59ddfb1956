"""One training step wired as the trainer wires it, for benchmarks (GPU check, K3 speed on the CPU)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from components.model import Decoder
from components.objective import cross_entropy
from components.registry import BALANCERS, OPTIMIZERS
from runtime.compile import compiled_hidden


def train_setup(
    root: Any,
    device: torch.device,
    compile: str = "off",
    prepare: Callable[[torch.nn.Module], None] | None = None,
    precision: str = "bf16",
    compile_backend: str = "inductor",
    compile_finish: bool = True,
) -> tuple[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """The decoder of ``root`` on ``device`` and a training step ``step(ids [B, T+1]) -> loss``: bf16
    autocast forward (``precision="fp32"``: none), fp32 cross-entropy plus the MTP depths' weighted loss
    and the balancer's loss, backward, the config's optimizer, the balancer's update (wired as the
    trainer's training step). ``prepare(model)`` runs before the
    optimizer is built (sharding). ``compile``: off, model (one graph) or layers (per decoder layer), as
    runtime/compile.py compiles for the trainer (``compile_finish``: also the residual's final read)."""
    torch.manual_seed(0)
    model = Decoder(root.decoder_config()).to(device).train()
    if prepare is not None:
        prepare(model)
    balancer = BALANCERS.build(root.balancer)
    balancer.attach(model)
    optimizer = OPTIMIZERS.build(root.optimizer, model)
    hidden = compiled_hidden(model, compile, compile_backend, compile_finish)

    def step(ids: torch.Tensor) -> torch.Tensor:
        x, y = ids[:, :-1], ids[:, 1:]  # [B, T] each
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            h = hidden(x)  # [B, T, d]
            logits = model.lm_head(h)  # [B, T, vocab]
            mtp = model.mtp_losses(h, x, y)  # [(summed cross-entropy, tokens)] per MTP depth
        loss = cross_entropy(logits, y, reduction="mean")
        total = loss
        if mtp:
            total = total + root.model.mtp_weight * torch.stack([s / n for s, n in mtp]).mean()
        aux = balancer.aux_loss(model)
        optimizer.zero_grad(set_to_none=True)
        (total if aux is None else total + aux).backward()
        optimizer.step()
        balancer.step(model)
        return loss.detach()

    return model, step
