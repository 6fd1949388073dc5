"""Plots people would rather look at than read (matplotlib, Agg backend, no display)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from olproute.sim import metrics
from olproute.sim.cluster import SimResult


def latency_cdfs(runs: Sequence[tuple[str, SimResult]], path: Path, title: str = "") -> None:
    """Two panels, TTFT and EEL, one empirical CDF per policy (log-scaled time axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for ax, (label, fn) in zip(axes, (("TTFT (s)", metrics.ttft_s), ("EEL (s)", metrics.eel_s)),
                               strict=True):
        for name, res in runs:
            x = fn(res)
            x = np.sort(x[np.isfinite(x)])
            if x.size == 0:
                continue
            y = np.arange(1, x.size + 1) / x.size
            ax.step(x, y, where="post", label=name)
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(True, which="both", alpha=0.3)
        for q in (0.5, 0.99):
            ax.axhline(q, color="grey", lw=0.6, ls=":")
    axes[0].legend(loc="lower right")
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
