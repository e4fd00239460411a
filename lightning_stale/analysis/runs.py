"""Reading finished runs and computing the numbers of the paper's figures.

Dutta et al., "Slow and Stale Gradients Can Win the Race" (AISTATS 2018; docs/method.md) judge the
distributed-SGD variants by training error against wall-clock time. Every run of
``python -m lightning_stale.train`` (real engine or simulated) leaves in its Hydra run directory:

* ``.hydra/config.yaml``: the composed config (variant, K, P, delay model, data, model);
* ``<logger>/version_N/wallclock.csv``: one row per server update (update, time/train_s,
  samples, train/loss, staleness, k), the curves of the figures;
* ``<logger>/version_N/metrics.csv``: Lightning's metrics, of which only ``val/loss`` is read
  (on the convex problem it is F(w) over the training set, exactly).

`find_runs` turns run or sweep directories into `Run` objects; the other functions turn runs into
the rows that `lightning_stale.plot` draws and tabulates. Definitions (also in docs/how-to/sweeps.md):

* error at convergence: the mean training loss over the last ``tail_fraction`` of the updates;
* time to converge: the training time of the first update at which the trailing mean of the loss
  (over as many updates as the tail) is within ``tolerance`` (relative) of the error at
  convergence; at the last update that mean *is* the error, so the time always exists;
* measured time per update: (t_last - t_warmup) / (updates - warmup), the estimator
  `theory.expected_iteration_time` uses for Monte Carlo, with the same default warm-up.
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_stale.config import learner_count
from lightning_stale.delays import Exponential, ShiftedExponential
from lightning_stale.method import theory
from lightning_stale.method.variants import Variant, kind_of


@dataclass
class Run:
    """One finished run: its directory, composed config and per-update log columns."""

    path: Path
    config: DictConfig
    updates: np.ndarray
    times: np.ndarray  # time/train_s: virtual seconds for the simulated engine
    losses: np.ndarray  # train/loss of each update (mean mini-batch loss of its K gradients)
    ks: np.ndarray  # the K in force at each update
    # val/loss in logging order, with the training time and update of the last update logged
    # before it (metrics.csv is written in logging order, and validation runs between updates).
    val_losses: np.ndarray = field(default_factory=lambda: np.zeros(0))
    val_times: np.ndarray = field(default_factory=lambda: np.zeros(0))
    val_updates: np.ndarray = field(default_factory=lambda: np.zeros(0))
    label: str = ""

    @property
    def variant(self) -> str:
        return str(self.config.variant.name)

    @property
    def engine(self) -> str:
        return str(self.config.engine.get("name", "?"))

    @property
    def local_steps(self) -> int:
        """H, the inner steps per push (1: a push per mini-batch; docs/how-to/local-updates.md)."""
        return int(self.config.variant.get("local_steps") or 1)

    @property
    def simulated(self) -> bool:
        return self.engine == "simulated"

    @cached_property
    def p(self) -> int:
        counted = learner_count(self.config)
        return int(counted) if counted is not None else int(max(self.ks, default=1))

    @cached_property
    def k(self) -> int:
        """The configured K (the first K for adaptive runs), with the variant's default for null."""
        return Variant.create(self.variant, self.p, self.config.variant.get("k")).k

    @property
    def adaptive(self) -> bool:
        return (self.config.engine.get("strategy", {}).get("adaptive_k") is not None
                or len(np.unique(self.ks)) > 1)

    @property
    def convex(self) -> bool:
        return str(self.config.data.get("_target_", "")).endswith("ConvexDataModule")

    @property
    def title(self) -> str:
        """The variant's name in the paper, e.g. "K-batch-sync"."""
        return kind_of(self.variant).title

    def default_label(self) -> str:
        title = self.title
        if self.adaptive:
            spec = self.config.engine.strategy.get("adaptive_k")
            interval = spec if isinstance(spec, (int, float)) else (spec or {}).get("interval_s")
            every = f", T0={interval:g} s" if interval is not None else ""
            text = f"{title}, adaptive K from {self.k}{every}"
        elif not kind_of(self.variant).k_applies:
            text = f"{title} (K={self.k})"
        else:
            text = f"{title}, K={self.k}"
            equivalent = Variant.create(self.variant, self.p, self.k).equivalent()
            if equivalent is not None:
                text += f" (= {equivalent.lower()})"
        if self.local_steps != 1:
            text += f", H={self.local_steps}"
        compensation = self.config.engine.get("strategy", {}).get("staleness_compensation")
        if compensation:
            mode = compensation if isinstance(compensation, str) else compensation.get("mode", "")
            text += f", {mode} staleness step"
        return text


# ---------------------------------------------------------------------------- reading runs
def _natural_key(path: Path) -> list:
    # Sweep jobs are 0, 1, ..., 10: sort them as numbers, not as strings.
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def _log_file(run_dir: Path, name: str) -> Path | None:
    """The newest ``<logger>/version_N/<name>`` of a run (a rerun in one dir adds a version)."""
    found = sorted(run_dir.glob(f"*/version_*/{name}"), key=_natural_key)
    return found[-1] if found else None


def _read_columns(path: Path) -> dict[str, list[str]]:
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    return {key: [row.get(key, "") for row in rows] for key in (rows[0] if rows else {})}


def _floats(values: list[str]) -> np.ndarray:
    return np.array([float(v) if v not in ("", None) else math.nan for v in values], dtype=float)


def load_run(run_dir: str | Path) -> Run:
    """Parse one run directory (``.hydra/config.yaml`` and the newest ``wallclock.csv``)."""
    run_dir = Path(run_dir)
    config_file = run_dir / ".hydra" / "config.yaml"
    wallclock = _log_file(run_dir, "wallclock.csv")
    if not config_file.is_file() or wallclock is None:
        raise FileNotFoundError(f"{run_dir} is not a finished run: it needs .hydra/config.yaml and "
                                "<logger>/version_N/wallclock.csv (logger=none writes no logs)")
    columns = _read_columns(wallclock)
    metrics = wallclock.with_name("metrics.csv")
    config = OmegaConf.load(config_file)
    if not isinstance(config, DictConfig):
        raise ValueError(f"{config_file} holds a list, not a run's config (a mapping)")
    run = Run(path=run_dir, config=config,
              updates=_floats(columns["update"]), times=_floats(columns["time/train_s"]),
              losses=_floats(columns["train/loss"]), ks=_floats(columns["k"]))
    if metrics.is_file():
        run.val_losses, run.val_times, run.val_updates = _validations(_read_columns(metrics))
    run.label = run.default_label()
    return run


def _validations(metrics: dict[str, list[str]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    found: list[tuple[float, float, float]] = []
    time_s, update = 0.0, 0.0
    for row in zip(*(metrics.get(key, []) for key in ("val/loss", "time/train_s", "update"))):
        if row[1] and row[2]:
            time_s, update = float(row[1]), float(row[2])
        if row[0] and math.isfinite(float(row[0])):
            found.append((float(row[0]), time_s, update))
    values = np.array(found, dtype=float).reshape(-1, 3)
    return values[:, 0], values[:, 1], values[:, 2]


def find_runs(paths: list[str | Path]) -> list[Run]:
    """Runs under each path: a run directory itself, or every run found below it (a Hydra sweep
    directory holds one run per job). Directories without logs are skipped; labels made unique."""
    run_dirs: list[Path] = []
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"no such run or sweep directory: {path}")
        if (path / ".hydra" / "config.yaml").is_file():
            candidates = [path]
        else:
            candidates = sorted((c.parent.parent for c in path.rglob(".hydra/config.yaml")),
                                key=_natural_key)
        run_dirs += [c for c in candidates if _log_file(c, "wallclock.csv") is not None]
    runs = [load_run(run_dir) for run_dir in dict.fromkeys(run_dirs)]
    seen: dict[str, int] = {}
    for run in runs:
        seen[run.label] = seen.get(run.label, 0) + 1
    for run in runs:
        if seen[run.label] > 1:
            run.label = f"{run.label} [{run.path.name}]"
    return runs


# ---------------------------------------------------------------------------- trade-off
def _finite(times: np.ndarray, losses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    keep = np.isfinite(times) & np.isfinite(losses)
    return times[keep], losses[keep]


def tail_count(n: int, tail_fraction: float) -> int:
    if not 0 < tail_fraction <= 1:
        raise ValueError(f"tail_fraction must be in (0, 1], got {tail_fraction}")
    return max(1, math.ceil(tail_fraction * n))


def trailing_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Mean of the last ``window`` values at each index (fewer at the start)."""
    sums = np.concatenate([[0.0], np.cumsum(values)])
    index = np.arange(1, len(values) + 1)
    start = np.maximum(index - window, 0)
    return (sums[index] - sums[start]) / (index - start)


def smoothed(values: np.ndarray, smooth: int) -> np.ndarray:
    """Centred running mean for display, over the updates within max(smooth / 2, 25% of the
    update's index) on either side: little smoothing early, where the loss falls fast, and more
    later, where mini-batch noise would hide the floor."""
    n = len(values)
    sums = np.concatenate([[0.0], np.cumsum(np.nan_to_num(values))])
    counts = np.concatenate([[0], np.cumsum(np.isfinite(values))])
    index = np.arange(n)
    half = np.maximum(smooth // 2, (0.25 * index).astype(int))
    low, high = np.maximum(index - half, 0), np.minimum(index + half + 1, n)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (sums[high] - sums[low]) / (counts[high] - counts[low])


def error_at_convergence(losses: np.ndarray, tail_fraction: float = 0.2) -> float:
    """Mean training loss over the last ``tail_fraction`` of the updates."""
    losses = losses[np.isfinite(losses)]
    if len(losses) == 0:
        return math.nan
    return float(np.mean(losses[-tail_count(len(losses), tail_fraction):]))


def time_to_converge(times: np.ndarray, losses: np.ndarray, tail_fraction: float = 0.2,
                     tolerance: float = 0.1) -> float:
    """Training seconds until the trailing mean loss is within ``tolerance`` of the final error."""
    times, losses = _finite(times, losses)
    if len(losses) == 0:
        return math.nan
    smoothed = trailing_mean(losses, tail_count(len(losses), tail_fraction))
    target = smoothed[-1] + tolerance * abs(smoothed[-1])
    # The small slack keeps the last update (smoothed == final error) from missing by rounding.
    first = int(np.argmax(smoothed <= target + 1e-12 * max(1.0, abs(target))))
    return float(times[first])


def tradeoff_rows(runs: list[Run], tail_fraction: float = 0.2,
                  tolerance: float = 0.1) -> list[dict]:
    """One point per run for the error-runtime trade-off (Dutta et al. 2018, "spanning the
    spectrum"): error at convergence against time to converge."""
    return [{"run": run.label, "variant": run.variant, "P": run.p, "K": run.k,
             "updates": len(run.losses), "total_time_s": float(np.nanmax(run.times)),
             "time_to_converge_s": time_to_converge(run.times, run.losses, tail_fraction,
                                                    tolerance),
             "error_at_convergence": error_at_convergence(run.losses, tail_fraction)}
            for run in runs if len(run.losses)]


# ---------------------------------------------------------------------------- E[T]
def measured_update_time(times: np.ndarray, p: int, warmup: int | None = None) -> float:
    """Mean seconds per update after the warm-up (default max(5 P, n / 20), at most n / 2, as
    `theory.expected_iteration_time` discards: runs start with all learners in phase)."""
    times = times[np.isfinite(times)]
    n = len(times)
    if n < 2:
        return math.nan
    warmup = min(max(5 * p, n // 20), n // 2) if warmup is None else warmup
    start = times[warmup - 1] if warmup > 0 else 0.0
    return float((times[-1] - start) / (n - warmup))


def delay_model(config: DictConfig):
    """The run's straggler model with the engine's constant ``compute_time`` folded in as a
    shift (only the exponential family can take it), or None when theory cannot say."""
    delay = instantiate(config.delay) if config.get("delay") else None
    compute = float(config.engine.get("strategy", {}).get("compute_time", 0.0) or 0.0)
    if compute == 0 or delay is None:
        return delay
    if isinstance(delay, (Exponential, ShiftedExponential)):
        mean = getattr(delay, "exponential_mean", None) or delay.mean
        return ShiftedExponential(delay.shift + compute, mean, seed=delay.seed)
    return None


def theory_rows(runs: list[Run], updates: int = 20000) -> list[dict]:
    """Measured mean time per update beside E[T] from `theory.expected_iteration_time` (closed
    form where docs/method.md has one, Monte Carlo on the event simulation otherwise). Adaptive-K runs
    are left out: their K, and so E[T], changes during the run."""
    rows, cache = [], {}
    for run in runs:
        if run.adaptive or len(run.times) < 2:
            continue
        delay = delay_model(run.config)
        key = (run.variant, run.p, run.k, repr(delay))
        if key not in cache:
            cache[key] = _theory(run, delay, updates)
        expected, method = cache[key]
        measured = measured_update_time(run.times, run.p)
        rows.append({"run": run.label, "variant": run.variant, "P": run.p, "K": run.k,
                     "engine": run.engine, "delay": repr(delay), "updates": len(run.times),
                     "measured_s": measured, "theory_s": expected, "method": method,
                     "measured_over_theory": measured / expected if expected > 0 else math.nan})
    return rows


def _theory(run: Run, delay, updates: int) -> tuple[float, str]:
    if delay is None or not callable(getattr(delay, "sample", None)) or delay.mean == 0:
        return math.nan, "n/a (no delay model)"
    variant = Variant.create(run.variant, run.p, run.k)
    try:
        return theory.expected_iteration_time(variant, delay=delay, method="closed_form"), \
            "closed form"
    except ValueError:
        pass
    try:
        value = theory.expected_iteration_time(variant, delay=delay, method="monte_carlo",
                                               updates=updates)
    except Exception as error:  # e.g. a recorded trace too short for the simulation
        return math.nan, f"n/a ({error})"
    return value, f"Monte Carlo ({updates} updates)"


# ---------------------------------------------------------------------------- convex floor
_PROBLEMS: dict[str, object] = {}


def convex_problem(run: Run):
    """The run's ConvexDataModule (generated from its seed, so identical to the run's), cached."""
    key = OmegaConf.to_yaml(run.config.data)
    if key not in _PROBLEMS:
        _PROBLEMS[key] = instantiate(run.config.data)
    return _PROBLEMS[key]


def floor_rows(runs: list[Run], tail_fraction: float = 0.5, min_validations: int = 3) -> list[dict]:
    """Error floor E[F(w)] - F* of sync-family runs on the convex problem beside the bound
    eta L sigma^2 / (2 c K m) of Dutta et al. 2018 (docs/method.md, "Error after J iterations").

    F(w) is ``val/loss`` (ConvexDataModule validates on the training set, so it is F exactly)
    averaged over the last ``tail_fraction`` of the validations. Runs with fewer than
    ``min_validations`` are left out: mini-batch training losses scatter about ten times more
    than the floors of the convex recipes, too much to measure a floor from.
    """
    rows = []
    for run in runs:
        if (not run.convex or run.adaptive or not kind_of(run.variant).synchronous
                or len(run.val_losses) < min_validations):
            continue
        data = convex_problem(run)
        count = tail_count(len(run.val_losses), tail_fraction)
        tail = run.val_losses[-count:]
        lr, batch = float(run.config.model.lr), int(run.config.data.batch_size)
        try:
            bound = theory.sync_error_floor(lr, data.smoothness, data.strong_convexity,
                                            data.gradient_variance(), run.k, batch)
        except ValueError:  # eta L > 1: outside the bound's step-size condition
            bound = math.nan
        floor = float(np.mean(tail)) - data.optimal_loss
        rows.append({"run": run.label, "variant": run.variant, "K": run.k, "lr": lr,
                     "batch_size": batch, "validations_averaged": count,
                     "measured_floor": floor,
                     "standard_error": float(np.std(tail) / math.sqrt(count)),
                     "bound": bound, "measured_over_bound": floor / bound})
    return rows


def k_changes(run: Run) -> list[tuple[float, int]]:
    """(training seconds, K) at the first update and wherever K changed."""
    changes, last = [], None
    for time_s, k in zip(run.times, run.ks):
        if np.isfinite(k) and k != last:
            changes.append((float(time_s), int(k)))
            last = k
    return changes


def loss_rows(runs: list[Run], tail_fraction: float = 0.2) -> list[dict]:
    """Per curve: its length in updates and seconds, its error at convergence and, on the
    convex problem, F* and the last gap F(w) - F* seen by validation."""
    rows = tradeoff_rows(runs, tail_fraction)
    for run, row in zip([run for run in runs if len(run.losses)], rows):
        del row["time_to_converge_s"]
        if run.convex:
            optimum = convex_problem(run).optimal_loss
            row["optimal_loss"] = optimum
            row["last_val_gap"] = (float(run.val_losses[-1] - optimum) if len(run.val_losses)
                                   else math.nan)
    return rows


def adaptive_rows(runs: list[Run]) -> list[dict]:
    return [{"run": run.label, "time_s": time_s, "K": k}
            for run in runs if run.adaptive for time_s, k in k_changes(run)]
