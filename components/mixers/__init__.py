"""Sequence mixers (registered with ``MIXERS``); the contract is ``base.Mixer``."""
