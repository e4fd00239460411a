"""Runtime and error theory of Dutta et al., "Slow and Stale Gradients Can Win the Race",
AISTATS 2018 (docs/method.md): the expected time per server update E[T] of the six variants, and the
error bounds of the sync and async families against iterations and against wall-clock time.

Times are in seconds (the units of the delay model's draws). Errors, error floors and initial
gaps are in the units of the objective F, as E[F(w_J)] - F*.

Every closed form of docs/method.md's E[T] table was checked against the event-level simulation
(`VirtualCluster` driven by `ServerRules`, the very rules the engines use); all agree with it to
sampling accuracy (well under 1% with 60,000 mini-batch pushes; see tests/unit/test_theory.py).
"""

from __future__ import annotations

import copy
import math

import numpy as np

from lightning_stale.delays import Exponential, ShiftedExponential
from lightning_stale.method.rules import ServerRules
from lightning_stale.method.variants import Variant
from lightning_stale.method.virtual_clock import VirtualCluster

METHODS = ("auto", "closed_form", "monte_carlo")


def harmonic(n: int) -> float:
    """H_n = 1 + 1/2 + ... + 1/n, with H_0 = 0 (docs/method.md, "Expected time per iteration")."""
    if isinstance(n, bool) or int(n) != n or n < 0:
        raise ValueError(f"harmonic(n) needs an integer n >= 0, got {n!r}")
    return math.fsum(1.0 / i for i in range(1, int(n) + 1))


def _as_variant(variant: str | Variant, p: int | None, k: int | None) -> Variant:
    if isinstance(variant, Variant):
        if (p is not None and p != variant.p) or (k is not None and k != variant.k):
            raise ValueError(f"{variant} was given with conflicting p={p!r}, k={k!r}")
        return variant
    if p is None:
        raise ValueError(f"the number of learners p is needed with the variant name {variant!r}")
    return Variant.create(variant, p, k)


def closed_form_iteration_time(variant: Variant, delay) -> float:
    """E[T] in seconds from docs/method.md's table (Dutta et al., AISTATS 2018,
    runtime analysis; docs/method.md, "Expected time per iteration E[T]").

    X = D + Exp(rate mu) (D = 0 for `Exponential`). Why each formula holds for the rules as
    implemented in `ServerRules`:

    * sync, K-sync: every update restarts all P learners, so T = X_{K:P} and
      E[T] = D + (H_P - H_{P-K}) / mu (Renyi's representation of exponential order statistics).
      K-async with K = P is the same process (all P wait, all P restart).
    * K-batch-sync: all P restart at every update and a pusher restarts at once; with D = 0 each
      push is the minimum of P fresh exponentials, E[T] = K / (P mu). With D > 0 only K = 1 has a
      closed form, D + 1 / (P mu): the first push of a fresh start.
    * Async, K-batch-async: every learner is a renewal process with period X and every push is
      accepted, so by the elementary renewal theorem E[T] = K E[X] / P = K (D + 1/mu) / P
      (long-run average). K-async with K = 1 is Async.
    * K-async with D = 0: after an update all P learners compute (K restart, the rest are
      memoryless), and a pusher waits, so T is the sum of Exp((P-i) mu), i = 0..K-1:
      E[T] = (H_P - H_{P-K}) / mu.

    Raises ValueError for the other combinations (K-batch-sync and K-async with D > 0 and
    1 < K < P, and any delay model other than `Exponential` / `ShiftedExponential`).
    """
    if not isinstance(delay, (Exponential, ShiftedExponential)):
        raise ValueError(
            f"no closed form for E[T] with the delay model {delay!r}: docs/method.md's formulas assume "
            "exponential or shifted-exponential delays; use method='monte_carlo'"
        )
    shift, rate, p, k = delay.shift, delay.rate, variant.p, variant.k
    order_statistic = shift + (harmonic(p) - harmonic(p - k)) / rate  # E[X_{K:P}]
    if variant.counts == "learners" and (variant.synchronous or k == p):
        return order_statistic  # every update restarts all P learners
    if not variant.synchronous and (variant.counts == "batches" or k == 1):
        return k * (shift + 1.0 / rate) / p  # renewal: every push is accepted
    if variant.counts == "batches" and (shift == 0 or k == 1):
        return shift + k / (p * rate)  # K-batch-sync: each push is a minimum of P draws
    if shift == 0:
        return order_statistic  # K-async, memoryless
    raise ValueError(
        f"no closed form for E[T] of {variant} with shifted-exponential delays (shift {shift} s): "
        "the shift breaks memorylessness; use method='monte_carlo'"
    )


def _reseeded_copy(delay, seed: int | None):
    """A copy of `delay` with its streams restarted from `seed` (the caller's model is untouched).

    Seeds live on the random models themselves; wrappers (`SlowLearners.base`,
    `RecordingDelay.model`) expose theirs as a read-only property, so the chain is walked."""
    delay = copy.deepcopy(delay)
    if seed is not None:
        if isinstance(seed, bool) or int(seed) != seed or seed < 0:
            raise ValueError(f"seed must be an integer >= 0 or None, got {seed!r}")
        node = delay
        while node is not None:
            if "seed" in vars(node):
                node.seed = int(seed)
            node = getattr(node, "base", None) or getattr(node, "model", None)
    if hasattr(delay, "reset"):
        delay.reset()
    return delay


def _update_times(variant: Variant, delay, updates: int, seed: int | None,
                  local_steps: int = 1) -> np.ndarray:
    if isinstance(updates, bool) or int(updates) != updates or updates < 1:
        raise ValueError(f"updates must be an integer >= 1, got {updates!r}")
    if hasattr(delay, "check_learners"):
        delay.check_learners(variant.p)
    cluster = VirtualCluster(ServerRules(variant), _reseeded_copy(delay, seed), local_steps=local_steps)
    times: list[float] = []
    step = cluster.step  # the loop is the hot path: 20k updates are 20k-80k pushes
    while len(times) < updates:
        if step().update is not None:
            times.append(cluster.now)
    return np.asarray(times)


def monte_carlo_iteration_times(variant: str | Variant, p: int | None = None, k: int | None = None,
                                delay=None, *, updates: int = 20000,
                                seed: int | None = 0) -> np.ndarray:
    """Seconds between consecutive server updates in one simulated run (the first interval starts
    at time 0, when all learners start in phase). Dutta et al., AISTATS 2018 (docs/method.md, "Expected
    time per iteration E[T]"): T is the runtime per iteration. `delay` defaults to
    Exponential(mean 1 s); seed None keeps the model's own."""
    variant = _as_variant(variant, p, k)
    delay = Exponential(1.0) if delay is None else delay
    return np.diff(_update_times(variant, delay, updates, seed), prepend=0.0)


def expected_iteration_time(variant: str | Variant, p: int | None = None, k: int | None = None,
                            delay=None, *, method: str = "auto", updates: int = 20000,
                            warmup: int | None = None, seed: int | None = 0) -> float:
    """E[T], the expected time in seconds between server updates (Dutta et al., AISTATS 2018,
    runtime analysis; docs/method.md, "Expected time per iteration E[T]").

    Args:
        variant: a variant name (with `p` and `k`, see `Variant.create`) or a `Variant`.
        delay: the straggler model (`lightning_stale.delays`); default Exponential(mean 1 s).
        method: "closed_form" (`closed_form_iteration_time`, ValueError where none exists),
            "monte_carlo" (the event-level simulation), or "auto": closed form where one exists.
        updates: simulated server updates (Monte Carlo only).
        warmup: leading updates discarded, because every run starts with all learners in phase
            while the renewal formulas describe the steady state. Default max(5 P, updates / 20),
            at most half the updates.
        seed: reseeds a copy of `delay` (same seed, same float); None keeps the model's seed.

    The Monte Carlo estimate is (time of the last update - time of the warm-up's last update)
    / (updates - warmup).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    variant = _as_variant(variant, p, k)
    delay = Exponential(1.0) if delay is None else delay
    return _estimate(variant, delay, lambda: closed_form_iteration_time(variant, delay), method,
                     updates, warmup, seed)


def _estimate(variant: Variant, delay, closed_form, method: str, updates: int, warmup: int | None,
              seed: int | None, local_steps: int = 1) -> float:
    """E[T] from ``closed_form()`` where ``method`` allows and one exists (a ValueError where none
    does), else the virtual clock's steady-state mean time per update (pushes after
    ``local_steps`` mini-batches): see `expected_iteration_time`."""
    if method != "monte_carlo":
        try:
            return closed_form()
        except ValueError:
            if method == "closed_form":
                raise
    if warmup is None:
        warmup = min(max(5 * variant.p, updates // 20), updates // 2)
    if isinstance(warmup, bool) or int(warmup) != warmup or not 0 <= warmup < updates:
        raise ValueError(
            f"warmup must be an integer with 0 <= warmup < updates={updates}, got {warmup!r}")
    times = _update_times(variant, delay, updates, seed, local_steps)
    start = times[warmup - 1] if warmup > 0 else 0.0
    return float((times[-1] - start) / (updates - warmup))


# ---------------------------------------------------------------------------- error bounds
def _check(name: str, value: float, *, allow_zero: bool = False) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        sign = ">=" if allow_zero else ">"
        raise ValueError(f"{name} must be a finite number {sign} 0, got {value!r}")
    return value


def _check_count(name: str, value: int) -> int:
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _floor_and_rate(eta, smoothness, strong_convexity, gradient_variance, k, batch_size,
                    gamma_prime: float = 1.0) -> tuple[float, float]:
    """Error floor and per-iteration contraction eta c gamma' of the bound, arguments checked."""
    eta = _check("eta", eta)
    smoothness = _check("smoothness L", smoothness)
    c = _check("strong_convexity c", strong_convexity)
    sigma2 = _check("gradient_variance sigma^2", gradient_variance, allow_zero=True)
    k, m = _check_count("k", k), _check_count("batch_size m", batch_size)
    if c > smoothness:
        raise ValueError(
            f"strong_convexity c={c} exceeds smoothness L={smoothness}: no function is both")
    # docs/method.md states the bound "for eta small enough"; every step-size condition of this kind
    # includes eta <= 1/L, and beyond it (1 - eta c gamma') may leave [0, 1): reject, not warn.
    if eta * smoothness > 1:
        raise ValueError(
            f"eta={eta} is too large for the bound: it needs eta * L <= 1 (L={smoothness})")
    rate = eta * c * gamma_prime
    if rate > 1:
        raise ValueError(
            f"eta * c * gamma' = {rate} > 1: the bound's contraction factor would be negative")
    return eta * smoothness * sigma2 / (2 * c * gamma_prime * k * m), rate


def _bound(j, floor: float, rate: float, initial_gap):
    j = np.asarray(j, dtype=float)
    if np.any(~np.isfinite(j)) or np.any(j < 0):
        raise ValueError(f"the iteration count j must be finite and >= 0, got {j!r}")
    gap = _check("initial_gap E[F(w_0)] - F*", initial_gap, allow_zero=True)
    bound = floor + np.power(1.0 - rate, j) * (gap - floor)
    return float(bound) if bound.ndim == 0 else bound


def sync_error_floor(eta, smoothness, strong_convexity, gradient_variance, k, batch_size) -> float:
    """eta L sigma^2 / (2 c K m): the error floor of K-sync and K-batch-sync SGD (Dutta et al.,
    AISTATS 2018, error analysis of the sync variants; docs/method.md, "Error after J iterations").

    Units: F's. eta is the step size, L the smoothness and c the strong-convexity constants of F,
    sigma^2 the variance of one sample's gradient (a mini-batch's is sigma^2 / m; 0 is allowed),
    K the gradients averaged per update, m the mini-batch size. Raises ValueError for
    non-positive values, c > L, and eta * L > 1 (outside "eta small enough")."""
    return _floor_and_rate(eta, smoothness, strong_convexity, gradient_variance, k, batch_size)[0]


def sync_error_bound(j, eta, smoothness, strong_convexity, gradient_variance, k, batch_size,
                     initial_gap):
    """Bound on E[F(w_j)] - F* after j iterations of the sync family (Dutta et al. 2018, as in
    docs/method.md): floor + (1 - eta c)^j (initial_gap - floor), with initial_gap = E[F(w_0)] - F*.

    Units: F's. j may be fractional or an array (e.g. j = t / E[T]). Arguments as in
    `sync_error_floor`."""
    floor, rate = _floor_and_rate(eta, smoothness, strong_convexity, gradient_variance, k,
                                  batch_size)
    return _bound(j, floor, rate, initial_gap)


def _gamma_prime(gamma, p0) -> float:
    gamma = _check("gamma", gamma, allow_zero=True)
    p0 = float(p0)
    if not 0 <= p0 <= 1:
        raise ValueError(f"p0 is a probability and must lie in [0, 1], got {p0!r}")
    gamma_prime = 1.0 - gamma + p0 / 2
    if gamma_prime <= 0:
        raise ValueError(f"gamma' = 1 - gamma + p0/2 = {gamma_prime} must be > 0 for the async "
                         f"bound to converge (gamma={gamma}, p0={p0})")
    return gamma_prime


def async_error_floor(eta, smoothness, strong_convexity, gradient_variance, k, batch_size,
                      gamma, p0) -> float:
    """eta L sigma^2 / (2 c gamma' K m), gamma' = 1 - gamma + p0/2: the error floor of the async
    family (Dutta et al., AISTATS 2018, error analysis of Async and K-async SGD; docs/method.md).

    Units: F's. gamma bounds how far a stale gradient strays from the fresh one, p0 in [0, 1] is
    a lower bound on the probability that a gradient is fresh. Raises ValueError if gamma' <= 0,
    if eta c gamma' > 1, and as `sync_error_floor`."""
    return _floor_and_rate(eta, smoothness, strong_convexity, gradient_variance, k, batch_size,
                           _gamma_prime(gamma, p0))[0]


def async_error_bound(j, eta, smoothness, strong_convexity, gradient_variance, k, batch_size,
                      initial_gap, gamma, p0):
    """floor + (1 - eta c gamma')^j (initial_gap - floor) for the async family (Dutta et al.
    2018, as in docs/method.md). Units: F's. Arguments as in `async_error_floor`."""
    floor, rate = _floor_and_rate(eta, smoothness, strong_convexity, gradient_variance, k,
                                  batch_size, _gamma_prime(gamma, p0))
    return _bound(j, floor, rate, initial_gap)


def error_against_time(t, expected_time, *, eta, smoothness, strong_convexity, gradient_variance,
                       k, batch_size, initial_gap, gamma=None, p0=None):
    """The error bound after t seconds of wall-clock time, with J = t / E[T] iterations
    (Dutta et al., AISTATS 2018: error-runtime trade-off; docs/method.md, last line of "Error after J
    iterations"). The async bound if gamma and p0 are given, else the sync one. Units: t and
    expected_time in seconds, the result in F's; t may be an array (for plots)."""
    expected_time = _check("expected_time E[T]", expected_time)
    j = np.asarray(t, dtype=float) / expected_time
    args = (eta, smoothness, strong_convexity, gradient_variance, k, batch_size, initial_gap)
    if gamma is None and p0 is None:
        return sync_error_bound(j, *args)
    if gamma is None or p0 is None:
        raise ValueError("give both gamma and p0 (async bound) or neither (sync bound)")
    return async_error_bound(j, *args, gamma, p0)
