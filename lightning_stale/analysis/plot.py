"""Figures of Dutta et al., "Slow and Stale Gradients Can Win the Race" (AISTATS 2018), from runs.

    python -m lightning_stale.plot RUN_OR_SWEEP_DIR [...] --out DIR    (script lightning-stale-plot)

Writes PNGs, one CSV per figure with the numbers it shows, and ``summary.md`` with all tables:

* ``loss_vs_time.png`` / ``loss_vs_updates.png``: training loss against training time (virtual
  seconds for simulated runs) and against server updates; the paper's main comparison.
* ``tradeoff.png``: error at convergence against time to converge, one point per run (the
  paper's error-runtime trade-off; definitions in `lightning_stale.analysis.runs`).
* ``theory_vs_measurement.png``: measured mean time per update beside E[T] from
  `lightning_stale.method.theory` (the paper's runtime analysis).
* ``error_floor.png`` (convex sync-family runs): error floor against K beside the bound
  eta L sigma^2 / (2 c K m), which falls as 1/K.
* ``adaptive_k.png`` (adaptive-K runs): loss and K against time (AdaSync, Dutta et al. 2020).

`PlotOnMultirunEnd` is a Hydra callback that does the same for a sweep when it ends.
The plotting functions take parsed runs (`experiments.find_runs`) and return figures.
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, never a display; before anything imports pyplot
import numpy as np
from hydra.experimental.callback import Callback
from matplotlib.figure import Figure
from omegaconf import DictConfig

from lightning_stale.analysis.runs import (
    Run,
    adaptive_rows,
    convex_problem,
    find_runs,
    floor_rows,
    loss_rows,
    smoothed,
    theory_rows,
    tradeoff_rows,
)
from lightning_stale.method.variants import kind_of

log = logging.getLogger(__name__)
FIGURES = ("loss_vs_time", "loss_vs_updates", "tradeoff", "theory_vs_measurement", "error_floor",
           "adaptive_k")
# One colour family per variant; darker = larger K.
COLORMAPS = {"sync": "Greys", "k_sync": "Blues", "k_batch_sync": "Greens", "async": "Oranges",
             "k_async": "Reds", "k_batch_async": "Purples"}
# Where each variant's "K=..." label sits next to its point, so that close points stay legible.
LABEL_OFFSETS = {"k_sync": (6, 4), "k_batch_sync": (6, -10), "k_async": (-26, 4),
                 "k_batch_async": (-26, -10)}
MARKERS = {"sync": "s", "k_sync": "o", "k_batch_sync": "D", "async": "*", "k_async": "^",
           "k_batch_async": "v"}


def run_color(run: Run) -> Any:
    if run.adaptive:
        return "tab:olive"  # apart from the fixed-K families it is compared with
    shade = 0.45 + 0.5 * (run.k / max(run.p, 1))
    return matplotlib.colormaps[COLORMAPS.get(run.variant, "Greys")](min(shade, 0.95))


def time_label(runs: list[Run]) -> str:
    simulated = {run.simulated for run in runs}
    if simulated == {True}:
        return "training time (simulated seconds)"
    if simulated == {False}:
        return "training time (wall-clock seconds, validation excluded)"
    return "training time (seconds: simulated or wall-clock)"


def setting(runs: list[Run]) -> str:
    """What the runs share (data, model, P, delay), for figure titles."""
    def short(node: Any) -> str:
        return str(node.get("_target_", "none")).rsplit(".", 1)[-1] if node else "none"

    parts = []
    for describe in (lambda r: short(r.config.data).replace("DataModule", ""),
                     lambda r: short(r.config.model.get("net") or r.config.model),
                     lambda r: f"P={r.p}",
                     lambda r: _delay_text(r.config.get("delay"))):
        values = {describe(run) for run in runs}
        if len(values) == 1:
            parts.append(values.pop())
    return ", ".join(parts)


def _delay_text(delay: Any) -> str:
    if not delay:
        return "no delay"
    params = ", ".join(f"{key}={value}" for key, value in delay.items()
                       if not str(key).startswith("_") and key != "seed")
    return f"{str(delay._target_).rsplit('.', 1)[-1]}({params}) s delays"


def _new_figure(width: float = 8.0, height: float = 5.0) -> tuple[Figure, Any]:
    figure = Figure(figsize=(width, height), dpi=110, layout="constrained")
    return figure, figure.add_subplot()


def _legend(axes: Any, count: int) -> None:
    axes.legend(fontsize=7 if count > 8 else 8, ncol=2 if count > 8 else 1, loc="best")


# ---------------------------------------------------------------------------- figures
def plot_loss(runs: list[Run], x: str = "time", smooth: int = 20) -> Figure:
    """Training loss against training time (``x="time"``) or server updates (``"updates"``).

    On the convex problem, when every run has at least `MIN_VALIDATIONS`, the curve is the gap
    F(w) - F* on a log scale, F exact from the validations (ConvexDataModule validates on the
    training set), so that the error floors stay visible; mini-batch losses are too noisy for
    that (their spread is about ten times the floors of the convex recipes)."""
    figure, axes = _new_figure()
    mode = curve_mode(runs)
    for run in runs:
        xs, ys = loss_curve(run, smooth, mode, x)
        axes.plot(xs, ys, color=run_color(run), lw=1.3, marker=MARKERS.get(run.variant),
                  markevery=0.1, ms=4, label=run.label)
    _loss_axes(axes, runs, smooth, mode)
    axes.set_xlabel(time_label(runs) if x == "time" else "server updates")
    against = "wall-clock time" if x == "time" else "updates"
    axes.set_title(f"Training loss against {against}\n{setting(runs)}", fontsize=10)
    _legend(axes, len(runs))
    return figure


MIN_VALIDATIONS = 10


def curve_mode(runs: list[Run]) -> str:
    """"exact_gap" (val/loss - F*) for convex runs that all validated often enough, else "loss"
    (smoothed training loss)."""
    if runs and all(run.convex and len(run.val_losses) >= MIN_VALIDATIONS for run in runs):
        return "exact_gap"
    return "loss"


def loss_curve(run: Run, smooth: int, mode: str, x: str = "time") -> tuple[np.ndarray, np.ndarray]:
    """(x values, y values) of one run's curve in ``mode`` (see `curve_mode`)."""
    if mode == "exact_gap":
        xs = run.val_times if x == "time" else run.val_updates
        # F(w) itself fluctuates at the floor: average the later validations, not the first.
        return xs, smoothed(run.val_losses, 1) - convex_problem(run).optimal_loss
    return (run.times if x == "time" else run.updates), smoothed(run.losses, smooth)


def _loss_axes(axes: Any, runs: list[Run], smooth: int, mode: str) -> None:
    losses = np.concatenate([run.losses[np.isfinite(run.losses)] for run in runs] or [[1.0]])
    if mode != "loss" or (losses.min() > 0 and losses.max() / losses.min() > 10):
        axes.set_yscale("log")  # classification losses and convex gaps span decades
    running = f"running mean over ±max({smooth // 2}, 25%) of the updates"
    axes.set_ylabel({"loss": f"training loss\n({running})",
                     "exact_gap": "F(w) - F*, F exact at the validations\n(running mean over "
                                  "±25% of the validations)"}[mode])
    axes.grid(alpha=0.3)


def plot_tradeoff(runs: list[Run], tail_fraction: float = 0.2, tolerance: float = 0.1) -> Figure:
    """Error at convergence against time to converge, one point per run, labelled by K."""
    rows = tradeoff_rows(runs, tail_fraction, tolerance)
    figure, axes = _new_figure()
    shown: set[str] = set()
    annotated: set[tuple] = set()
    for run, row in zip([run for run in runs if len(run.losses)], rows):
        name = run.title
        axes.scatter(row["time_to_converge_s"], row["error_at_convergence"], s=60,
                     color=run_color(run), marker=MARKERS.get(run.variant, "o"),
                     edgecolors="black", linewidths=0.5,
                     label=None if name in shown else name)
        shown.add(name)
        point = (row["time_to_converge_s"], row["error_at_convergence"])
        if point not in annotated:  # equivalent variants (K-sync K=P = sync, ...) coincide
            annotated.add(point)
            axes.annotate(f"K={run.k}" + ("*" if run.adaptive else ""), point, fontsize=7,
                          textcoords="offset points", xytext=LABEL_OFFSETS.get(run.variant, (5, 4)))
    times = [row["time_to_converge_s"] for row in rows if row["time_to_converge_s"] > 0]
    if times and max(times) / min(times) > 10:
        axes.set_xscale("log")
    axes.set_xlabel(f"time to converge: {time_label(runs)}\n(first time the trailing mean loss is "
                    f"within {tolerance:.0%} of the error at convergence)", fontsize=9)
    axes.set_ylabel(f"error at convergence\n(mean training loss, last {tail_fraction:.0%} "
                    "of updates)")
    note = " (K* = adaptive, its first K)" if any(run.adaptive for run in runs) else ""
    axes.set_title(f"Error-runtime trade-off, one point per run{note}\n{setting(runs)}",
                   fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    return figure


def plot_theory(runs: list[Run], updates: int = 20000,
                rows: list[dict] | None = None) -> Figure | None:
    """Measured mean time per update beside the theoretical E[T], one pair of bars per run
    (``rows``: `theory_rows` already computed). None when no run has a fixed K."""
    rows = theory_rows(runs, updates) if rows is None else rows
    if not rows:
        return None
    figure, axes = _new_figure(8.0, max(3.0, 0.5 * len(rows) + 1.5))
    positions = np.arange(len(rows))[::-1]
    closed = np.array([row["method"] == "closed form" for row in rows], dtype=bool)
    theory = np.array([row["theory_s"] for row in rows], dtype=float)
    measured = np.array([row["measured_s"] for row in rows], dtype=float)
    for mask, name, hatch in ((closed, "closed form", None), (~closed, "Monte Carlo", "//")):
        if mask.any():
            axes.barh(positions[mask] + 0.2, theory[mask], height=0.4, color="#bbbbbb",
                      hatch=hatch, edgecolor="black", lw=0.5, label=f"theory E[T] ({name})")
    axes.barh(positions - 0.2, measured, height=0.4, color="tab:blue", label="measured")
    for position, row in zip(positions, rows):
        ratio = row["measured_over_theory"]
        if math.isfinite(ratio):
            axes.annotate(f"{ratio:.2f}x", (max(row["measured_s"], row["theory_s"]), position),
                          textcoords="offset points", xytext=(4, -3), fontsize=7)
    axes.set_yticks(positions, [row["run"] for row in rows], fontsize=8)
    unit = "simulated seconds" if all(run.simulated for run in runs) else "seconds"
    axes.set_xlabel(f"mean time per server update ({unit}); label: measured / theory")
    axes.set_title(f"Time per update: measurement against theory\n{setting(runs)}", fontsize=10)
    finite = [value for value in np.concatenate([theory, measured]) if math.isfinite(value)]
    axes.set_xlim(0, 1.12 * max(finite, default=1.0))  # room for the ratio labels
    axes.grid(axis="x", alpha=0.3)
    figure.legend(fontsize=8, loc="outside lower center", ncol=3)
    return figure


def plot_error_floor(runs: list[Run], tail_fraction: float = 0.5) -> Figure | None:
    """Measured error floor against K beside the 1/K bound (convex sync-family runs)."""
    rows = floor_rows(runs, tail_fraction)
    if not rows:
        return None
    figure, axes = _new_figure(7.0, 4.8)
    for variant in dict.fromkeys(row["variant"] for row in rows):
        mine = sorted((row for row in rows if row["variant"] == variant), key=lambda r: r["K"])
        ks = np.array([row["K"] for row in mine], dtype=float)
        title = kind_of(variant).title
        axes.errorbar(ks, [row["measured_floor"] for row in mine],
                      yerr=[row["standard_error"] for row in mine], marker=MARKERS.get(variant),
                      capsize=3, label=f"{title}: measured E[F(w)] - F*")
        axes.plot(ks, [row["bound"] for row in mine], ls="--", marker=".",
                  label=f"{title}: bound eta L sigma^2 / (2 c K m)")
        if ks[0] == 1:
            axes.plot(ks, mine[0]["measured_floor"] / ks, ls=":", color="gray",
                      label=f"{title}: measured K=1 floor / K")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xticks(sorted({row["K"] for row in rows}), [str(k) for k in
                                                        sorted({row["K"] for row in rows})])
    axes.set_xlabel("K (gradients averaged per update)")
    axes.set_ylabel("error floor E[F(w)] - F* (units of F)")
    axes.set_title(f"Error floor against K on the strongly convex problem\n{setting(runs)}\n"
                   f"(measured: mean F(w) - F* over the last {tail_fraction:.0%} of the run)",
                   fontsize=10)
    axes.grid(alpha=0.3, which="both")
    axes.legend(fontsize=8)
    return figure


def plot_adaptive_k(runs: list[Run], smooth: int = 20) -> Figure | None:
    """Loss against time for every run, and K against time for the adaptive ones."""
    adaptive = [run for run in runs if run.adaptive]
    if not adaptive:
        return None
    figure = Figure(figsize=(8.0, 6.5), dpi=110, layout="constrained")
    top, bottom = figure.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    mode = curve_mode(runs)
    for run in runs:
        top.plot(*loss_curve(run, smooth, mode), color=run_color(run),
                 lw=2.0 if run.adaptive else 1.2, ls="-" if run.adaptive else "--",
                 label=run.label)
    _loss_axes(top, runs, smooth, mode)
    _legend(top, len(runs))
    top.set_title(f"Adaptive K (AdaSync) against fixed K\n{setting(runs)}", fontsize=10)
    for run in adaptive:
        bottom.step(run.times, run.ks, where="post", color=run_color(run), label=run.label)
    bottom.set_ylabel("K in force")
    bottom.set_xlabel(time_label(runs))
    bottom.set_yticks(range(1, max(run.p for run in adaptive) + 1))
    bottom.grid(alpha=0.3)
    return figure


# ---------------------------------------------------------------------------- tables and files
def write_table(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else ["run"])
        writer.writeheader()
        writer.writerows(rows)


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)\n"
    def show(value: Any) -> str:
        return f"{value:.4g}" if isinstance(value, float) else str(value)
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(show(row[key]) for key in header) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def make_figures(runs: list[Run], out_dir: str | Path, *, smooth: int = 20,
                 tail_fraction: float = 0.2, tolerance: float = 0.1,
                 floor_tail_fraction: float = 0.5, theory_updates: int = 20000) -> list[Path]:
    """Write every figure that applies to ``runs`` into ``out_dir``, each with a CSV of its
    numbers, and ``summary.md``; returns the PNG paths."""
    if not runs:
        raise ValueError("no runs to plot (a run needs .hydra/config.yaml and a wallclock.csv)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    loss_table = loss_rows(runs, tail_fraction)
    # (figure name, figure, table name, rows): both loss figures show the loss_curves numbers.
    jobs = [
        ("loss_vs_time", plot_loss(runs, "time", smooth), "loss_curves", loss_table),
        ("loss_vs_updates", plot_loss(runs, "updates", smooth), "loss_curves", loss_table),
        ("tradeoff", plot_tradeoff(runs, tail_fraction, tolerance), "tradeoff",
         tradeoff_rows(runs, tail_fraction, tolerance)),
    ]
    times = theory_rows(runs, theory_updates)
    theory = plot_theory(runs, rows=times) if times else None
    if theory is not None:
        jobs.append(("theory_vs_measurement", theory, "theory_vs_measurement", times))
    floor = plot_error_floor(runs, floor_tail_fraction)
    if floor is not None:
        jobs.append(("error_floor", floor, "error_floor", floor_rows(runs, floor_tail_fraction)))
    adaptive = plot_adaptive_k(runs, smooth)
    if adaptive is not None:
        jobs.append(("adaptive_k", adaptive, "adaptive_k", adaptive_rows(runs)))

    for name in FIGURES:  # a figure that no longer applies must not be left from an earlier call
        for stale in (out_dir / f"{name}.png", out_dir / f"{name}.csv"):
            stale.unlink(missing_ok=True)
    (out_dir / "loss_curves.csv").unlink(missing_ok=True)
    written, summary = [], [f"# Figures for {len(runs)} runs\n"]
    tables: dict[str, str] = {}
    for name, figure, table, rows in jobs:
        figure.savefig(out_dir / f"{name}.png")
        written.append(out_dir / f"{name}.png")
        if table in tables:
            summary.append(f"\n## {name}.png\n\nNumbers as for {tables[table]}.png.\n")
            continue
        tables[table] = name
        write_table(rows, out_dir / f"{table}.csv")
        summary += [f"\n## {name}.png ({table}.csv)\n\n", markdown_table(rows)]
    (out_dir / "summary.md").write_text("".join(summary))
    return written


# ---------------------------------------------------------------------------- entry points
class PlotOnMultirunEnd(Callback):
    """Hydra callback: figures for the whole sweep when a multirun ends, in
    ``<sweep dir>/<subdir>``. Config: ``hydra.callbacks.plot._target_:
    lightning_stale.plot.PlotOnMultirunEnd`` (keyword arguments go to `make_figures`)."""

    def __init__(self, subdir: str = "figures", **options: Any) -> None:
        self.subdir = subdir
        self.options = options
        self.sweep_dir: str | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Resolve ${now:...} once, at the start, so the end looks in the folder the jobs used.
        self.sweep_dir = str(config.hydra.sweep.dir)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(self.sweep_dir or str(config.hydra.sweep.dir))
        try:
            paths = make_figures(find_runs([sweep_dir]), sweep_dir / self.subdir, **self.options)
        except Exception:
            log.error("plotting the sweep failed; rerun: python -m lightning_stale.plot %s",
                      sweep_dir)
            raise
        log.info("figures: %s", ", ".join(str(path) for path in paths))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_stale.plot",
        description="Figures of Dutta et al. (AISTATS 2018) from lightning_stale runs.")
    parser.add_argument("paths", nargs="+", help="run directories or Hydra sweep directories")
    parser.add_argument("--out", help="output folder (default: <first path>/figures)")
    parser.add_argument("--smooth", type=int, default=20,
                        help="loss curves: running mean over at least this many updates, "
                             "widening to +-25%% of the update's index (default 20)")
    parser.add_argument("--tail-fraction", type=float, default=0.2,
                        help="error at convergence: mean loss over this last fraction of updates")
    parser.add_argument("--tolerance", type=float, default=0.1,
                        help="time to converge: relative tolerance around that error")
    parser.add_argument("--floor-tail-fraction", type=float, default=0.5,
                        help="error floor (convex runs): last fraction of the run averaged")
    parser.add_argument("--theory-updates", type=int, default=20000,
                        help="simulated updates for Monte Carlo E[T] where no closed form exists")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else Path(args.paths[0]) / "figures"
    runs = find_runs(args.paths)
    paths = make_figures(runs, out, smooth=args.smooth, tail_fraction=args.tail_fraction,
                         tolerance=args.tolerance, floor_tail_fraction=args.floor_tail_fraction,
                         theory_updates=args.theory_updates)
    print(f"{len(runs)} runs; wrote {', '.join(str(path) for path in paths)} "
          f"(numbers in {out / 'summary.md'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
