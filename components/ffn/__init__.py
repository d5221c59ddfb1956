"""Feed-forward sublayers. Each module registers its members with ``components.registry.FFNS``.

Contract: ``FFN(cfg, d_model, layer_idx, init_std, out_init_std)``; ``forward(x [B, T, d]) -> [B, T, d]``;
``active_params()`` is the number of weights one token multiplies by (all of them for a dense FFN).
"""
