"""Sequence mixers. Each module registers its members with ``components.registry.MIXERS``.

Contract: ``Mixer(cfg, d_model, layer_idx, init_std, out_init_std)``; ``forward(x [B, T, d], state=None,
offset=0) -> [B, T, d]`` where ``state`` is this mixer's per-layer cache (updated in place) and
``offset`` the absolute position of the first of the T tokens; ``new_cache(batch_size)`` creates an
empty state; ``flops_per_token(seq_len)`` counts the multiply-adds that are not in weight matrices
(e.g. attention scores), forward pass only, as FLOPs (2 per multiply-add).
"""
