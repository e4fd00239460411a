"""Short simulated runs of many (variant, K) with one straggler model: the advisor's sweeps.

Every run trains the same model on the same data with `SimulatedStaleStrategy` (P learners on a
virtual clock in one process: deterministic, no process start-up) for the same budget of
*virtual* seconds, so that the variants are compared as docs/method.md asks, by error against
wall-clock time (Dutta et al., AISTATS 2018), not against iterations. The learners run without
epoch-end flushes, the stationary process of the runtime analysis ("Expected time per iteration").

Definitions (also in docs/how-to/advisor.md):

* the *smoothed loss* at an update: the mean mini-batch loss over the gradients of the latest
  updates that together hold at least ``window`` gradients (an update of K gradients weighs K),
  so that variants applying one gradient per update are not favoured by their noisier curve;
* the *time to a target* loss: the virtual time of the first update whose smoothed loss is at or
  below the target (NaN when the budget ends first);
* the *final error*: the mean training loss of the last 20% of the updates
  (`runs.error_at_convergence`, as in the trade-off figures).
"""

from __future__ import annotations

import copy
import logging
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from pytorch_lightning import Callback, Trainer, seed_everything
from pytorch_lightning.strategies import Strategy

from lightning_stale.analysis.runs import error_at_convergence
from lightning_stale.method.variants import VARIANT_NAMES, Variant
from lightning_stale.strategies.callbacks import WallClockLogger
from lightning_stale.strategies.simulated import SimulatedStaleStrategy

K_VARIANTS = ("k_sync", "k_batch_sync", "k_async", "k_batch_async")



def configurations(p: int, ks: Sequence[int] | None = None,
                   variants: Sequence[str] = VARIANT_NAMES,
                   distinct: bool = True) -> list[tuple[str, int]]:
    """(variant, K) pairs for P learners: sync (K = P), async (K = 1) and each K-variant with
    every K in `ks` (default 1..P). With `distinct`, configurations that are the same process
    as an earlier one (see `same_as`) are left out."""
    chosen: list[tuple[str, int]] = []
    for name in variants:
        if name == "sync":
            candidates = [p]
        elif name == "async":
            candidates = [1]
        else:
            candidates = sorted(set(range(1, p + 1) if ks is None else ks))
        for k in candidates:
            Variant.create(name, p, k)  # a clear error for a K that does not fit P
            if (name, k) not in chosen:
                chosen.append((name, k))
    if distinct:
        chosen = [c for c in chosen if same_as(*c, p) == c or same_as(*c, p) not in chosen]
    return chosen


def same_as(name: str, k: int, p: int) -> tuple[str, int]:
    """The simplest configuration that runs the same process as (name, k) with P learners
    (docs/method.md, "The six variants": Fully sync = K-sync with K = P, Async = K-async with
    K = 1 = K-batch-async with K = 1; K-async with K = P and K-batch-sync with K = 1 restart
    every learner at every update, as K-sync does)."""
    if p == 1:
        return "sync", 1  # one learner: every variant is plain SGD
    if name in ("k_sync", "k_async") and k == p:
        return "sync", p
    if name in ("k_async", "k_batch_async") and k == 1:
        return "async", 1
    if name == "k_batch_sync" and k == 1:
        return same_as("k_sync", 1, p)
    return name, k


@dataclass
class SweepRun:
    """One finished run: its configuration and its per-update curve."""

    variant: str
    k: int
    times: np.ndarray  # virtual seconds of each update
    losses: np.ndarray  # mean mini-batch loss of each update
    gradients: np.ndarray  # gradients applied by each update (its K)
    pushes: int
    wall_s: float
    adaptive: bool = False
    k_history: list = field(default_factory=list)

    @property
    def label(self) -> str:
        if self.adaptive:
            return f"{self.variant} AdaSync from K={self.k}"
        return f"{self.variant} K={self.k}"

    def smoothed(self, window: int) -> np.ndarray:
        """The smoothed loss at each update (module docstring)."""
        weights = np.concatenate([[0.0], np.cumsum(self.gradients)])
        sums = np.concatenate([[0.0], np.cumsum(self.gradients * self.losses)])
        ends = np.arange(1, len(self.losses) + 1)
        # the latest start whose updates hold at least `window` gradients (all of them if fewer)
        starts = np.searchsorted(weights, weights[ends] - window, side="right") - 1
        starts = np.clip(starts, 0, None)
        return (sums[ends] - sums[starts]) / (weights[ends] - weights[starts])

    def time_to(self, target: float, window: int) -> float:
        """Virtual seconds until the smoothed loss reaches `target` (NaN if it never does)."""
        below = np.flatnonzero(self.smoothed(window) <= target)
        return float(self.times[below[0]]) if len(below) else math.nan

    @property
    def final_error(self) -> float:
        return error_at_convergence(self.losses)


class _StopAtVirtualTime(Callback):
    """Stops the fit once the latest update's virtual time reaches the budget."""

    def __init__(self, clock: WallClockLogger, budget_s: float) -> None:
        self.clock, self.budget_s = clock, budget_s

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if self.clock.rows and self.clock.rows[-1]["time/train_s"] >= self.budget_s:
            trainer.should_stop = True


@dataclass
class Sweep:
    """What every run of a sweep shares.

    Args:
        config: a composed app config (`lightning_stale.config.compose_config`); its ``data``,
            ``model`` and ``seed`` are used.
        p: the number of simulated learners.
        delay: the straggler model replayed (each run gets a fresh copy, reset at its start).
        budget_s: virtual seconds per run.
        max_updates: a safety cap on server updates per run.
        progress: called with one line per finished run (None: silent).
    """

    config: DictConfig
    p: int
    delay: Any
    budget_s: float
    max_updates: int = 20000
    progress: Callable[[str], None] | None = print

    def __post_init__(self) -> None:
        if isinstance(self.p, bool) or not isinstance(self.p, int) or self.p < 1:
            raise ValueError(f"the number of learners p must be an integer >= 1, got {self.p!r}")
        if not (self.budget_s > 0 and math.isfinite(self.budget_s)):
            raise ValueError(f"budget_s must be a finite number of seconds > 0, "
                             f"got {self.budget_s!r}")

    def run(self, variant: str, k: int, adaptive_k: Any = None) -> SweepRun:
        """Train once for `budget_s` virtual seconds and return the curve."""
        started = time.perf_counter()
        clock = WallClockLogger()
        with _quiet():
            seed_everything(int(self.config.seed), verbose=False)
            datamodule = instantiate(self.config.data)
            model = instantiate(self.config.model, input_shape=datamodule.input_shape,
                                num_classes=datamodule.num_classes)
            strategy = SimulatedStaleStrategy(variant, None if adaptive_k else k,
                                              delay=copy.deepcopy(self.delay),
                                              num_learners=self.p, adaptive_k=adaptive_k,
                                              seed=int(self.config.seed))
            # The public class builds a subclass of the calling namespace's Strategy when
            # instantiated (strategies.namespaces), which a checker cannot see on the mixin.
            trainer = Trainer(strategy=cast(Strategy, strategy), accelerator="cpu", devices=1, max_epochs=-1,
                              max_steps=self.max_updates, logger=False,
                              enable_checkpointing=False, enable_progress_bar=False,
                              enable_model_summary=False, num_sanity_val_steps=0,
                              limit_val_batches=0,
                              callbacks=[clock, _StopAtVirtualTime(clock, self.budget_s)])
            trainer.fit(model, datamodule=datamodule)
        rows = clock.rows
        return SweepRun(variant=variant, k=k,
                        times=np.array([r["time/train_s"] for r in rows], dtype=float),
                        losses=np.array([r["train/loss"] for r in rows], dtype=float),
                        gradients=np.array([r["k"] for r in rows], dtype=float),
                        pushes=int(trainer.global_step), wall_s=time.perf_counter() - started,
                        adaptive=adaptive_k is not None,
                        k_history=list(strategy.stats.get("k_history", [])))

    def run_all(self, chosen: Sequence[tuple[str, int]]) -> list[SweepRun]:
        """Every configuration in turn, one progress line per finished run."""
        runs = []
        for number, (variant, k) in enumerate(chosen, start=1):
            runs.append(self.run(variant, k))
            self.report(runs[-1], f"[{number:>{len(str(len(chosen)))}}/{len(chosen)}]")
        return runs

    def report(self, run: SweepRun, prefix: str) -> None:
        if self.progress is not None:
            self.progress(f"{prefix} {run.label}: {len(run.times)} updates, {run.pushes} "
                          f"gradients in {self.budget_s:.3g} s (virtual), final loss "
                          f"{run.final_error:.4g} ({run.wall_s:.1f} s)")


class _quiet:
    """Keeps Lightning's per-fit info lines and known harmless warnings out of the progress, and
    runs torch on one thread: these models are tiny, and on a shared machine more intra-op
    threads only wait for each other."""

    def __enter__(self) -> None:
        self._logger = logging.getLogger("pytorch_lightning")
        self._level = self._logger.level
        self._logger.setLevel(logging.ERROR)
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")

    def __exit__(self, *exc: Any) -> None:
        self._warnings.__exit__(*exc)
        torch.set_num_threads(self._threads)
        self._logger.setLevel(self._level)
