"""E[T] closed forms against the event-level simulation, and the error bounds' algebra."""

import math

import numpy as np
import pytest

from lightning_stale.delays import Exponential, Pareto, ShiftedExponential, SlowLearners
from lightning_stale.method.theory import (
    async_error_bound,
    async_error_floor,
    closed_form_iteration_time,
    error_against_time,
    expected_iteration_time,
    harmonic,
    monte_carlo_iteration_times,
    sync_error_bound,
    sync_error_floor,
)
from lightning_stale.method.variants import Variant

P = 4
EXP = Exponential(mean=1.0, seed=3)
SHIFTED = ShiftedExponential(shift=0.5, mean=1.0, seed=3)

# (delay, variant, K): every case with a closed form, K-batch-async at K = 1 being Async.
CLOSED_FORM_CASES = [
    (EXP, "sync", 4), (EXP, "k_sync", 1), (EXP, "k_sync", 2), (EXP, "k_sync", 3),
    (EXP, "k_batch_sync", 2), (EXP, "k_batch_sync", 3), (EXP, "k_batch_sync", 4),
    (EXP, "async", 1), (EXP, "k_async", 2), (EXP, "k_async", 3), (EXP, "k_batch_async", 3),
    (SHIFTED, "sync", 4), (SHIFTED, "k_sync", 1), (SHIFTED, "k_sync", 2), (SHIFTED, "k_sync", 3),
    (SHIFTED, "k_batch_sync", 1), (SHIFTED, "async", 1), (SHIFTED, "k_async", 4),
    (SHIFTED, "k_batch_async", 2),
]


def test_harmonic():
    assert harmonic(0) == 0.0
    assert harmonic(4) == pytest.approx(25 / 12)
    with pytest.raises(ValueError):
        harmonic(-1)


def test_closed_forms_of_the_table():
    def e_t(name, k, delay):
        return expected_iteration_time(name, P, k, delay, method="closed_form")

    assert e_t("sync", 4, EXP) == pytest.approx(harmonic(4))
    assert e_t("k_sync", 2, SHIFTED) == pytest.approx(0.5 + harmonic(4) - harmonic(2))
    assert e_t("k_batch_sync", 3, EXP) == pytest.approx(3 / 4)
    assert e_t("async", 1, SHIFTED) == pytest.approx(1.5 / 4)
    assert e_t("k_async", 3, EXP) == pytest.approx(harmonic(4) - harmonic(1))
    assert e_t("k_batch_async", 3, SHIFTED) == pytest.approx(3 * 1.5 / 4)


@pytest.mark.parametrize("delay,name,k", CLOSED_FORM_CASES,
                         ids=[f"{type(d).__name__}-{n}-K{k}" for d, n, k in CLOSED_FORM_CASES])
def test_closed_form_matches_monte_carlo(delay, name, k):
    # About 60k pushes a case: the relative standard error is under 0.5%, and over seeds 0-4
    # every case stayed within 0.9% of its closed form.
    closed = expected_iteration_time(name, P, k, delay, method="closed_form")
    simulated = expected_iteration_time(name, P, k, delay, method="monte_carlo",
                                        updates=60000 // k, seed=0)
    assert abs(simulated - closed) / closed < 0.02


@pytest.mark.parametrize("name,k", [("k_batch_sync", 2), ("k_async", 3)])
def test_no_closed_form_with_a_shift_says_so(name, k):
    with pytest.raises(ValueError, match="monte_carlo"):
        expected_iteration_time(name, P, k, SHIFTED, method="closed_form")
    # auto falls back to Monte Carlo; with D > 0 both stay below E[X_{K:P}] (docs/method.md, general X).
    simulated = expected_iteration_time(name, P, k, SHIFTED, updates=5000)
    assert 0.5 < simulated < 0.5 + harmonic(4) - harmonic(4 - k)


def test_no_closed_form_for_other_delay_models():
    for delay in (Pareto(1.0, 2.5), SlowLearners(EXP, [0], 3.0)):
        with pytest.raises(ValueError, match="monte_carlo"):
            closed_form_iteration_time(Variant.create("async", P), delay)


def test_monte_carlo_is_reproducible_and_leaves_the_callers_model_alone():
    delay = Exponential(1.0, seed=11)
    first = [delay.sample(0) for _ in range(3)]
    delay.reset()
    runs = [expected_iteration_time("k_async", P, 2, delay, method="monte_carlo", updates=2000,
                                    seed=s) for s in (5, 5, 6)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert [delay.sample(0) for _ in range(3)] == first  # its stream was neither used nor reseeded
    times = monte_carlo_iteration_times("k_async", P, 2, delay, updates=2000, seed=5)
    assert len(times) == 2000 and np.all(times >= 0)
    # the estimate is the mean of the post-warm-up intervals (default warm-up: 5% here)
    assert runs[0] == pytest.approx(times[100:].mean(), rel=1e-12)


def test_orderings_for_exponential_delays():
    sync = expected_iteration_time("sync", P, delay=EXP)
    k_sync = expected_iteration_time("k_sync", P, 2, EXP)
    asynchronous = expected_iteration_time("async", P, delay=EXP)
    assert sync > k_sync > asynchronous
    batch_async = [expected_iteration_time("k_batch_async", P, k, EXP, method="monte_carlo",
                                           updates=4000) for k in (1, 2, 3, 4)]
    # every push is an update ingredient, so the same push stream gives exactly K times the time
    assert batch_async == pytest.approx([k * batch_async[0] for k in (1, 2, 3, 4)], rel=0.02)


def test_pareto_sync_matches_the_maximum_order_statistic():
    # Pareto(scale 1, alpha): E[X_{4:4}] = 1 + sum_n C(4,n) (-1)^(n+1) / (alpha n - 1).
    alpha = 2.5
    e_max = 1 + sum(math.comb(4, n) * (-1) ** (n + 1) / (alpha * n - 1) for n in range(1, 5))
    simulated = expected_iteration_time("sync", P, delay=Pareto(1.0, alpha), updates=20000)
    assert simulated == pytest.approx(e_max, rel=0.03)
    # renewal theory: Async pushes at rate P / E[X]
    asynchronous = expected_iteration_time("async", P, delay=Pareto(1.0, alpha), updates=20000)
    assert asynchronous == pytest.approx(Pareto(1.0, alpha).mean / P, rel=0.03)


def test_slow_learner_k_batch_async_follows_the_sum_of_rates():
    slow = SlowLearners(Exponential(1.0), learners=[0], factor=3.0)
    for k in (1, 2):
        expected = k / sum(1 / slow.mean_of(learner) for learner in range(P))
        simulated = expected_iteration_time("k_batch_async", P, k, slow, updates=30000 // k)
        assert simulated == pytest.approx(expected, rel=0.03)


def test_bad_arguments_of_expected_iteration_time():
    with pytest.raises(ValueError, match="method"):
        expected_iteration_time("async", P, method="exact")
    with pytest.raises(ValueError, match="warmup"):
        expected_iteration_time("async", P, method="monte_carlo", updates=10, warmup=10)
    with pytest.raises(ValueError, match="learners"):
        expected_iteration_time("async", 2, delay=SlowLearners(EXP, [3], 2.0))
    with pytest.raises(ValueError, match="conflicting"):
        expected_iteration_time(Variant.create("k_sync", P, 2), P, 3)


BOUND = dict(eta=0.05, smoothness=2.0, strong_convexity=0.5, gradient_variance=4.0, batch_size=8)


def test_sync_floor_scales_as_one_over_k():
    floor_1 = sync_error_floor(k=1, **BOUND)
    assert floor_1 == pytest.approx(0.05 * 2.0 * 4.0 / (2 * 0.5 * 1 * 8))
    assert sync_error_floor(k=4, **BOUND) == pytest.approx(floor_1 / 4)


def test_sync_bound_starts_at_the_gap_and_decays_to_the_floor():
    floor = sync_error_floor(k=2, **BOUND)
    assert sync_error_bound(0, k=2, initial_gap=3.0, **BOUND) == pytest.approx(3.0)
    bounds = sync_error_bound(np.array([1, 10, 100, 10000]), k=2, initial_gap=3.0, **BOUND)
    assert np.all(np.diff(bounds) < 0)
    assert bounds[-1] == pytest.approx(floor, rel=1e-9)


def test_async_floor_is_the_sync_floor_with_c_times_gamma_prime():
    gamma, p0 = 0.6, 0.4  # gamma' = 1 - 0.6 + 0.2 = 0.6
    assert async_error_floor(k=2, gamma=gamma, p0=p0, **BOUND) == pytest.approx(
        sync_error_floor(k=2, **BOUND) / 0.6)
    start = async_error_bound(0, k=2, initial_gap=1.0, gamma=gamma, p0=p0, **BOUND)
    assert start == pytest.approx(1.0)
    with pytest.raises(ValueError, match="gamma'"):
        async_error_floor(k=1, gamma=1.5, p0=0.5, **BOUND)


def test_error_against_time_puts_j_equal_t_over_expected_time():
    e_t = expected_iteration_time("k_sync", P, 2, EXP)
    by_time = error_against_time([0.0, 10 * e_t], e_t, k=2, initial_gap=3.0, **BOUND)
    assert by_time[0] == pytest.approx(3.0)
    assert by_time[1] == pytest.approx(sync_error_bound(10, k=2, initial_gap=3.0, **BOUND))
    with pytest.raises(ValueError, match="both gamma and p0"):
        error_against_time(1.0, e_t, k=2, initial_gap=3.0, gamma=0.5, **BOUND)


@pytest.mark.parametrize("change,message", [
    (dict(eta=0.0), "eta"),
    (dict(eta=0.6), "eta \\* L"),
    (dict(smoothness=-1.0), "smoothness"),
    (dict(strong_convexity=3.0), "exceeds smoothness"),
    (dict(gradient_variance=float("nan")), "gradient_variance"),
    (dict(batch_size=0), "batch_size"),
    (dict(k=1.5), "k must be an integer"),
])
def test_bad_bound_arguments_raise_clear_errors(change, message):
    arguments = {**BOUND, "k": 1, **change}
    with pytest.raises(ValueError, match=message):
        sync_error_floor(**arguments)


def test_bad_iteration_count_and_gap():
    with pytest.raises(ValueError, match="iteration count"):
        sync_error_bound(-1, k=1, initial_gap=1.0, **BOUND)
    with pytest.raises(ValueError, match="initial_gap"):
        sync_error_bound(1, k=1, initial_gap=-1.0, **BOUND)


def test_the_async_bound_contracts_at_eta_c_gamma_prime_after_j_iterations():
    """At j = 0 the bound is the initial gap whatever its rate: check j = 1, 3, 10 against the
    formula by hand, with gamma' = 1 - 0.5 + 0.5 / 2 = 0.75 (docs/method.md)."""
    from lightning_stale.method.theory import async_error_bound, async_error_floor

    args = dict(eta=0.1, smoothness=1.0, strong_convexity=0.5, gradient_variance=1.0, k=1,
                batch_size=1)
    floor = 0.1 * 1.0 * 1.0 / (2 * 0.5 * 0.75 * 1 * 1)
    assert async_error_floor(**args, gamma=0.5, p0=0.5) == pytest.approx(floor)
    for j in (1, 3, 10):
        by_hand = floor + (1 - 0.1 * 0.5 * 0.75) ** j * (2.0 - floor)
        assert async_error_bound(j, **args, initial_gap=2.0, gamma=0.5, p0=0.5) == pytest.approx(by_hand, rel=1e-12)
