"""Residual schemes (registered with ``RESIDUALS``); the contract is ``base.ResidualScheme``."""
