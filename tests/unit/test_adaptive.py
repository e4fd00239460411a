"""AdaptiveK: K_l = ceil(K_0 sqrt(F(w_0) / F(w_{l T0}))), capped at P, never decreasing."""

import logging
import math

import pytest
import torch
from pytorch_lightning import Trainer

from lightning_stale.method.adaptive import AdaptiveH, AdaptiveK
from lightning_stale.strategies.callbacks import WallClockLogger
from lightning_stale.data import DigitsDataModule
from lightning_stale.delays import Exponential
from lightning_stale.models import Classifier
from lightning_stale.models.nets import MLP
from lightning_stale.strategies.simulated import SimulatedStaleStrategy

logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)


def test_follows_the_square_root_rule_on_hand_fed_losses():
    schedule = AdaptiveK(k0=1, interval_s=1.0, max_k=4, window=1)
    assert schedule.observe(0.5, 4.0) is None  # F(w_0) = 4, no boundary yet
    assert schedule.observe(1.0, 1.0) == 2  # ceil(1 * sqrt(4 / 1)) = 2 (exact: no rounding up)
    assert schedule.observe(1.5, 0.5) is None  # inside interval 1
    assert schedule.observe(2.2, 0.25) == 4  # ceil(sqrt(16)) = 4
    assert schedule.observe(3.1, 0.01) is None  # sqrt(400) = 20, capped at 4: no growth
    assert schedule.observe(4.0, 10.0) is None  # the loss rose: K never decreases
    assert schedule.k == 4
    assert schedule.history == [(0.0, 1), (1.0, 2), (2.2, 4)]


def test_uses_a_running_mean_of_recent_losses():
    schedule = AdaptiveK(k0=2, interval_s=10.0, window=2)
    schedule.limit(16)
    for time_s, loss in [(1, 9.0), (2, 7.0), (3, 3.0)]:
        assert schedule.observe(time_s, loss) is None
    assert schedule.initial_loss == 8.0  # mean of the first `window` losses
    # at the boundary the estimate is mean(3, 1) = 2: ceil(2 * sqrt(8 / 2)) = 4
    assert schedule.observe(10.5, 1.0) == 4
    assert schedule.current_loss == 2.0


def test_several_intervals_passed_count_as_one_boundary():
    schedule = AdaptiveK(k0=1, interval_s=1.0, max_k=8, window=1)
    schedule.observe(0.1, 9.0)
    assert schedule.observe(5.5, 1.0) == 3  # ceil(sqrt(9))
    assert schedule.observe(5.9, 0.01) is None  # same interval as 5.5: next boundary is 6
    assert schedule.observe(6.0, 0.01) == 8


def test_never_exceeds_the_cap_and_only_grows():
    schedule = AdaptiveK(k0=1, interval_s=0.5, window=3)
    schedule.limit(5)
    ks = [schedule.k]
    for step in range(200):
        loss = 10.0 * math.exp(-step / 20) * (1.5 if step % 7 == 0 else 1.0)
        schedule.observe(step * 0.1, loss)
        ks.append(schedule.k)
    assert max(ks) == 5 and ks == sorted(ks)


def test_ignores_non_finite_losses_and_jumps_to_the_cap_at_zero_loss():
    schedule = AdaptiveK(k0=1, interval_s=1.0, max_k=3, window=1)
    schedule.observe(0.0, 1.0)
    assert schedule.observe(1.0, float("nan")) is None and schedule.k == 1
    assert schedule.observe(1.1, 0.0) == 3


@pytest.mark.parametrize("kwargs,message", [
    (dict(k0=0, interval_s=1.0), "k0 must be an integer >= 1"),
    (dict(k0=1, interval_s=0.0), "interval_s must be a finite number > 0"),
    (dict(k0=3, interval_s=1.0, max_k=2), "max_k=2 is below k0=3"),
    (dict(k0=1, interval_s=1.0, window=0), "window must be an integer >= 1"),
])
def test_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdaptiveK(**kwargs)


def test_limit_and_create():
    with pytest.raises(ValueError, match="k0=5 exceeds the number of learners P=4"):
        AdaptiveK(5, 1.0).limit(4)
    schedule = AdaptiveK(1, 1.0, max_k=8)
    schedule.limit(4)
    assert schedule.max_k == 4
    assert AdaptiveK.create(2.5, k0=2).interval_s == 2.5
    assert AdaptiveK.create({"interval_s": 3.0, "window": 4}, k0=2).k0 == 2
    assert AdaptiveK.create(None, k0=1) is None
    with pytest.raises(ValueError, match="adaptive_k must be"):
        AdaptiveK.create("fast", k0=1)


def test_simulated_strategy_logs_a_growing_k():
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = Classifier(net=MLP((64,), 10, (32,)), lr=0.5)
        schedule = AdaptiveK(k0=1, interval_s=2.0, window=5)
        strategy = SimulatedStaleStrategy("k_async", delay=Exponential(1.0, seed=0), num_learners=4,
                                          adaptive_k=schedule)
        logger = WallClockLogger()
        trainer = Trainer(strategy=strategy, max_steps=120, callbacks=[logger], logger=False,
                          enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, limit_val_batches=0, devices=1)
        trainer.fit(model, datamodule=DigitsDataModule(batch_size=32))
    finally:
        torch.set_num_threads(threads)
    ks = [int(row["k"]) for row in logger.rows]
    assert len(ks) == 120 and ks[0] == 1
    assert ks == sorted(ks) and max(ks) <= 4 and ks[-1] > 1  # grows, never past P
    history = strategy.stats["k_history"]
    assert [k for _, k in history] == sorted(set(ks))
    assert schedule.history == [(0.0, 1)]  # the caller's object is left untouched
    with pytest.raises(ValueError, match="k=2 disagrees with adaptive_k's k0=1"):
        SimulatedStaleStrategy("k_async", k=2, adaptive_k=schedule)


def test_limit_caps_k_at_p_learners_and_refuses_a_k0_above_p():
    # the engine's P caps K: a max_k above P is lowered to P, one below P stays
    given_none, above, below = AdaptiveK(2, 1.0), AdaptiveK(2, 1.0, max_k=6), AdaptiveK(2, 1.0, max_k=3)
    for schedule in (given_none, above, below):
        schedule.limit(4)
    assert (given_none.max_k, above.max_k, below.max_k) == (4, 4, 3)
    assert below.target_k(100.0, 1.0) == 3 and given_none.target_k(100.0, 1.0) == 4
    single = AdaptiveK(1, 1.0)
    single.limit(1)  # one learner: K stays 1
    assert single.max_k == 1 and single.target_k(100.0, 1.0) == 1
    equal = AdaptiveK(3, 1.0)
    equal.limit(3)  # K_0 = P is allowed
    assert equal.max_k == 3
    with pytest.raises(ValueError, match=r"AdaptiveK k0=3 exceeds the number of learners P=2"):
        AdaptiveK(3, 1.0).limit(2)
    with pytest.raises(ValueError, match=r"^the number of learners P must be an integer >= 1, got 0$"):
        AdaptiveK(1, 1.0).limit(0)


def test_target_k_without_a_cap_is_k0_times_the_square_root_of_the_loss_ratio():
    schedule = AdaptiveK(2, 1.0)  # no max_k, no limit: nothing caps K
    assert schedule.max_k is None
    assert schedule.target_k(9.0, 1.0) == 6 and schedule.target_k(100.0, 1.0) == 20


def test_target_k_at_a_loss_of_zero_or_below_an_initial_loss_below_one():
    schedule = AdaptiveK(2, 1.0)
    assert schedule.target_k(1.0, 0.0) == 2  # no cap and F(w) = 0: K stays where it is
    schedule.limit(4)
    assert schedule.target_k(1.0, 0.0) == 4  # with P known: as far as K goes
    assert schedule.target_k(0.25, 0.25) == 2  # the ratio, not the losses, sets K
    assert schedule.target_k(0.09, 0.01) == 4 and schedule.target_k(-1.0, 0.5) == 1


def test_observe_moves_to_the_boundary_after_the_interval_that_time_falls_in():
    schedule = AdaptiveK(1, 2.0, window=1)  # T0 = 2 s; F(w_0) is the first loss
    assert schedule.observe(0.5, 4.0) is None  # before the first boundary (2 s)
    assert schedule.observe(5.0, 1.0) == 2  # two boundaries passed: the next is 6 s
    assert schedule.observe(5.9, 0.25) is None  # still in the interval [4, 6)
    assert schedule.observe(6.0, 0.25) == 4
    assert schedule.history == [(0.0, 1), (5.0, 2), (6.0, 4)]


@pytest.mark.parametrize("bad", [0, True, 1.5, "2"])
def test_adaptive_k_refuses_a_k0_that_is_not_an_integer_of_at_least_one(bad):
    with pytest.raises(ValueError, match=rf"^AdaptiveK k0 must be an integer >= 1, got {bad!r}$"):
        AdaptiveK(bad, 1.0)


def test_the_running_mean_of_f_spans_ten_updates_by_default():
    schedule = AdaptiveK(1, 100.0)
    assert schedule.window == 10
    for loss in range(1, 13):  # 1 .. 12: the last ten are 3 .. 12
        schedule.observe(0.0, float(loss))
    assert schedule.current_loss == pytest.approx(7.5) and schedule.initial_loss == pytest.approx(5.5)


@pytest.mark.parametrize("name,kwargs,message", [
    ("max_k", dict(k0=1, max_k=0), "AdaptiveK max_k must be an integer >= 1, got 0"),
    ("max_k", dict(k0=2, max_k=1), "AdaptiveK max_k=1 is below k0=2"),
    ("window", dict(k0=1, window=0), "AdaptiveK window must be an integer >= 1, got 0")])
def test_adaptive_k_refuses_a_max_k_or_window_out_of_range(name, kwargs, message):
    with pytest.raises(ValueError, match=rf"^{message}$"):
        AdaptiveK(interval_s=1.0, **kwargs)


def test_max_k_may_equal_k0_and_k_never_falls_below_one():
    pinned = AdaptiveK(1, 1.0, max_k=1)  # K fixed at 1: allowed
    assert pinned.max_k == 1 and pinned.target_k(100.0, 1.0) == 1
    assert AdaptiveK(1, 1.0).target_k(1.0, 4.0) == 1  # the loss grew: ceil(sqrt(1/4)) = 1


def test_adaptive_h_is_made_from_every_form_it_accepts_with_local_steps_as_h0():
    given = AdaptiveH(8, 2.0)
    assert AdaptiveH.create(given, h0=8) is given and AdaptiveH.create(None, h0=8) is None
    number = AdaptiveH.create(3, h0=8)
    assert (number.h0, number.interval_s, number.h) == (8, 3.0, 8)
    mapping = AdaptiveH.create({"interval_s": 1.5, "window": 4}, h0=6)
    assert (mapping.h0, mapping.interval_s, mapping.window) == (6, 1.5, 4)
    with pytest.raises(ValueError, match="local_steps=8 disagrees with adaptive_h's h0=4"):
        AdaptiveH.create(AdaptiveH(4, 2.0), h0=8)
    for bad in ("2", True, [2.0]):
        with pytest.raises(ValueError, match="adaptive_h must be None, an AdaptiveH"):
            AdaptiveH.create(bad, h0=8)


def test_adaptive_h_names_its_bad_arguments_and_keeps_h_where_the_ratio_is_undefined():
    with pytest.raises(ValueError, match=r"AdaptiveH h0 \(local_steps\) must be an integer >= 1, got 0"):
        AdaptiveH(0, 1.0)
    with pytest.raises(ValueError, match=r"AdaptiveH window must be an integer >= 1, got 0"):
        AdaptiveH(4, 1.0, window=0)
    schedule = AdaptiveH(8, 1.0)
    assert schedule.target_h(0.0, 0.0) == 1  # the loss is 0: average at every step
    assert schedule.target_h(0.0, 1.0) == 8  # no ratio to a start of 0: H stays as it is
