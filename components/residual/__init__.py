"""Residual schemes: modules that own the depth stream (registered with ``RESIDUALS``).

The decoder never writes ``x + f(x)`` itself. For each layer ``l`` it asks the scheme for the input of
sublayer ``s`` (``s = 2l`` for the mixer, ``2l + 1`` for the FFN), applies that sublayer's pre-norm and
the sublayer, and hands the output back:

    state = scheme.start(embedding)
    h = scheme.read(state, s);  state = scheme.write(state, s, sublayer(norm(h)))   # for every s
    y = scheme.finish(state)                                                          # before the final norm

Contract: ``Scheme(cfg, d_model, n_layers, norm_eps)``.
"""
