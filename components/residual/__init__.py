"""Residual schemes: modules that own the depth stream (registered with ``RESIDUALS``).

The decoder never writes ``x + f(x)`` itself. For each layer ``l`` it asks the scheme for the input of
sublayer ``s`` (``s = 2l`` for the mixer, ``2l + 1`` for the FFN) passed through that sublayer's pre-norm,
applies the sublayer, and hands the output back:

    state = scheme.start(embedding)
    x = scheme.read(state, s, norm);  state = scheme.write(state, s, sublayer(x))   # for every s
    y = scheme.finish(state, final_norm)                                            # the output

Contract: ``Scheme(cfg, d_model, n_layers, norm_eps)``; ``read``/``finish`` take the norm (or None for
the raw read) so a scheme may fuse it with its read (AttnRes recomputes both in backward).
"""
