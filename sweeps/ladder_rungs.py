"""The width/depth rule of a scaling ladder's rungs: every size keeps K3's shape.

``experiment=k3_small`` is K3 at ``d_model`` 256 and 8 layers. A rung of width ``d`` and depth ``L``
scales every width with ``d`` in the proportions ``k3_small`` has, and keeps everything that is a count
rather than a width:

- KDA: 4 heads of ``d / 4`` (k3_small: 4 x 64); MLA: 4 heads, q-LoRA rank ``d / 2``, KV-LoRA rank
  ``d / 4``, NoPE/RoPE/value head widths ``d / 4``, ``d / 8``, ``d / 4``;
- the layer plan (three KDA layers then MLA, the last layer MLA) and block AttnRes's 2 layers per block,
  so ``L`` is a multiple of 4;
- Stable LatentMoE's 32 experts, top-4 and two shared experts; expert width ``d / 4``, latent ``d / 2``;
  the dense first-layer FFN ``4 d``.

An arm's overlay (``experiment=k3_small_plain_residual``, ...) is applied first and the rung's sizes
after it, so a rung is the same size in every arm of a decision.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rung:
    d_model: int
    n_layers: int

    @property
    def name(self) -> str:
        return f"d{self.d_model}x{self.n_layers}"

    def check(self) -> None:
        if self.d_model <= 0 or self.d_model % 16:
            raise ValueError(f"rung {self.name}: d_model must be a positive multiple of 16 (d/8 even RoPE width)")
        if self.n_layers <= 0 or self.n_layers % 4:
            raise ValueError(f"rung {self.name}: n_layers must be a positive multiple of 4 (3 KDA : 1 MLA)")

    def overrides(self) -> list[str]:
        """Hydra overrides giving an arm's composition this rung's sizes."""
        self.check()
        d = self.d_model
        return [
            f"model.d_model={d}",
            f"model.n_layers={self.n_layers}",
            "mixer.n_heads=4",
            f"mixer.head_dim={d // 4}",
            "mixers.mla.n_heads=4",
            f"mixers.mla.q_lora_rank={d // 2}",
            f"mixers.mla.kv_lora_rank={d // 4}",
            f"mixers.mla.qk_nope_head_dim={d // 4}",
            f"mixers.mla.qk_rope_head_dim={d // 8}",
            f"mixers.mla.v_head_dim={d // 4}",
            f"ffn.expert_hidden_dim={d // 4}",
            f"ffn.latent_dim={d // 2}",
            f"ffns.dense.hidden_dim={4 * d}",
        ]
