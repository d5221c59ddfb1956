"""The width/depth rule of a scaling ladder's rungs: every size keeps K3's shape.

``experiment=k3_small`` is K3 at ``d_model`` 256 and 8 layers. A rung of width ``d`` and depth ``L``
scales every width with ``d`` in the proportions ``k3_small`` has, and keeps everything that is a count
rather than a width:

- KDA: 4 heads of ``d / 4`` (k3_small: 4 x 64); MLA: 4 heads, q-LoRA rank ``d / 2``, KV-LoRA rank
  ``d / 4``, NoPE/RoPE/value head widths ``d / 4``, ``d / 8``, ``d / 4``. Head widths stop at K3's own
  (KDA and MLA NoPE/value 128, RoPE 64; docs/k3.md) and wider models get more heads instead: ``d / 128``
  heads from ``d`` 512 on, which also keeps KDA within fla's kernel (head width at most 256). Heads times
  head width is ``d`` either way, so parameters and FLOPs follow the same rule;
- the layer plan (three KDA layers then MLA, the last layer MLA) and block AttnRes's 2 layers per block,
  so ``L`` is a multiple of 4;
- Stable LatentMoE's 32 experts, top-4 and two shared experts; expert width ``d / 4``, latent ``d / 2``;
  the dense first-layer FFN ``4 d``.

An arm's overlay (``experiment=k3_small_plain_residual``, ...) is applied first and the rung's sizes
after it, so a rung is the same size in every arm of a decision.
"""

from __future__ import annotations

from dataclasses import dataclass

HEAD_DIM = 128  # K3's KDA and MLA NoPE/value head width; its RoPE width is half of it


@dataclass(frozen=True)
class Rung:
    d_model: int
    n_layers: int

    @property
    def name(self) -> str:
        return f"d{self.d_model}x{self.n_layers}"

    @property
    def head_dim(self) -> int:
        """KDA's and MLA's NoPE/value head width: ``d / 4`` up to K3's 128."""
        return min(self.d_model // 4, HEAD_DIM)

    @property
    def n_heads(self) -> int:
        return self.d_model // self.head_dim

    def check(self) -> None:
        if self.d_model <= 0 or self.d_model % 16:
            raise ValueError(f"rung {self.name}: d_model must be a positive multiple of 16 (d/8 even RoPE width)")
        if self.d_model > 4 * HEAD_DIM and self.d_model % HEAD_DIM:
            raise ValueError(
                f"rung {self.name}: d_model above {4 * HEAD_DIM} must be a multiple of {HEAD_DIM} (heads of 128)"
            )
        if self.n_layers <= 0 or self.n_layers % 4:
            raise ValueError(f"rung {self.name}: n_layers must be a positive multiple of 4 (3 KDA : 1 MLA)")

    def overrides(self) -> list[str]:
        """Hydra overrides giving an arm's composition this rung's sizes."""
        self.check()
        d, heads, width = self.d_model, self.n_heads, self.head_dim
        return [
            f"model.d_model={d}",
            f"model.n_layers={self.n_layers}",
            f"mixer.n_heads={heads}",
            f"mixer.head_dim={width}",
            f"mixers.mla.n_heads={heads}",
            f"mixers.mla.q_lora_rank={d // 2}",
            f"mixers.mla.kv_lora_rank={d // 4}",
            f"mixers.mla.qk_nope_head_dim={width}",
            f"mixers.mla.qk_rope_head_dim={width // 2}",
            f"mixers.mla.v_head_dim={width}",
            f"ffn.expert_hidden_dim={d // 4}",
            f"ffn.latent_dim={d // 2}",
            f"ffns.dense.hidden_dim={4 * d}",
        ]
