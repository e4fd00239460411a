"""Straggler models fitted to recorded mini-batch times: ``fit(trace)``.

docs/method.md ("Setting") models the time X a learner takes for one mini-batch gradient as i.i.d.
across learners and mini-batches, exponential or shifted exponential (Dutta et al., AISTATS 2018);
the package adds a heavy-tailed Pareto law and persistently slow learners. `fit` estimates each
of these from a trace (`lightning_stale.delays.traces`, e.g. one written by `MiniBatchTimer`) by
maximum likelihood with scipy.stats, and picks one:

* ``exponential``: ``scipy.stats.expon.fit(x, floc=0)``, the mean of x.
* ``shifted_exponential``: ``expon.fit(x)``: shift D = min(x), exponential mean = mean(x) - min(x).
* ``pareto``: ``scipy.stats.pareto.fit(x, floc=0)``, the classical Pareto law: scale x_m = min(x),
  alpha = n / sum(log(x / x_m)). Only when every value is > 0.
* ``slow_learners/<family>``: `SlowLearners(base, learners, factor)`. A learner is *slow* when a
  one-sided Mann-Whitney U test (``scipy.stats.mannwhitneyu``, alternative "greater") finds its
  times larger than all other learners' at level ``slow_alpha`` after a Bonferroni correction
  over the learners (p * L < slow_alpha for L recorded learners) *and* its mean is at least
  ``min_slow_factor`` times the others' (with thousands of mini-batches, significance alone
  would flag differences too small to matter). The base is fitted on the other learners; the
  factor f maximizes the likelihood of the slow learners' times y given that base (their law is
  that of f X): mean(y) / mean for an exponential base, min(mean(y) / m, min(y) / D) for a
  shifted exponential D + Exp(mean m) (f D cannot exceed the smallest y), min(y) / x_m for a
  Pareto base (its likelihood grows with f up to that bound).

Criterion: the lowest BIC = k ln n - 2 ln L (Schwarz 1978; k fitted parameters, n values),
or AIC = 2 k - 2 ln L with ``criterion="aic"``. BIC is the default because the shift of a
shifted exponential always improves the likelihood a little: on exponential data n min(x) / mean
is about Exp(1), so AIC (penalty 2 per parameter) would pick the shift about a third of the time,
BIC (penalty ln n) about once in 1 / sqrt(n). The slow-learner factor counts as a parameter, the
choice of slow learners does not. Beside it, the Kolmogorov-Smirnov statistic sup |F_n - F| of
each candidate (``scipy.stats.kstest``; for slow learners against the mixture of base and scaled
base in the recorded proportions) says how well the chosen law fits: its p-value is not reported,
because the parameters were estimated from the same data (Lilliefors, 1967).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_stale.delays.models import DelayModel, Exponential, Pareto, ShiftedExponential, SlowLearners
from lightning_stale.delays.traces import Trace

FAMILIES = ("exponential", "shifted_exponential", "pareto")
CRITERIA = ("bic", "aic")
_TARGETS = {Exponential: "Exponential", ShiftedExponential: "ShiftedExponential",
            Pareto: "Pareto", SlowLearners: "SlowLearners"}


@dataclass(frozen=True)
class Candidate:
    """One fitted model with its log-likelihood, size and goodness of fit."""

    name: str
    model: DelayModel
    log_likelihood: float
    parameters: int  # k, the number of fitted parameters
    n: int  # the number of values it was fitted to
    ks: float  # Kolmogorov-Smirnov statistic sup |F_n - F|

    @property
    def aic(self) -> float:
        return 2 * self.parameters - 2 * self.log_likelihood

    @property
    def bic(self) -> float:
        return self.parameters * math.log(self.n) - 2 * self.log_likelihood


@dataclass
class FitResult:
    """What `fit` found: the chosen `model`, every candidate and the slow-learner test."""

    model: DelayModel
    best: Candidate
    candidates: list[Candidate]  # best first, by `criterion`
    criterion: str
    source: str
    column: str
    n: int
    learner_means: dict[int, float]
    slow_learners: tuple[int, ...] = ()
    slow_p_values: dict[int, float] = field(default_factory=dict)  # Bonferroni-corrected

    def config(self, seed: int = 0) -> dict[str, Any]:
        """The chosen model as a Hydra config (``_target_`` and arguments, 6 digits)."""
        return _config(self.model, seed)

    def yaml(self, seed: int = 0) -> str:
        """A ``conf/delay/<name>.yaml`` file or ``delay=`` override, ready to paste."""
        from omegaconf import OmegaConf

        header = (f"# Fitted by lightning_stale.delays.fit to {self.n} values of {self.column} in "
                  f"{self.source}: {self.best.name}, {self.criterion.upper()} "
                  f"{getattr(self.best, self.criterion):.1f}, KS {self.best.ks:.4f}\n")
        return header + OmegaConf.to_yaml(OmegaConf.create(self.config(seed)))

    def summary(self) -> str:
        """The candidates as a Markdown table, then the slow-learner test and the choice."""
        lines = [f"{self.n} values of {self.column} from {self.source}; learners' means (s): "
                 + ", ".join(f"{l}: {m:.4g}" for l, m in sorted(self.learner_means.items())),
                 "", "| model | parameters | log-likelihood | AIC | BIC | KS |",
                 "| --- | --- | --- | --- | --- | --- |"]
        for c in self.candidates:
            lines.append(f"| {c.name} | {describe(c.model)} | {c.log_likelihood:.1f} | "
                         f"{c.aic:.1f} | {c.bic:.1f} | {c.ks:.4f} |")
        if self.slow_p_values:
            tested = ", ".join(f"{l}: {p:.2g}" for l, p in sorted(self.slow_p_values.items()))
            lines += ["", f"slow-learner test (Bonferroni-corrected p-values): {tested}; "
                          f"slow: {list(self.slow_learners) or 'none'}"]
        lines += ["", f"chosen by lowest {self.criterion.upper()}: {self.best.name}, "
                      f"{describe(self.model)}"]
        return "\n".join(lines)


def fit(trace: Trace | str | os.PathLike | Mapping[int, Sequence[float]], *,
        column: str | None = None, criterion: str = "bic",
        families: Sequence[str] = FAMILIES, slow_alpha: float = 0.01,
        min_slow_factor: float = 1.2, discard_first: int = 0, seed: int = 0) -> FitResult:
    """Fit every straggler model to the recorded times and pick one (module docstring).

    Args:
        trace: a `Trace`, a trace CSV path, or a mapping learner -> recorded seconds.
        column: the trace column fitted (default: the `Trace`'s own, else ``delay_s``).
        criterion: "bic" (default) or "aic"; the lowest wins.
        families: the base families tried (a subset of `FAMILIES`).
        slow_alpha: the slow-learner test's significance level (module docstring).
        min_slow_factor: how much slower than the others a slow learner's mean must be
            (module docstring).
        discard_first: values dropped at the start of every learner's record (warm-up).
        seed: the seed of the returned models.
    """
    if criterion not in CRITERIA:
        raise ValueError(f"criterion must be one of {', '.join(CRITERIA)}, got {criterion!r}")
    unknown = [name for name in families if name not in FAMILIES]
    if unknown or not families:
        raise ValueError(f"families must be a non-empty subset of {', '.join(FAMILIES)}, "
                         f"got {list(families)!r}")
    if not 0 < slow_alpha < 1:
        raise ValueError(f"slow_alpha must lie in (0, 1), got {slow_alpha!r}")
    if not min_slow_factor >= 1:
        raise ValueError(f"min_slow_factor must be >= 1, got {min_slow_factor!r}")
    if isinstance(discard_first, bool) or int(discard_first) != discard_first or discard_first < 0:
        raise ValueError(f"discard_first must be an integer >= 0, got {discard_first!r}")
    source, column, records = _records(trace, column, int(discard_first))
    pooled = np.concatenate([records[l] for l in sorted(records)])
    if len(pooled) < 10:
        raise ValueError(f"{source}: {len(pooled)} values of {column} are too few to fit; "
                         "record at least 10 mini-batches")
    if np.ptp(pooled) == 0:
        raise ValueError(f"{source}: all {len(pooled)} values of {column} equal {pooled[0]}: "
                         "there is no straggling to fit; use Constant(value)")
    fitted = [_fit_family(name, pooled, seed) for name in families]
    candidates = [c for c in fitted if c is not None]
    slow, p_values = _slow_learners(records, slow_alpha, min_slow_factor)
    if slow:
        rest = np.concatenate([records[l] for l in sorted(records) if l not in slow])
        scaled = np.concatenate([records[l] for l in slow])
        for name in families:
            base = _fit_family(name, rest, seed)
            if base is not None and np.ptp(rest) > 0:
                candidates.append(_slow_candidate(base, rest, scaled, slow))
    if not candidates:
        raise ValueError(f"{source}: none of the families {list(families)} can be fitted "
                         f"(a Pareto law needs every value > 0)")
    candidates.sort(key=lambda c: getattr(c, criterion))
    return FitResult(model=candidates[0].model, best=candidates[0], candidates=candidates,
                     criterion=criterion, source=source, column=column, n=len(pooled),
                     learner_means={l: float(np.mean(v)) for l, v in records.items()},
                     slow_learners=slow, slow_p_values=p_values)


def describe(model: DelayModel) -> str:
    """The model's parameters, e.g. ``shift=0.01 s, mean=0.05 s`` (seeds left out)."""
    if isinstance(model, SlowLearners):
        return (f"{type(model.base).__name__}({describe(model.base)}) x {model.factor:.4g} "
                f"for learners {list(model.learners)}")
    config = _config(model, 0)
    return ", ".join(f"{key}={value:.4g}" for key, value in config.items()
                     if key not in ("_target_", "seed"))


# ---------------------------------------------------------------------------- internals
def _records(trace, column: str | None, discard_first: int
             ) -> tuple[str, str, dict[int, np.ndarray]]:
    if isinstance(trace, Mapping):
        source, column = "the given values", column or "delay_s"
        raw = {int(l): np.asarray(v, dtype=float).ravel() for l, v in trace.items()}
        bad = [l for l, v in raw.items() if not (np.all(np.isfinite(v)) and np.all(v >= 0))]
        if bad or any(l < 0 for l in raw):
            raise ValueError(f"recorded times must be finite numbers >= 0 for learners >= 0; "
                             f"learners {bad or sorted(l for l in raw if l < 0)} are not")
    else:
        if not isinstance(trace, Trace):
            if not isinstance(trace, (str, os.PathLike)):
                raise ValueError(f"fit needs a Trace, a trace CSV path or a mapping learner -> "
                                 f"times, got {trace!r}")
            trace = Trace(trace, column=column or "delay_s")
        elif column is not None and column != trace.column:
            trace = Trace(trace.path, column=column)
        source, column = trace.path, trace.column
        raw = {l: np.asarray(trace.delays_of(l), dtype=float) for l in trace.learners}
    records = {l: v[discard_first:] for l, v in sorted(raw.items()) if len(v) > discard_first}
    if not records:
        raise ValueError(f"{source}: no values of {column} left after discarding the first "
                         f"{discard_first} of every learner")
    return source, column, records


def _frozen(model: DelayModel):
    """The scipy.stats distribution of one learner's draws of a fitted model."""
    from scipy import stats

    if isinstance(model, Pareto):
        return stats.pareto(model.alpha, loc=0.0, scale=model.scale)
    if isinstance(model, ShiftedExponential):
        return stats.expon(loc=model.shift, scale=model.exponential_mean)
    return stats.expon(scale=model.mean)


def _fit_family(name: str, x: np.ndarray, seed: int) -> Candidate | None:
    from scipy import stats

    model: DelayModel
    if name == "exponential":
        _, scale = stats.expon.fit(x, floc=0.0)
        model, k = Exponential(mean=scale, seed=seed), 1
    elif name == "shifted_exponential":
        loc, scale = stats.expon.fit(x)
        if not scale > 0:
            return None
        model, k = ShiftedExponential(shift=max(loc, 0.0), mean=scale, seed=seed), 2
    else:
        if not np.all(x > 0):
            return None
        alpha, _, scale = stats.pareto.fit(x, floc=0.0)
        model, k = Pareto(scale=scale, alpha=alpha, seed=seed), 2
    law = _frozen(model)
    return Candidate(name, model, float(np.sum(law.logpdf(x))), k, len(x),
                     float(stats.kstest(x, law.cdf).statistic))


def _slow_learners(records: dict[int, np.ndarray], alpha: float, min_factor: float
                   ) -> tuple[tuple[int, ...], dict[int, float]]:
    from scipy import stats

    if len(records) < 2:
        return (), {}
    p_values, slow = {}, []
    for learner, values in records.items():
        others = np.concatenate([v for l, v in records.items() if l != learner])
        test = stats.mannwhitneyu(values, others, alternative="greater")
        p_values[learner] = min(1.0, float(test.pvalue) * len(records))
        if p_values[learner] < alpha and np.mean(values) >= min_factor * np.mean(others):
            slow.append(learner)
    return tuple(slow), p_values


def _slow_candidate(base: Candidate, rest: np.ndarray, scaled: np.ndarray,
                    learners: tuple[int, ...]) -> Candidate:
    from scipy import stats

    factor = _slow_factor(base.model, scaled)
    model = SlowLearners(base.model, learners, factor)
    law = _frozen(base.model)
    # f is at most min(y) / (the base's lowest value): y / f stays in the support but for the
    # rounding of the division, which the clip undoes.
    unscaled = np.maximum(scaled / factor, law.support()[0])
    log_likelihood = base.log_likelihood + float(np.sum(law.logpdf(unscaled))
                                                 - len(scaled) * math.log(factor))
    share = len(rest) / (len(rest) + len(scaled))
    pooled = np.concatenate([rest, scaled])
    ks = stats.kstest(pooled, lambda x: share * law.cdf(x) + (1 - share) * law.cdf(x / factor))
    return Candidate(f"slow_learners/{base.name}", model, log_likelihood, base.parameters + 1,
                     len(pooled), float(ks.statistic))


def _slow_factor(base: DelayModel, y: np.ndarray) -> float:
    """The f maximizing the likelihood of y under f X, X ~ base (module docstring)."""
    if isinstance(base, Pareto):
        return float(np.min(y) / base.scale)
    if isinstance(base, ShiftedExponential):
        factor = float(np.mean(y) / base.exponential_mean)
        return min(factor, float(np.min(y) / base.shift)) if base.shift > 0 else factor
    return float(np.mean(y) / base.mean)


def _number(value: float) -> float:
    return float(f"{value:.6g}")


def _config(model: DelayModel, seed: int) -> dict[str, Any]:
    target = f"lightning_stale.delays.{_TARGETS[type(model)]}"
    if isinstance(model, SlowLearners):
        return {"_target_": target, "base": _config(model.base, seed),
                "learners": list(model.learners), "factor": _number(model.factor)}
    if isinstance(model, Pareto):
        arguments = {"scale": model.scale, "alpha": model.alpha}
    elif isinstance(model, ShiftedExponential):
        arguments = {"shift": model.shift, "mean": model.exponential_mean}
    else:
        arguments = {"mean": model.mean}
    return {"_target_": target, **{k: _number(v) for k, v in arguments.items()}, "seed": seed}
