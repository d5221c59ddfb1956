"""Datasets (registered with ``DATASETS``, config group ``data``); see ``base.TokenDataset``."""
