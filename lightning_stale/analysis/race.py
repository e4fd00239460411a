"""The report of a race: training loss against wall-clock time per contestant, a table, and
the trade-off of final loss against run time with one point per contestant.

A race (the default run of ``python -m lightning_stale.train``, see ``conf/race/default.yaml``)
fits several variants one after the other on the same data, model, learners and stragglers, to
show the paper's point: error must be judged against wall-clock time, where waiting for every
learner makes each update as slow as the slowest one (docs/method.md, "Experiments in the
paper"). Each contestant leaves a run directory (``.hydra/config.yaml`` and
``<logger>/version_N/wallclock.csv``), read with `runs.load_run`; the figure is
`plot.plot_loss` with the target loss and each contestant's arrival marked.

Definitions (as in ``benchmarks/straggler_win.py``):

* time to the target loss: the training seconds (``time/train_s``, validation excluded) of the
  first update at which the mean training loss of the last ``window`` updates is at or below
  the target;
* final loss: the mean training loss of the last ``window`` updates;
* mean staleness: the mean over updates of ``staleness/mean`` (updates between the version a
  gradient was computed at and the update that applied it; 0 for the sync family and ddp);
* train time: the training seconds of the last update, the x of the trade-off figure, whose y is
  the final loss: the error-runtime trade-off of Dutta et al. (AISTATS 2018, Figure 1), one
  point per (variant, K, H).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from lightning_stale.analysis.plot import (
    MARKERS,
    markdown_table,
    plot_loss,
    run_color,
    setting,
    time_label,
    write_table,
)
from lightning_stale.analysis.runs import Run, load_run, trailing_mean

FIGURE_NAME, TRADEOFF_NAME, TABLE_NAME = "race.png", "race_tradeoff.png", "race"


@dataclass
class RaceReport:
    """What `write_race_report` wrote: the rows, the files and the text it would print."""

    rows: list[dict[str, Any]]
    target_loss: float
    figure: Path
    tradeoff: Path
    csv: Path
    markdown: Path
    text: str


def time_to_loss(times: np.ndarray, losses: np.ndarray, target: float,
                 window: int) -> tuple[float, int | None]:
    """(training seconds, 1-based update index) of the first update whose mean loss over the
    last ``window`` updates is <= ``target``; (nan, None) if never, or with fewer updates."""
    losses = np.asarray(losses, dtype=float)
    if len(losses) < window:
        return math.nan, None
    means = trailing_mean(losses, window)[window - 1:]
    reached = np.flatnonzero(means <= target)  # NaN compares False: a NaN window never counts
    if reached.size == 0:
        return math.nan, None
    index = int(reached[0]) + window - 1
    return float(times[index]), index + 1


def final_loss(losses: np.ndarray, window: int) -> float:
    finite = np.asarray(losses, dtype=float)
    finite = finite[np.isfinite(finite)]
    return float(np.mean(finite[-window:])) if len(finite) else math.nan


def mean_staleness(run: Run) -> float:
    """Mean of ``staleness/mean`` over the updates of the run's newest wallclock.csv."""
    found = sorted(run.path.glob("*/version_*/wallclock.csv"))
    if not found:
        return math.nan
    with open(found[-1], newline="") as handle:
        values = [float(row["staleness/mean"]) for row in csv.DictReader(handle)
                  if row.get("staleness/mean") not in (None, "")]
    return float(np.mean(values)) if values else math.nan


def delay_model_text(delay: Any) -> str:
    """``ShiftedExponential(shift=0.01, mean=0.05) s`` for a delay config; ``none`` without."""
    if not delay or str(delay.get("_target_", "")).endswith("NoDelay"):
        return "none"
    params = ", ".join(f"{key}={value}" for key, value in delay.items()
                       if not str(key).startswith("_") and key != "seed")
    return f"{str(delay._target_).rsplit('.', 1)[-1]}({params}) s"


def delay_injection(run: Run) -> str:
    """How the run's engine applied the straggler delay (a table cell)."""
    if delay_model_text(run.config.get("delay")) == "none":
        return "none"
    if run.engine == "ddp":
        return "slept after backward by every rank (InjectedDelay)"
    if run.simulated:
        return "per mini-batch on the virtual clock"
    mode = run.config.engine.get("strategy", {}).get("delay_mode", "after_compute")
    if mode == "total":
        return "the mini-batch's whole time X (delay_mode=total)"
    return "added after backward by each learner"


def race_rows(runs: Sequence[Run], target: float, window: int,
              extras: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """One row per contestant, in race order; ``extras[i]`` adds columns to row i."""
    models = {delay_model_text(run.config.get("delay")) for run in runs}
    local = any(run.local_steps != 1 for run in runs)  # else no H column: one push per step
    time_key = f"time to loss {target:.3g} (s)"
    rows: list[dict[str, Any]] = []
    for index, run in enumerate(runs):
        seconds, update = time_to_loss(run.times, run.losses, target, window)
        injected = delay_injection(run)
        if len(models) > 1:  # else the model is stated once, above the table
            injected = f"{delay_model_text(run.config.get('delay'))}, {injected}"
        row: dict[str, Any] = {
            "contestant": run.label, "engine": run.engine, "delay injected": injected,
            "K of P": f"{run.k} of {run.p}", **({"H": run.local_steps} if local else {}),
            "updates": len(run.losses),
            time_key: seconds, "update at target": update if update is not None else "",
            "speed-up over row 1": math.nan, "mean staleness": mean_staleness(run),
            "final loss": final_loss(run.losses, window),
            "train time (s)": float(np.nanmax(run.times)) if len(run.times) else math.nan}
        row.update(extras[index] if index < len(extras) else {})
        rows.append(row)
    first = rows[0][time_key] if rows else math.nan
    for row in rows:
        row["speed-up over row 1"] = first / row[time_key] if row[time_key] > 0 else math.nan
    return rows


def plot_race(runs: Sequence[Run], rows: Sequence[Mapping[str, Any]], target: float,
              window: int = 20, smooth: int = 20) -> Figure:
    """`plot.plot_loss` against time, with the target loss as a dotted line, a dot where each
    contestant first reaches it, and ddp contestants dashed (their colour is the sync one's)."""
    figure = plot_loss(list(runs), "time", smooth)
    axes = figure.axes[0]
    time_key = next(key for key in rows[0] if key.startswith("time to loss"))
    curves = list(axes.get_lines())  # one per run, in order, before anything else is drawn
    axes.axhline(target, color="gray", ls=":", lw=1, label=f"target loss {target:.3g}")
    arrival: str | None = f"reaches the target (mean of the last {window} updates)"
    for run, row, line in zip(runs, rows, curves):
        if run.engine == "ddp":
            line.set_linestyle("--")
        elif run.local_steps != 1:  # apart from the same variant pushing every step
            line.set_linestyle("-.")
        if math.isfinite(row[time_key]):
            axes.plot([row[time_key]], [target], marker="o", ms=6, color=line.get_color(),
                      markeredgecolor="black", ls="none", zorder=3, label=arrival)
            arrival = None  # one legend entry for all the dots
    axes.set_title(f"The race: training loss against wall-clock time\n{setting(list(runs))}",
                   fontsize=10)
    axes.legend(fontsize=8, loc="best")
    return figure


def plot_tradeoff(runs: Sequence[Run], rows: Sequence[Mapping[str, Any]]) -> Figure:
    """Final loss against train time, one labelled point per contestant, in its curve's colour
    and marker: the contestants' places on the error-runtime trade-off."""
    figure = Figure(figsize=(7.0, 4.5), dpi=110, layout="constrained")
    axes = figure.add_subplot()
    for index, (run, row) in enumerate(zip(runs, rows)):
        x, y = row["train time (s)"], row["final loss"]
        if not (math.isfinite(x) and math.isfinite(y)):
            continue
        axes.plot([x], [y], ls="none", marker=MARKERS.get(run.variant, "o"), ms=8,
                  color=run_color(run), markeredgecolor="black", label=run.label)
        # labels alternately above and below, so that neighbouring points keep theirs apart
        axes.annotate(run.label, (x, y), xytext=(6, 5 if index % 2 == 0 else -13),
                      textcoords="offset points", fontsize=8)
    axes.set_xlabel(time_label(list(runs)))
    axes.set_ylabel("final training loss (mean of the last updates)")
    axes.set_title(f"The trade-off: final loss against run time\n{setting(list(runs))}",
                   fontsize=10)
    axes.grid(alpha=0.3)
    axes.margins(x=0.25, y=0.15)  # room for the labels
    return figure


def write_race_report(run_dirs: Sequence[str | Path], out_dir: str | Path,
                      labels: Sequence[str | None] = (), target_loss: float | None = None,
                      window: int = 20, extras: Sequence[Mapping[str, Any]] = ()) -> RaceReport:
    """Read the contestants' run directories (in race order) and write ``race.png``,
    ``race_tradeoff.png``, ``race.csv`` and ``race.md`` into ``out_dir``. ``labels[i]`` replaces run i's default label;
    ``target_loss`` None takes the highest final loss among the contestants."""
    runs = [load_run(path) for path in run_dirs]
    if not runs:
        raise ValueError("a race report needs at least one contestant's run directory")
    mixed = len({run.engine for run in runs}) > 1
    for index, run in enumerate(runs):
        label = labels[index] if index < len(labels) else None
        # Fully sync on ddp and on the server share a default label: say which engine ran it.
        run.label = label or (f"{run.label}, {run.engine}" if mixed else run.label)
    seen: dict[str, int] = {}
    for run in runs:  # a contestant entered twice still gets its own legend entry
        seen[run.label] = seen.get(run.label, 0) + 1
        if seen[run.label] > 1:
            run.label = f"{run.label} #{seen[run.label]}"
    if target_loss is None:
        target_loss = max(final_loss(run.losses, window) for run in runs)
    rows = race_rows(runs, float(target_loss), window, extras)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figure_path = out_dir / FIGURE_NAME
    plot_race(runs, rows, float(target_loss), window).savefig(figure_path)
    tradeoff_path = out_dir / TRADEOFF_NAME
    plot_tradeoff(runs, rows).savefig(tradeoff_path)
    csv_path, markdown_path = out_dir / f"{TABLE_NAME}.csv", out_dir / f"{TABLE_NAME}.md"
    write_table(rows, csv_path)
    text = _race_text(runs, rows, float(target_loss), window)
    markdown_path.write_text(f"# The race\n\n{text}\nFigures: {FIGURE_NAME}, {TRADEOFF_NAME}\n")
    return RaceReport(rows, float(target_loss), figure_path, tradeoff_path, csv_path,
                      markdown_path, text)


def _race_text(runs: Sequence[Run], rows: Sequence[Mapping[str, Any]], target: float,
               window: int) -> str:
    # setting() names the straggler model when the contestants share it; else the table does.
    clock = "simulated" if all(run.simulated for run in runs) else "wall-clock"
    lines = [f"Race on {setting(list(runs))}.",
             f"Times are {clock} training seconds (validation excluded); losses are means over "
             f"the last {window} updates.", ""]
    shown = [{key: ("not reached" if isinstance(value, float) and math.isnan(value)
                    and key.startswith(("time to", "speed-up")) else value)
              for key, value in row.items()} for row in rows]
    return "\n".join(lines) + "\n" + markdown_table(shown)
