"""Staleness compensation weights (Zhang et al. 2016; Dutta, Wang, Joshi arXiv 2003.10579)."""

import logging

import numpy as np
import pytest
import torch
from pytorch_lightning import Trainer

from lightning_stale.strategies.callbacks import WallClockLogger
from lightning_stale.method.compensation import StalenessCompensation, inverse_staleness, norm_adaptive
from lightning_stale.data import DigitsDataModule
from lightning_stale.delays import Exponential
from lightning_stale.models import Classifier
from lightning_stale.models.nets import MLP
from lightning_stale.method.rules import Push, Update
from lightning_stale.strategies.simulated import SimulatedStaleStrategy

logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)


def test_inverse_staleness():
    assert [inverse_staleness(s) for s in (0, 1, 2, 4)] == [1.0, 1.0, 0.5, 0.25]
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        inverse_staleness(-1)


def test_norm_adaptive():
    # eta_j = min(C / ||w_j - w_tau||^2, eta_max), as a ratio to eta = 0.1
    assert norm_adaptive(0.0, c=1.0, eta_max=0.2, eta=0.1) == pytest.approx(2.0)  # fresh
    assert norm_adaptive(100.0, c=1.0, eta_max=0.2, eta=0.1) == pytest.approx(0.1)  # 0.01 / 0.1
    assert norm_adaptive(4.0, c=1.0, eta_max=0.2, eta=0.1) == pytest.approx(2.0)  # capped
    with pytest.raises(ValueError, match="need c, eta_max and eta > 0"):
        norm_adaptive(1.0, c=0.0, eta_max=0.1, eta=0.1)


def hand_built_update():
    # Three gradients at versions 5 (fresh), 3 and 1 of an update from version 5 to 6.
    pushes = (Push(0, learner=0, version=5), Push(1, learner=1, version=3),
              Push(2, learner=2, version=1))
    return Update(index=6, version=6, gradients=pushes, staleness=(0, 2, 4))


def test_inverse_weights_of_an_update():
    weights = StalenessCompensation("inverse").weights(hand_built_update())
    assert weights == [1.0, 0.5, 0.25]


def test_norm_weights_of_an_update():
    params = {5: torch.tensor([1.0, 1.0]), 3: torch.tensor([1.0, 0.0]),
              1: torch.tensor([-1.0, 1.0])}
    compensation = StalenessCompensation("norm", c=0.05)
    # distances^2 from w_5: 0, 1, 4 -> steps min(0.05 / d^2, eta_max = eta = 0.1)
    weights = compensation.weights(hand_built_update(), params[5], params, lr=0.1)
    assert weights == pytest.approx([1.0, 0.5, 0.125])
    # a callable lookup works the same, with numpy arrays too
    numpy_params = {v: p.numpy() for v, p in params.items()}
    assert compensation.weights(hand_built_update(), numpy_params[5], numpy_params.get, lr=0.1) == \
        pytest.approx([1.0, 0.5, 0.125])
    with pytest.raises(ValueError, match="needs the current parameters"):
        compensation.weights(hand_built_update())


@pytest.mark.parametrize("spec,message", [
    ("sqrt", "unknown staleness compensation 'sqrt'"),
    ({"mode": "norm"}, "needs c > 0"),
    ({"mode": "norm", "c": 1.0, "eta_max": -1.0}, "eta_max must be > 0"),
    (3, "unknown staleness compensation 3"),
])
def test_rejects_bad_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        StalenessCompensation.create(spec)


@pytest.mark.parametrize("spec", ["inverse", {"mode": "norm", "c": 0.5}])
def test_simulated_run_with_compensation_converges_on_digits(spec):
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        strategy = SimulatedStaleStrategy("k_batch_async", k=2, delay=Exponential(1.0, seed=0),
                                          num_learners=8, staleness_compensation=spec)
        logger = WallClockLogger()
        trainer = Trainer(strategy=strategy, max_steps=80, callbacks=[logger], logger=False,
                          enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, limit_val_batches=0, devices=1)
        trainer.fit(Classifier(net=MLP((64,), 10, (32,)), lr=0.5),
                    datamodule=DigitsDataModule(batch_size=32))
    finally:
        torch.set_num_threads(threads)
    assert max(strategy.stats["staleness_histogram"]) > 1  # stale gradients were down-weighted
    losses = [row["train/loss"] for row in logger.rows]
    assert np.mean(losses[-10:]) < 0.7 * np.mean(losses[:10])


def test_the_compensations_repr_names_its_mode_and_settings():
    inverse = StalenessCompensation()  # the default rule: 1 / max(1, s)
    norm = StalenessCompensation("norm", c=0.5, eta_max=0.25)
    assert repr(inverse) == "StalenessCompensation(mode='inverse')"
    assert repr(norm) == "StalenessCompensation(mode='norm', c=0.5, eta_max=0.25)"
    assert repr(eval(repr(norm))) == repr(norm)  # noqa: S307 (it reads back as the same object)


@pytest.mark.parametrize("c,eta_max,eta", [(0.0, 0.1, 0.1), (1.0, 0.0, 0.1), (1.0, 0.1, 0.0), (-1.0, 0.1, 0.1)])
def test_norm_adaptive_needs_every_constant_above_zero(c, eta_max, eta):
    with pytest.raises(ValueError, match=rf"need c, eta_max and eta > 0, got c={c}, eta_max={eta_max}, eta={eta}"):
        norm_adaptive(1.0, c=c, eta_max=eta_max, eta=eta)


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_norm_adaptive_refuses_a_negative_or_nan_distance(bad):
    with pytest.raises(ValueError, match=r"distance_sq must be a number >= 0"):
        norm_adaptive(bad, c=1.0, eta_max=0.1, eta=0.1)


def test_norm_weights_cap_fresh_gradients_at_the_eta_max_given():
    params = {5: torch.tensor([1.0, 1.0]), 3: torch.tensor([1.0, 0.0]), 1: torch.tensor([-1.0, 1.0])}
    compensation = StalenessCompensation("norm", c=0.05, eta_max=0.5)
    assert compensation.eta_max == 0.5
    # distances^2 0, 1, 4 -> steps min(0.05 / d^2, 0.5): the fresh one gets eta_max, not eta
    weights = compensation.weights(hand_built_update(), params[5], params, lr=0.1)
    assert weights == pytest.approx([5.0, 0.5, 0.125])
    for missing in ("current_params", "params_at", "lr"):
        given = dict(current_params=params[5], params_at=params, lr=0.1)
        with pytest.raises(ValueError, match="needs the current parameters, the parameters at each"):
            compensation.weights(hand_built_update(), **{**given, missing: None})


@pytest.mark.parametrize("kwargs,message", [
    (dict(c=None), "staleness compensation 'norm' needs c > 0, got c=None"),
    (dict(c=0.0), "staleness compensation 'norm' needs c > 0, got c=0.0"),
    (dict(c=1.0, eta_max=0.0), "eta_max must be > 0, got 0.0")])
def test_norm_compensation_refuses_c_or_eta_max_at_or_below_zero(kwargs, message):
    with pytest.raises(ValueError, match=rf"^{message}$"):
        StalenessCompensation("norm", **kwargs)
