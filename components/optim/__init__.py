"""Optimizers as a registry family (``OPTIMIZERS``): ``adamw``, ``muon``; parameter grouping and
learning-rate schedules beside them."""
