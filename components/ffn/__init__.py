"""Feed-forward sublayers (registered with ``FFNS``); the contract is ``base.FFN``."""
