"""Matplotlib for files, never a window: every figure the analysis tools write goes through here."""

from __future__ import annotations


def pyplot():
    """`matplotlib.pyplot` on the Agg backend, so plots render on machines without a display."""
    import matplotlib  # start-up time: matplotlib, only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # start-up time: matplotlib, only when a plot is drawn

    return plt
