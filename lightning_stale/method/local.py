"""E[T], the expected time per server (outer) update, with local updates: a learner pushes after
H mini-batches, so a push takes S = X_1 + ... + X_H, the sum of H mini-batch times
(docs/how-to/local-updates.md).

The variants' rules are unchanged at the outer level, so the runtime analysis of Dutta et al.,
"Slow and Stale Gradients Can Win the Race" (AISTATS 2018) applies with S in place of X. Local
SGD's round time, the slowest of the P learners' sums of H local steps, is the runtime model of
Wang and Joshi, "Cooperative SGD" (JMLR 2021) and of their "Adaptive Communication Strategies to
Achieve the Best Error-Runtime Trade-off in Local-Update SGD" (SysML 2019); DiLoCo (Douillard et
al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023) waits for all P
learners of a round, which is sync here.

With exponential delays, X = D + Exp(rate mu), S = H D + Erlang(H, mu) (a sum of H independent
exponentials of one rate is Erlang). Closed forms:

* sync, K-sync, K-async with K = P: every update restarts all P learners, so T = S_{K:P}, the K-th
  order statistic of P independent copies of S:
  E[T] = H D + integral_0^inf P(Erlang_{K:P} > t) dt, with
  P(Erlang_{K:P} <= t) = I_{F(t)}(K, P - K + 1) (the regularized incomplete beta function of the
  Erlang CDF F: at least K of P done by t), integrated numerically.
* async, K-batch-async, K-async with K = 1: every push is accepted and every learner is a renewal
  process with period S, so by the elementary renewal theorem E[T] = K E[S] / P = K H (D + 1/mu) / P
  (long-run average; any delay distribution).
* K-batch-sync with K = 1: an update is the first push of a fresh start, E[S_{1:P}].

The other combinations with H > 1 (K-batch-sync with K > 1, K-async with 1 < K < P) lose the
memorylessness the H = 1 formulas use; they are estimated by Monte Carlo on the virtual clock the
engines use (`VirtualCluster` with ``local_steps``), as every other delay model is.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
from scipy import integrate, special, stats

from lightning_stale.delays import Exponential, ShiftedExponential
from lightning_stale.method.theory import (
    METHODS,
    _as_variant,
    _estimate,
    _update_times,
    closed_form_iteration_time,
)
from lightning_stale.method.variants import Variant


def check_local_steps(local_steps) -> int:
    """H as an int; ValueError naming the value for a non-integer or H < 1."""
    if isinstance(local_steps, bool) or not isinstance(local_steps, numbers.Integral) or local_steps < 1:
        raise ValueError(f"local_steps must be an integer >= 1 (the inner optimizer's steps per "
                         f"push; 1: a push per step), got {local_steps!r}")
    return int(local_steps)


def erlang_order_statistic_mean(k: int, p: int, local_steps: int, rate: float) -> float:
    """E[S_{K:P}], the mean of the K-th smallest of P independent Erlang(H, rate) times (seconds):
    the integral of the survival function of the order statistic, whose CDF at t is
    I_{F(t)}(K, P - K + 1) for the Erlang CDF F (order statistics of i.i.d. variables). For
    H = 1 it is (H_P - H_{P-K}) / rate (Dutta et al., AISTATS 2018)."""
    h = check_local_steps(local_steps)
    if not (isinstance(k, int) and isinstance(p, int) and 1 <= k <= p):
        raise ValueError(f"need integers 1 <= k <= p, got k={k!r}, p={p!r}")
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be a finite number > 0, got {rate!r}")
    erlang = stats.gamma(h, scale=1.0 / rate)

    def survival(t: float) -> float:
        return float(1.0 - special.betainc(k, p - k + 1, erlang.cdf(t)))

    mean, _ = integrate.quad(survival, 0.0, np.inf, limit=200, epsabs=1e-12, epsrel=1e-10)
    return float(mean)


def closed_form_local_update_time(variant: Variant, delay, local_steps: int) -> float:
    """E[T] in seconds per outer update for pushes after H = ``local_steps`` mini-batches, from
    the closed forms of the module docstring; H = 1 is `theory.closed_form_iteration_time`.
    Raises ValueError where none exists (and for delay models other than `Exponential` and
    `ShiftedExponential`)."""
    h = check_local_steps(local_steps)
    if h == 1:
        return closed_form_iteration_time(variant, delay)
    if not isinstance(delay, (Exponential, ShiftedExponential)):
        raise ValueError(f"no closed form for E[T] with the delay model {delay!r}: the Erlang sums "
                         "assume exponential or shifted-exponential delays; use method='monte_carlo'")
    shift, rate, p, k = delay.shift, delay.rate, variant.p, variant.k
    if variant.counts == "learners" and (variant.synchronous or k == p):
        return h * shift + erlang_order_statistic_mean(k, p, h, rate)  # all P restart
    if not variant.synchronous and (variant.counts == "batches" or k == 1):
        return k * h * (shift + 1.0 / rate) / p  # renewal: every push is accepted
    if variant.counts == "batches" and k == 1:
        return h * shift + erlang_order_statistic_mean(1, p, h, rate)  # first push of a fresh start
    raise ValueError(f"no closed form for E[T] of {variant} with local_steps={h}: a sum of H "
                     "exponentials is not memoryless; use method='monte_carlo'")


def monte_carlo_local_update_times(variant: str | Variant, p: int | None = None,
                                   k: int | None = None, delay=None, *, local_steps: int = 1,
                                   updates: int = 20000, seed: int | None = 0) -> np.ndarray:
    """Seconds between consecutive outer updates in one run of the virtual clock with pushes after
    ``local_steps`` mini-batches (the first interval starts at time 0). `delay` defaults to
    Exponential(mean 1 s); seed None keeps the model's own."""
    variant = _as_variant(variant, p, k)
    delay = Exponential(1.0) if delay is None else delay
    h = check_local_steps(local_steps)
    return np.diff(_update_times(variant, delay, updates, seed, h), prepend=0.0)


def expected_local_update_time(variant: str | Variant, p: int | None = None, k: int | None = None,
                               delay=None, *, local_steps: int = 1, method: str = "auto",
                               updates: int = 20000, warmup: int | None = None,
                               seed: int | None = 0) -> float:
    """E[T], the expected seconds between outer updates when each push follows H =
    ``local_steps`` mini-batches (module docstring). Arguments as in
    `theory.expected_iteration_time`: ``method`` "closed_form", "monte_carlo" or "auto" (closed
    form where one exists); the Monte Carlo estimate discards ``warmup`` leading updates
    (default max(5 P, updates / 20), at most half)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    variant = _as_variant(variant, p, k)
    delay = Exponential(1.0) if delay is None else delay
    h = check_local_steps(local_steps)
    return _estimate(variant, delay, lambda: closed_form_local_update_time(variant, delay, h), method,
                     updates, warmup, seed, h)
