"""``python -m lightning_stale.plot``: the figures command (kept at this path for the command line
and for configs naming ``lightning_stale.plot.PlotOnMultirunEnd``); see `lightning_stale.analysis.plot`."""

from lightning_stale.analysis.plot import PlotOnMultirunEnd, main, make_figures

__all__ = ["PlotOnMultirunEnd", "main", "make_figures"]

if __name__ == "__main__":
    raise SystemExit(main())
