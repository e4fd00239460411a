"""E[T] closed forms against the event-level simulation, and the error bounds' algebra."""

import math
import re

import numpy as np
import pytest

from lightning_stale.delays import Constant, Exponential, Pareto, RecordingDelay, ShiftedExponential, SlowLearners
from lightning_stale.method.local import (
    check_local_steps,
    closed_form_local_update_time,
    erlang_order_statistic_mean,
    expected_local_update_time,
    monte_carlo_local_update_times,
)
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
    with pytest.raises(ValueError, match=r"^initial_gap E\[F\(w_0\)\] - F\* must be a finite number >= 0, got -1.0$"):
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


# ---------------------------------------------------------------- every closed form, by the table
# Delays of mean m = 0.5 s (rate 2) and shift d = 0.25 s: a rate other than 1 tells `/ rate` from
# `* rate`. E[T] by docs/method.md's table: E[X_{K:P}] = d + (H_P - H_{P-K}) m for the variants that
# restart all P learners, K (d + m) / P by renewal where every push is accepted, d + K m / P for
# K-batch-sync (with d = 0, or K = 1).
MEAN, SHIFT = 0.5, 0.25
EXP_HALF = Exponential(mean=MEAN)
SHIFTED_HALF = ShiftedExponential(shift=SHIFT, mean=MEAN)


def _order_statistic(k, d):
    return d + (harmonic(P) - harmonic(P - k)) * MEAN


TABLE = [
    (EXP_HALF, "sync", None, _order_statistic(4, 0.0)),
    (EXP_HALF, "k_sync", 1, _order_statistic(1, 0.0)),
    (EXP_HALF, "k_sync", 3, _order_statistic(3, 0.0)),
    (EXP_HALF, "k_batch_sync", 3, 3 * MEAN / P),
    (EXP_HALF, "async", None, MEAN / P),
    (EXP_HALF, "k_async", 1, MEAN / P),
    (EXP_HALF, "k_async", 2, _order_statistic(2, 0.0)),
    (EXP_HALF, "k_async", 4, _order_statistic(4, 0.0)),
    (EXP_HALF, "k_batch_async", 3, 3 * MEAN / P),
    (SHIFTED_HALF, "sync", None, _order_statistic(4, SHIFT)),
    (SHIFTED_HALF, "k_sync", 2, _order_statistic(2, SHIFT)),
    (SHIFTED_HALF, "k_batch_sync", 1, SHIFT + MEAN / P),
    (SHIFTED_HALF, "async", None, (SHIFT + MEAN) / P),
    (SHIFTED_HALF, "k_async", 1, (SHIFT + MEAN) / P),
    (SHIFTED_HALF, "k_async", 4, _order_statistic(4, SHIFT)),
    (SHIFTED_HALF, "k_batch_async", 2, 2 * (SHIFT + MEAN) / P),
    (SHIFTED_HALF, "k_batch_async", 1, (SHIFT + MEAN) / P),
]


@pytest.mark.parametrize("delay,name,k,expected", TABLE,
                         ids=[f"{type(d).__name__}-{n}-K{k}" for d, n, k, _ in TABLE])
def test_every_closed_form_is_the_table_s(delay, name, k, expected):
    variant = Variant.create(name, P, k)
    assert closed_form_iteration_time(variant, delay) == pytest.approx(expected, rel=1e-12)
    # "auto" and "closed_form" take it where it exists, whatever the Monte Carlo settings
    assert expected_iteration_time(variant, delay=delay, updates=1) == pytest.approx(expected, rel=1e-12)
    assert expected_iteration_time(name, P, k, delay, method="closed_form") == pytest.approx(expected, rel=1e-12)


def test_a_variant_with_its_own_p_and_k_is_taken_as_it_is():
    variant = Variant.create("k_sync", P, 2)
    expected = _order_statistic(2, 0.0)
    assert expected_iteration_time(variant, P, 2, EXP_HALF) == pytest.approx(expected)
    assert expected_iteration_time(variant, P, None, EXP_HALF) == pytest.approx(expected)
    assert expected_iteration_time(variant, None, 2, EXP_HALF) == pytest.approx(expected)
    with pytest.raises(ValueError, match="conflicting"):
        expected_iteration_time(variant, P + 1, None, EXP_HALF)
    with pytest.raises(ValueError, match="conflicting"):
        expected_iteration_time(variant, None, 3, EXP_HALF)
    with pytest.raises(ValueError, match="number of learners p is needed"):
        expected_iteration_time("k_sync", None, 2, EXP_HALF)


def test_harmonic_refuses_what_is_not_a_count():
    assert harmonic(1) == 1.0 and harmonic(2.0) == 1.5
    for bad in (True, 2.5, -1, -2.0):
        with pytest.raises(ValueError, match="integer n >= 0"):
            harmonic(bad)


# ---------------------------------------------------------------- the virtual clock's estimate
def test_constant_delays_give_the_exact_update_times():
    """With every mini-batch taking d seconds, sync updates every d (all P push at once), and
    async takes P updates at each multiple of d (every push is one)."""
    d = 0.5
    assert monte_carlo_iteration_times("sync", P, delay=Constant(d), updates=7).tolist() == [d] * 7
    intervals = monte_carlo_iteration_times("async", P, delay=Constant(d), updates=2 * P)
    assert intervals.tolist() == ([d] + [0.0] * (P - 1)) * 2
    # no closed form for a constant delay: "auto" runs the clock; a warm-up of whole rounds of
    # P updates leaves d / P per update
    assert expected_iteration_time("async", P, delay=Constant(d), updates=10 * P, warmup=2 * P) == pytest.approx(d / P)
    assert expected_iteration_time("sync", P, delay=Constant(d), updates=30) == pytest.approx(d)


def _update_times_of(name, k, delay, updates, seed):
    return np.cumsum(monte_carlo_iteration_times(name, P, k, delay, updates=updates, seed=seed))


@pytest.mark.parametrize("updates,warmup", [
    (31, 15),     # at most half the updates (31 // 2)
    (200, 20),    # 5 P
    (1010, 50),   # updates // 20
])
def test_the_default_warmup_and_the_estimate(updates, warmup):
    """The estimate is (time of the last update - time of the warm-up's last one) / (updates -
    warmup), with warmup max(5 P, updates // 20), at most updates // 2 (its docstring)."""
    delay = Exponential(1.0)
    times = _update_times_of("k_async", 2, delay, updates, seed=4)
    by_hand = (times[-1] - times[warmup - 1]) / (updates - warmup)
    default = expected_iteration_time("k_async", P, 2, delay, method="monte_carlo", updates=updates, seed=4)
    assert default == pytest.approx(by_hand, rel=1e-12)
    explicit = expected_iteration_time("k_async", P, 2, delay, method="monte_carlo", updates=updates,
                                       warmup=warmup, seed=4)
    assert explicit == default
    # no warm-up: the mean over every interval, from time 0
    none = expected_iteration_time("k_async", P, 2, delay, method="monte_carlo", updates=updates,
                                   warmup=0, seed=4)
    assert none == pytest.approx(times[-1] / updates, rel=1e-12)


@pytest.mark.parametrize("warmup", [-1, 40, 41, 2.5, True])
def test_bad_warmups_are_refused(warmup):
    with pytest.raises(ValueError, match="warmup must be an integer with 0 <= warmup < updates=40"):
        expected_iteration_time("async", P, method="monte_carlo", updates=40, warmup=warmup)


@pytest.mark.parametrize("updates", [0, -3, 2.5, True])
def test_bad_update_counts_are_refused(updates):
    with pytest.raises(ValueError, match="updates must be an integer >= 1"):
        monte_carlo_iteration_times("async", P, updates=updates)
    assert len(monte_carlo_iteration_times("async", P, updates=1)) == 1


def test_the_defaults_are_exponential_of_mean_one_and_seed_zero():
    own_seed = Exponential(1.0, seed=3)
    default = monte_carlo_iteration_times("k_async", P, 2, own_seed, updates=300)
    assert default.tolist() == monte_carlo_iteration_times("k_async", P, 2, own_seed, updates=300, seed=0).tolist()
    assert default.tolist() != monte_carlo_iteration_times("k_async", P, 2, own_seed, updates=300, seed=None).tolist()
    no_delay = monte_carlo_iteration_times("k_async", P, 2, updates=300)
    assert no_delay.tolist() == monte_carlo_iteration_times("k_async", P, 2, Exponential(1.0), updates=300).tolist()
    assert expected_iteration_time("k_async", P, 2, method="monte_carlo", updates=300) == \
        expected_iteration_time("k_async", P, 2, Exponential(1.0, seed=9), method="monte_carlo", updates=300, seed=0)
    assert expected_iteration_time("k_async", P, 2) == pytest.approx(harmonic(P) - harmonic(P - 2))


def test_seeds_reach_the_model_inside_wrappers_and_restart_used_streams():
    """A seed replaces the one of the random model at the bottom of a chain of wrappers; the
    copy's streams restart from it even where the caller's model had drawn already."""
    used = SlowLearners(Exponential(1.0, seed=0), learners=[1], factor=2.0)
    for _ in range(5):
        used.sample(0)
        used.sample(1)
    fresh = SlowLearners(Exponential(1.0, seed=7), learners=[1], factor=2.0)
    reseeded = monte_carlo_iteration_times("k_async", P, 2, used, updates=200, seed=7)
    assert reseeded.tolist() == monte_carlo_iteration_times("k_async", P, 2, fresh, updates=200, seed=None).tolist()
    assert reseeded.tolist() == monte_carlo_iteration_times("k_async", P, 2, used, updates=200, seed=7.0).tolist()
    # through a recording wrapper too (its seed, like SlowLearners', is its model's)
    recorded = RecordingDelay(SlowLearners(Exponential(1.0, seed=0), learners=[1], factor=2.0))
    assert monte_carlo_iteration_times("k_async", P, 2, recorded, updates=200, seed=7).tolist() == reseeded.tolist()
    # seed None keeps the model's seed, and its streams restart from it too
    kept = monte_carlo_iteration_times("k_async", P, 2, used, updates=200, seed=None)
    assert kept.tolist() == monte_carlo_iteration_times("k_async", P, 2, used, updates=200, seed=0).tolist()
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="seed must be an integer >= 0 or None"):
            monte_carlo_iteration_times("async", P, updates=5, seed=bad)


# ---------------------------------------------------------------- the error bounds' arguments
def test_zero_variance_and_zero_gap_are_allowed():
    """sigma^2 = 0 gives no floor: the gap contracts by (1 - eta c) per iteration; a gap of 0
    rises towards the floor."""
    rate = BOUND["eta"] * BOUND["strong_convexity"]
    no_noise = {**BOUND, "gradient_variance": 0.0}
    assert sync_error_floor(k=1, **no_noise) == 0.0
    assert sync_error_bound(3, k=1, initial_gap=2.0, **no_noise) == pytest.approx(2.0 * (1 - rate) ** 3)
    floor = sync_error_floor(k=1, **BOUND)
    assert sync_error_bound(2, k=1, initial_gap=0.0, **BOUND) == pytest.approx(floor * (1 - (1 - rate) ** 2))
    assert async_error_bound(0, k=1, initial_gap=0.0, gamma=0.0, p0=0.0, **BOUND) == 0.0


def test_the_limits_of_the_step_size_and_the_constants_are_inclusive():
    """eta L = 1, c = L and eta c gamma' = 1 are allowed; one step at rate 1 lands on the floor."""
    edge = dict(eta=0.5, smoothness=2.0, strong_convexity=2.0, gradient_variance=1.0, k=1, batch_size=1)
    floor = sync_error_floor(**edge)
    assert floor == pytest.approx(0.5 * 2.0 * 1.0 / (2 * 2.0))
    assert sync_error_bound(1, initial_gap=5.0, **edge) == pytest.approx(floor)
    # gamma = 0.5, p0 = 1: gamma' = 1 - 0.5 + 0.5 = 1, the sync bound again
    assert async_error_bound(1, initial_gap=5.0, gamma=0.5, p0=1.0, **edge) == pytest.approx(floor)
    # gamma = 0, p0 = 1: gamma' = 1.5, eta c gamma' = 1.5 > 1
    with pytest.raises(ValueError, match="contraction factor would be negative"):
        async_error_bound(1, initial_gap=5.0, gamma=0.0, p0=1.0, **edge)
    with pytest.raises(ValueError, match="eta \\* L <= 1"):
        sync_error_floor(**{**edge, "eta": 0.5000001})
    with pytest.raises(ValueError, match="exceeds smoothness"):
        sync_error_floor(**{**edge, "strong_convexity": 2.0000001})


@pytest.mark.parametrize("change,message", [
    (dict(eta=float("inf")), "eta must be a finite number > 0"),
    (dict(eta=-0.1), "eta must be a finite number > 0"),
    (dict(smoothness=-1.0), "smoothness L must be a finite number > 0"),
    (dict(strong_convexity=0.0), "strong_convexity c must be a finite number > 0"),
    (dict(gradient_variance=-1.0), "gradient_variance sigma\\^2 must be a finite number >= 0"),
    (dict(k=0), "k must be an integer >= 1"),
    (dict(k=True), "k must be an integer >= 1"),
    (dict(batch_size=2.5), "batch_size m must be an integer >= 1"),
])
def test_each_bound_argument_is_checked(change, message):
    with pytest.raises(ValueError, match=message):
        sync_error_bound(1, **{**BOUND, "k": 1, "initial_gap": 1.0, **change})


def test_iteration_counts_may_be_fractional_or_arrays_but_finite():
    rate = BOUND["eta"] * BOUND["strong_convexity"]
    floor = sync_error_floor(k=1, **BOUND)
    half = sync_error_bound(0.5, k=1, initial_gap=3.0, **BOUND)
    assert type(half) is float and half == pytest.approx(floor + (1 - rate) ** 0.5 * (3.0 - floor))
    many = sync_error_bound([[0, 1], [2, 3]], k=1, initial_gap=3.0, **BOUND)
    assert isinstance(many, np.ndarray) and many.shape == (2, 2)
    assert many[1, 1] == pytest.approx(floor + (1 - rate) ** 3 * (3.0 - floor))
    for bad in (float("nan"), float("inf"), [1.0, -0.5]):
        with pytest.raises(ValueError, match="iteration count j must be finite and >= 0"):
            sync_error_bound(bad, k=1, initial_gap=3.0, **BOUND)


@pytest.mark.parametrize("gamma,p0,message", [
    (-0.1, 0.5, "gamma must be a finite number >= 0"),
    (0.5, -0.01, "p0 is a probability"),
    (0.5, 1.01, "p0 is a probability"),
    (1.0, 0.0, "gamma' = 1 - gamma \\+ p0/2 = 0.0 must be > 0"),
])
def test_bad_gamma_and_p0_are_refused(gamma, p0, message):
    with pytest.raises(ValueError, match=message):
        async_error_bound(1, k=1, initial_gap=1.0, gamma=gamma, p0=p0, **BOUND)


def test_gamma_zero_and_p0_at_its_ends_are_allowed():
    # gamma' = 1 - gamma + p0 / 2: 1 at (0, 0), 0.5 at (1, 1)
    sync = sync_error_floor(k=1, **BOUND)
    assert async_error_floor(k=1, gamma=0.0, p0=0.0, **BOUND) == pytest.approx(sync)
    assert async_error_floor(k=1, gamma=1.0, p0=1.0, **BOUND) == pytest.approx(sync / 0.5)


def test_error_against_time_with_gamma_and_p0_is_the_async_bound():
    e_t = 0.4
    args = dict(k=2, initial_gap=3.0, **BOUND)
    by_time = error_against_time([0.0, 2.0], e_t, gamma=0.6, p0=0.4, **args)
    assert by_time[1] == pytest.approx(async_error_bound(2.0 / e_t, gamma=0.6, p0=0.4, **args), rel=1e-12)
    assert by_time[1] != pytest.approx(sync_error_bound(2.0 / e_t, **args), rel=1e-6)
    with pytest.raises(ValueError, match="both gamma and p0"):
        error_against_time(1.0, e_t, p0=0.4, **args)
    with pytest.raises(ValueError, match="expected_time E\\[T\\] must be a finite number > 0"):
        error_against_time(1.0, 0.0, **args)


# ---------------------------------------------------------------- E[T] with local updates (method/local.py)
# For H = 2 mini-batches per push of rate-1 exponentials, S ~ Erlang(2, 1), F(t) = 1 - e^-t (1 + t).
# Of two learners, E[max S] = int (1 - F^2) = 2 * 2 - int e^-2t (1 + t)^2 dt = 4 - 5/4 = 11/4 and
# E[min S] = int (1 - F)^2 = 5/4 (their sum is 2 E[S] = 4); with mean m each scales by m.
ERLANG_MAX_2, ERLANG_MIN_2 = 11 / 4, 5 / 4


def test_erlang_order_statistics_of_two_learners_by_hand():
    assert erlang_order_statistic_mean(2, 2, 2, 1.0) == pytest.approx(ERLANG_MAX_2, rel=1e-9)
    assert erlang_order_statistic_mean(1, 2, 2, 1.0) == pytest.approx(ERLANG_MIN_2, rel=1e-9)
    assert erlang_order_statistic_mean(2, 2, 2, 4.0) == pytest.approx(ERLANG_MAX_2 / 4, rel=1e-9)
    # H = 1 is the paper's (H_P - H_{P-K}) / rate
    assert erlang_order_statistic_mean(3, P, 1, 2.0) == pytest.approx((harmonic(P) - harmonic(P - 3)) / 2.0, rel=1e-9)


@pytest.mark.parametrize("k,p,h,rate,message", [
    (0, 2, 2, 1.0, "1 <= k <= p"), (3, 2, 2, 1.0, "1 <= k <= p"), (1.0, 2, 2, 1.0, "1 <= k <= p"),
    (1, 2.0, 2, 1.0, "1 <= k <= p"), (1, 2, 0, 1.0, "local_steps must be an integer >= 1"),
    (1, 2, 2, 0.0, "rate must be a finite number > 0"), (1, 2, 2, float("inf"), "rate must be"),
    (1, 2, 2, float("nan"), "rate must be"),
])
def test_erlang_order_statistic_refuses_bad_arguments(k, p, h, rate, message):
    with pytest.raises(ValueError, match=message):
        erlang_order_statistic_mean(k, p, h, rate)


# Two learners, H = 2, mean m = 0.5, shift d = 0.25: S = H d + Erlang(H, 1 / m).
LOCAL_TABLE = [
    ("sync", None, 2 * SHIFT + ERLANG_MAX_2 * MEAN),
    ("k_sync", 1, 2 * SHIFT + ERLANG_MIN_2 * MEAN),
    ("k_async", 2, 2 * SHIFT + ERLANG_MAX_2 * MEAN),
    ("k_batch_sync", 1, 2 * SHIFT + ERLANG_MIN_2 * MEAN),
    ("async", None, 2 * (SHIFT + MEAN) / 2),            # K H (d + m) / P
    ("k_async", 1, 2 * (SHIFT + MEAN) / 2),
    ("k_batch_async", 2, 2 * 2 * (SHIFT + MEAN) / 2),
]


@pytest.mark.parametrize("name,k,expected", LOCAL_TABLE, ids=[f"{n}-K{k}" for n, k, _ in LOCAL_TABLE])
def test_every_local_update_closed_form(name, k, expected):
    variant = Variant.create(name, 2, k)
    assert closed_form_local_update_time(variant, SHIFTED_HALF, 2) == pytest.approx(expected, rel=1e-9)
    assert expected_local_update_time(name, 2, k, SHIFTED_HALF, local_steps=2, updates=1) == \
        pytest.approx(expected, rel=1e-9)
    # one local step is the paper's table
    assert closed_form_local_update_time(variant, SHIFTED_HALF, 1) == closed_form_iteration_time(variant, SHIFTED_HALF)


def test_no_local_update_closed_form_without_memorylessness():
    with pytest.raises(ValueError, match="not memoryless"):
        closed_form_local_update_time(Variant.create("k_batch_sync", 2, 2), SHIFTED_HALF, 2)
    with pytest.raises(ValueError, match="not memoryless"):
        closed_form_local_update_time(Variant.create("k_async", 3, 2), EXP_HALF, 2)
    with pytest.raises(ValueError, match="no closed form"):
        closed_form_local_update_time(Variant.create("async", 2), Constant(1.0), 2)
    with pytest.raises(ValueError, match="local_steps must be an integer >= 1"):
        closed_form_local_update_time(Variant.create("async", 2), EXP_HALF, 0)


def test_local_updates_on_the_clock_with_constant_delays():
    """Each push takes H d: sync updates every H d; async takes P updates at each multiple."""
    d, h = 0.5, 3
    times = monte_carlo_local_update_times("sync", 2, delay=Constant(d), local_steps=h, updates=5)
    assert times.tolist() == [h * d] * 5
    times = monte_carlo_local_update_times("async", 2, delay=Constant(d), local_steps=h, updates=4)
    assert times.tolist() == [h * d, 0.0, h * d, 0.0]
    # "auto" without a closed form runs the clock with the pushes after H mini-batches
    # (default warm-up for P = 2 and 100 updates: 10, whole rounds of 2)
    assert expected_local_update_time("async", 2, delay=Constant(d), local_steps=h, updates=100) == \
        pytest.approx(h * d / 2)
    # K-batch-sync with K = P = 2: both pushes at H d make the update
    assert expected_local_update_time("k_batch_sync", 2, 2, Constant(d), local_steps=h, updates=20,
                                      method="monte_carlo") == pytest.approx(h * d)


def test_local_update_defaults_and_seeds():
    own_seed = Exponential(1.0, seed=3)
    default = monte_carlo_local_update_times("k_async", 3, 2, own_seed, local_steps=2, updates=100)
    assert default.tolist() == monte_carlo_local_update_times("k_async", 3, 2, own_seed, local_steps=2,
                                                              updates=100, seed=0).tolist()
    assert default.tolist() != monte_carlo_local_update_times("k_async", 3, 2, own_seed, local_steps=2,
                                                              updates=100, seed=None).tolist()
    assert monte_carlo_local_update_times("k_async", 3, 2, local_steps=2, updates=100).tolist() == \
        monte_carlo_local_update_times("k_async", 3, 2, Exponential(1.0), local_steps=2, updates=100).tolist()
    assert len(monte_carlo_local_update_times("k_async", 3, 2, local_steps=2)) == 20000
    # local_steps defaults to 1: the paper's clock
    assert monte_carlo_local_update_times("k_async", 3, 2, updates=50).tolist() == \
        monte_carlo_iteration_times("k_async", 3, 2, updates=50).tolist()
    assert expected_local_update_time("k_async", 3, 2) == pytest.approx(harmonic(3) - harmonic(1))
    assert expected_local_update_time("k_async", 3, 2, own_seed, local_steps=2, method="monte_carlo",
                                      updates=100) == \
        expected_local_update_time("k_async", 3, 2, Exponential(1.0, seed=8), local_steps=2,
                                   method="monte_carlo", updates=100, warmup=15, seed=0)


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "2", None])
def test_bad_local_steps_are_refused_by_the_theory(value):
    with pytest.raises(ValueError, match=f"local_steps must be an integer >= 1.*{re.escape(repr(value))}"):
        expected_local_update_time("async", 2, local_steps=value)
    with pytest.raises(ValueError, match="local_steps must be an integer >= 1"):
        monte_carlo_local_update_times("async", 2, local_steps=value, updates=5)


def test_local_steps_of_numpy_integers_are_plain_ints():
    assert check_local_steps(np.int64(3)) == 3 and type(check_local_steps(np.int64(3))) is int


def test_bad_methods_are_refused():
    with pytest.raises(ValueError, match="method must be one of auto, closed_form, monte_carlo, got 'exact'"):
        expected_local_update_time("async", 2, method="exact")
    with pytest.raises(ValueError, match="no closed form"):
        expected_local_update_time("k_batch_sync", 2, 2, local_steps=2, method="closed_form")


def test_twenty_thousand_updates_by_default():
    """The default run: 20,000 updates. With constant delays d, async takes P = 4 updates at
    each multiple of d, and the default warm-up (20,000 // 20 = 1,000 updates) is whole rounds,
    so the estimate is d / P exactly (one update more or less would not be)."""
    d = 0.5
    assert len(monte_carlo_iteration_times("async", P, delay=Constant(d))) == 20000
    assert expected_iteration_time("async", P, delay=Constant(d)) == pytest.approx(d / P, rel=1e-12)
    h = 3  # and with local steps: two learners, pushes every H d
    assert expected_local_update_time("async", 2, delay=Constant(d), local_steps=h) == pytest.approx(h * d / 2, rel=1e-12)


def test_times_of_a_narrow_float_dtype_are_divided_in_double_precision():
    """j = t / E[T] in float64 whatever the dtype of t: times read as float32 (from a log, a
    tensor) give the bound of the same times in float64, not of a j rounded to float32."""
    e_t = 0.3
    args = dict(k=2, initial_gap=3.0, **BOUND)
    times = [1.0, 10.0, 25.0]
    narrow = error_against_time(np.asarray(times, dtype=np.float32), e_t, **args)
    assert narrow.tolist() == pytest.approx(error_against_time(times, e_t, **args), rel=1e-13)


def test_iteration_counts_of_a_narrow_float_dtype_give_a_double_precision_bound():
    # j = 1.5 and 10.25 are exact in float32: only the power and the sums could lose precision
    j = [1.5, 10.25]
    narrow = sync_error_bound(np.asarray(j, dtype=np.float32), k=1, initial_gap=3.0, **BOUND)
    assert narrow.dtype == np.float64
    assert narrow.tolist() == pytest.approx(sync_error_bound(j, k=1, initial_gap=3.0, **BOUND), rel=1e-13)


def test_a_name_p_and_k_are_the_variant_they_name():
    """K given with a variant's name is used (not the default K, P / 2), by every entry point."""
    variant, delay = Variant.create("k_sync", P, 3), Exponential(1.0)
    assert Variant.create("k_sync", P).k != 3
    runs = dict(updates=60, seed=2)
    assert monte_carlo_iteration_times("k_sync", P, 3, delay, **runs).tolist() == \
        monte_carlo_iteration_times(variant, delay=delay, **runs).tolist()
    assert expected_iteration_time("k_sync", P, 3, delay, method="monte_carlo", **runs) == \
        expected_iteration_time(variant, delay=delay, method="monte_carlo", **runs)
    assert monte_carlo_local_update_times("k_sync", P, 3, delay, local_steps=2, **runs).tolist() == \
        monte_carlo_local_update_times(variant, delay=delay, local_steps=2, **runs).tolist()
    assert expected_local_update_time("k_sync", P, 3, delay, local_steps=2, method="monte_carlo", **runs) == \
        expected_local_update_time(variant, delay=delay, local_steps=2, method="monte_carlo", **runs)
    assert expected_local_update_time("k_sync", P, 3, EXP_HALF, local_steps=1) == pytest.approx(_order_statistic(3, 0.0))


def test_a_warmup_given_with_local_steps_is_used():
    """Constant delays of d = 0.5 s, H = 3, two async learners: updates 2i - 1 and 2i both come at
    i H d. After a warm-up of 1 update the estimate is (t_10 - t_1) / 9 = (7.5 - 1.5) / 9."""
    estimate = expected_local_update_time("async", 2, delay=Constant(0.5), local_steps=3, updates=10,
                                          warmup=1, method="monte_carlo")
    assert estimate == pytest.approx((7.5 - 1.5) / 9)
