"""From a measured cluster to the right variant and K: ``lightning-stale-advise TRACE`` (`advise_cli`).

The practical message of Dutta et al., "Slow and Stale Gradients Can Win the Race" (AISTATS
2018; docs/method.md) is a choice: given how a cluster's learners straggle, which variant and
which K reach a target error soonest. `advise` closes the loop from a recorded trace
(`lightning_stale.strategies.timing.MiniBatchTimer`, or any `Trace` file) to that choice:

1. fit the straggler models (`lightning_stale.delays.fit`) and build the empirical law of the
   recorded times (`lightning_stale.delays.Empirical`, resampled);
2. E[T] for every variant and K with P learners (`theory.expected_iteration_time`: the closed
   forms of docs/method.md, "Expected time per iteration E[T]", for the fitted law where they
   exist, Monte Carlo on the event-level `VirtualCluster` otherwise and always for the
   empirical law);
3. short simulated sweeps (`lightning_stale.analysis.sweeps`) of the model and data of a config
   or recipe with the recorded times replayed, every run for the same virtual time;
4. the ranking by time to a target training loss, the recommendation (the least time; ties in
   time go to the lower final error), and a short check of whether AdaSync (docs/method.md,
   "Gradually increasing synchrony"; `AdaptiveK` from K_0 = 1) beats it;
5. the trade-off figure: time to the target against final error, one point per variant and K.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from lightning_stale.analysis.runs import measured_update_time
from lightning_stale.analysis.sweeps import K_VARIANTS, Sweep, SweepRun, configurations
from lightning_stale.config import ConfigError, compose_config
from lightning_stale.delays import DelayModel, Empirical, FitResult, Trace, fit
from lightning_stale.method import theory
from lightning_stale.method.variants import VARIANT_NAMES, Variant

REPLAYS = ("empirical", "fitted", "trace")


def iteration_time_table(p: int, chosen: Sequence[tuple[str, int]], models: dict[str, Any],
                         updates: int = 5000, seed: int = 0) -> list[dict[str, Any]]:
    """E[T] in seconds of every (variant, K) for each named straggler model (columns
    ``E[T] <name>`` and ``method <name>``): the closed form of docs/method.md where it exists,
    else Monte Carlo with `updates` server updates of the `VirtualCluster`
    (`theory.expected_iteration_time`)."""
    rows = []
    for name, k in chosen:
        variant = Variant.create(name, p, k)
        row: dict[str, Any] = {"variant": name, "k": k}
        for label, model in models.items():
            try:
                value, method = theory.closed_form_iteration_time(variant, model), "closed form"
            except ValueError:
                value = theory.expected_iteration_time(variant, delay=model, method="monte_carlo",
                                                       updates=updates, seed=seed)
                method = f"Monte Carlo ({updates} updates)"
            row[f"E[T] {label}"], row[f"method {label}"] = value, method
        rows.append(row)
    return rows


@dataclass
class Advice:
    """Everything `advise` found; `report()` prints it, `plot_advice` draws it."""

    p: int
    fitted: FitResult
    replayed: DelayModel
    iteration_times: list[dict[str, Any]]
    runs: list[SweepRun]
    target: float
    window: int
    budget_s: float
    replay: str = "empirical"
    adaptive: SweepRun | None = None

    def ranked(self) -> list[SweepRun]:
        """Runs by time to the target (those that missed it last), then by final error."""
        def key(run: SweepRun) -> tuple:
            t = run.time_to(self.target, self.window)
            return (math.isnan(t), 0.0 if math.isnan(t) else t, run.final_error)
        return sorted(self.runs, key=key)

    @property
    def best(self) -> SweepRun | None:
        ranked = self.ranked()
        return ranked[0] if ranked and not math.isnan(self.time_of(ranked[0])) else None

    def time_of(self, run: SweepRun) -> float:
        return run.time_to(self.target, self.window)

    def expected_time(self, variant: str, k: int) -> float:
        row = next((r for r in self.iteration_times if (r["variant"], r["k"]) == (variant, k)),
                   None)
        return row.get(f"E[T] {self.replay}", math.nan) if row else math.nan

    def rows(self) -> list[dict[str, Any]]:
        """The ranked table as dicts (also written as sweep.csv)."""
        return [{"rank": i, "variant": run.variant, "k": run.k,
                 "time_to_target_s": self.time_of(run), "final_error": run.final_error,
                 "updates": len(run.times), "gradients": run.pushes,
                 "s_per_update": measured_update_time(run.times, self.p),
                 "E[T]_s": self.expected_time(run.variant, run.k)}
                for i, run in enumerate(self.ranked(), start=1)]

    def adaptive_helps(self) -> bool | None:
        """Whether AdaSync reached the target sooner than the best fixed K (None: not run)."""
        if self.adaptive is None or self.best is None:
            return None
        mine = self.time_of(self.adaptive)
        return not math.isnan(mine) and mine < self.time_of(self.best)

    def recommendation(self) -> str:
        best = self.best
        if best is None:
            return (f"No configuration reached the target loss {self.target:.4g} within "
                    f"{self.budget_s:.3g} s: raise the budget (--budget-s) or the target.")
        text = (f"Recommended: {best.variant} with K={best.k} of P={self.p}: the target loss "
                f"{self.target:.4g} in {self.time_of(best):.3g} s, final loss "
                f"{best.final_error:.4g}, E[T] = {self.expected_time(best.variant, best.k):.4g} s.")
        if self.adaptive is not None:
            mine = self.time_of(self.adaptive)
            reached = "never reached the target" if math.isnan(mine) else f"{mine:.3g} s"
            verdict = "helps" if self.adaptive_helps() else "does not help"
            text += (f"\nAdaSync ({self.adaptive.variant}, K from 1, K history "
                     f"{[(round(t, 2), k) for t, k in self.adaptive.k_history]}): {reached}, "
                     f"final loss {self.adaptive.final_error:.4g}: it {verdict} here.")
        return text

    def report(self) -> str:
        lines = ["## Fit", "", self.fitted.summary(), "", "```yaml", self.fitted.yaml().rstrip(),
                 "```", "", f"## E[T] with P = {self.p}", "",
                 markdown_table(self.iteration_times)]
        if self.runs:
            lines += ["", f"## Time to training loss {self.target:.4g} ({self.budget_s:.3g} s "
                          f"of virtual time per run, smoothed over {self.window} gradients)", "",
                      markdown_table(self.rows()), "", self.recommendation()]
        return "\n".join(lines)


def advise(trace: Trace | str | os.PathLike, p: int | None = None, *, column: str | None = None,
           config_name: str = "train", overrides: Sequence[str] = (),
           ks: Sequence[int] | None = None, variants: Sequence[str] = VARIANT_NAMES,
           target: float | None = None, budget_s: float | None = None, pushes: int = 1200,
           window: int | None = None, replay: str = "empirical", per_learner: bool | None = None,
           sweep: bool = True, adaptive: bool = True, et_updates: int = 5000,
           discard_first: int = 0, seed: int = 0,
           progress: Callable[[str], None] | None = print) -> Advice:
    """Fit, E[T] table, sweeps and recommendation for a recorded trace (module docstring).

    Args:
        trace: a trace CSV (e.g. ``minibatch_times.csv``) or a `Trace`.
        p: the number of learners to advise for; default: the learners in the trace.
        column: the column used (default ``delay_s``: X where known, else the computation).
        config_name: the app config or recipe whose ``data``, ``model`` and ``seed`` the sweeps
            train (`compose_config`); default the digits MLP.
        overrides: Hydra overrides applied to that config.
        ks: the K tried for the K-variants (default 1..P).
        variants: the variants tried.
        target: the training loss to reach; default the median final error of the runs.
        budget_s: virtual seconds per run; default the time P learners need to compute
            `pushes` mini-batches together without waiting, pushes x E[X] / P.
        window: gradients in the smoothed loss (`sweeps`), default 8 P.
        replay: the law of X in the sweeps: "empirical" (resampled recorded times), "fitted"
            (the chosen model), "trace" (the records in order, cycled; P = learners in it).
        per_learner: whether the empirical law keeps each learner's own record; default when
            P equals the number of recorded learners, else pooled.
        sweep: run the sweeps.
        adaptive: run the AdaSync check.
        et_updates: server updates of each Monte Carlo E[T].
        discard_first: values left out at the start of every learner's record (warm-up) by the
            fit and the empirical law ("trace" replays the file as it is).
        seed: seeds the fitted and empirical laws and the Monte Carlo E[T].
    """
    if replay not in REPLAYS:
        raise ValueError(f"replay must be one of {', '.join(REPLAYS)}, got {replay!r}")
    if not isinstance(trace, (Trace, str, os.PathLike)):
        raise ValueError(f"advise needs a trace CSV path or a Trace, got {trace!r}")
    for name, value in (("pushes", pushes), ("window", window)):
        if value is not None and (isinstance(value, bool) or int(value) != value or value < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if target is not None and not math.isfinite(float(target)):
        raise ValueError(f"target must be a finite training loss, got {target!r}")
    fitted = fit(trace, column=column, discard_first=discard_first, seed=seed)
    recorded = Trace(fitted.source, column=fitted.column, on_exhausted="cycle")
    p = len(recorded.learners) if p is None else p
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ValueError(f"the number of learners p must be an integer >= 1, got {p!r}")
    if per_learner is None:
        per_learner = p == len(recorded.learners)
    empirical = Empirical(recorded, column=fitted.column, per_learner=per_learner, seed=seed,
                          discard_first=discard_first)
    replayed = {"empirical": empirical, "fitted": fitted.model, "trace": recorded}[replay]
    for model in (fitted.model, empirical, replayed):
        model.check_learners(p)
    chosen = configurations(p, ks, variants)
    models = {"fitted": fitted.model, "empirical": empirical}
    if replay == "trace":
        models["trace"] = recorded
    table = iteration_time_table(p, chosen, models, et_updates, seed)
    mean_x = float(np.mean([replayed.mean_of(learner) for learner in range(p)]))
    budget_s = pushes * mean_x / p if budget_s is None else float(budget_s)
    window = 8 * p if window is None else int(window)
    advice = Advice(p, fitted, replayed, table, [], math.nan, window, budget_s, replay)
    if not sweep:
        return advice
    runner = Sweep(_sweep_config(config_name, overrides), p, replayed, budget_s,
                   progress=progress)
    advice.runs = runner.run_all(chosen)
    finals = [run.final_error for run in advice.runs]
    advice.target = float(np.median(finals)) if target is None else float(target)
    best = advice.best
    if adaptive and best is not None and p > 1:
        family = best.variant if best.variant in K_VARIANTS else \
            {"sync": "k_sync", "async": "k_async"}[best.variant]
        advice.adaptive = runner.run(family, 1, {"k0": 1, "interval_s": budget_s / 20})
        runner.report(advice.adaptive, "[AdaSync]")
    return advice


def _sweep_config(config_name: str, overrides: Sequence[str]) -> DictConfig:
    cfg = compose_config(config_name, list(overrides), validate=False)
    missing = sorted(key for key in OmegaConf.missing_keys(cfg)
                     if key.split(".")[0] in ("data", "model", "seed"))
    if missing:
        raise ConfigError(f"{config_name}: missing values (???) for {', '.join(missing)}; "
                          f"pass them as overrides, e.g. --override {missing[0]}=...")
    return cfg


def markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(none)"
    columns = list(rows[0])

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return "not reached" if math.isnan(value) else f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)
