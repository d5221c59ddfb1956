"""Matplotlib for files, never a window: every figure the analysis tools write goes through here."""

from __future__ import annotations


def pyplot():
    """`matplotlib.pyplot` on the Agg backend, so plots render on machines without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
