"""The model side of the K3 sandbox: registries of interchangeable mixers, FFNs, balancers, residual
schemes, datasets and optimizers, and the decoder that assembles them from its config.

Nothing under ``components`` imports the runtime (``runtime/``: training, launch, logging); a test
walks the import graph to keep it that way.
"""
