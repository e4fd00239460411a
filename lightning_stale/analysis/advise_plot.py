"""The advisor's figure: the error-runtime trade-off of Dutta et al. (AISTATS 2018; docs/method.md,
"Experiments in the paper": error at convergence against runtime, one point per variant and K)
with the time to a target loss as the runtime, beside the smoothed loss curves it comes from."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.figure import Figure

from lightning_stale.analysis.plot import COLORMAPS, LABEL_OFFSETS, MARKERS
from lightning_stale.method.variants import kind_of

if TYPE_CHECKING:
    from lightning_stale.analysis.advise import Advice
    from lightning_stale.analysis.sweeps import SweepRun

ADAPTIVE_COLOR = "tab:olive"


def run_color(run: SweepRun, p: int):
    import matplotlib

    if run.adaptive:
        return ADAPTIVE_COLOR
    shade = 0.45 + 0.5 * (run.k / max(p, 1))
    return matplotlib.colormaps[COLORMAPS.get(run.variant, "Greys")](min(shade, 0.95))


def plot_advice(advice: Advice) -> Figure:
    """Left: time to the target loss against final error, one point per run (runs that missed
    the target sit at the budget, hollow); the recommendation is circled. Right: the smoothed
    training loss of every run against virtual time, with the target."""
    figure = Figure(figsize=(12.0, 5.0), dpi=110, layout="constrained")
    tradeoff, curves = figure.subplots(1, 2)
    runs = list(advice.runs) + ([advice.adaptive] if advice.adaptive is not None else [])
    best = advice.best
    seen: set[str] = set()
    for run in runs:
        time_s = advice.time_of(run)
        missed = math.isnan(time_s)
        x = advice.budget_s if missed else time_s
        color = run_color(run, advice.p)
        title = "AdaSync" if run.adaptive else kind_of(run.variant).title
        tradeoff.scatter([x], [run.final_error], s=60, marker="*" if run.adaptive else
                         MARKERS.get(run.variant, "o"), edgecolors=color,
                         facecolors="none" if missed else [color],
                         label=None if title in seen else title, zorder=3)
        seen.add(title)
        if not run.adaptive and run.variant not in ("sync", "async"):
            tradeoff.annotate(f"K={run.k}", (x, run.final_error), fontsize=7,
                              textcoords="offset points",
                              xytext=LABEL_OFFSETS.get(run.variant, (6, 4)))
        if run is best:
            tradeoff.scatter([x], [run.final_error], s=260, facecolors="none",
                             edgecolors="black", linewidths=1.5, zorder=4,
                             label="recommended")
        smoothed = run.smoothed(advice.window)
        curves.plot(run.times, smoothed, color=color, lw=2.0 if run is best else 1.0,
                    label=run.label if run is best or run.adaptive else None)
    if any(math.isnan(advice.time_of(run)) for run in runs):
        tradeoff.axvline(advice.budget_s, color="grey", ls=":", lw=1,
                         label="end of budget (hollow: target missed)")
    tradeoff.set_xlabel(f"time to training loss {advice.target:.4g} (simulated seconds)")
    tradeoff.set_ylabel("final training loss (mean of the last 20% of updates)")
    tradeoff.set_title(f"Error-runtime trade-off, P={advice.p}, {advice.fitted.best.name} "
                       f"stragglers ({advice.replay} X)", fontsize=9)
    tradeoff.legend(fontsize=7, loc="best")
    curves.axhline(advice.target, color="black", ls="--", lw=0.8, label="target")
    losses = np.concatenate([run.smoothed(advice.window) for run in runs if len(run.losses)])
    if len(losses) and np.all(losses > 0):
        curves.set_yscale("log")
    curves.set_xlabel("simulated seconds")
    curves.set_ylabel(f"training loss, mean over the last {advice.window} gradients")
    curves.set_title("every run; the recommended one thick", fontsize=9)
    curves.legend(fontsize=7, loc="upper right")
    return figure
