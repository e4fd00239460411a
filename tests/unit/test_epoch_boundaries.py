"""Epoch ends cost nothing the paper's model does not count (README, "Epochs").

An epoch end is a pause of the clock, not a restart of the learners: a computation in flight
carries into the next epoch, and nothing is flushed. So a data set whose epoch is not a whole
number of rounds (Lightning's BoringModel: 64 mini-batches, 12.8 rounds of P = 5) keeps the
paper's time per update, E[T] of docs/method.md, for every variant.

Each test ties the two exactly, then checks the mean: the strategy's update times, across many
epoch ends, are the stand-alone event simulation's (`VirtualCluster`, which knows no epochs)
with the same delays, update for update; that simulation, continued for thousands of updates,
keeps E[T]. A flush or restart at an epoch end would change the strategy's times from the
first epoch end on.
"""

import logging

import pytest
import torch
from pytorch_lightning import Trainer
from pytorch_lightning.demos.boring_classes import BoringModel
from torch.utils.data import DataLoader

from lightning_stale.delays import Exponential
from lightning_stale.method.rules import ServerRules
from lightning_stale.method.theory import expected_iteration_time
from lightning_stale.method.variants import Variant
from lightning_stale.method.virtual_clock import VirtualCluster
from lightning_stale.strategies.callbacks import WallClockLogger
from lightning_stale.strategies.simulated import SimulatedStaleStrategy

logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
P, MEAN = 5, 0.1




class ShortEpochs(BoringModel):
    """BoringModel with 7 mini-batches an epoch: one full round of P = 5 and 2/5 of the next."""

    def train_dataloader(self):
        return DataLoader(torch.utils.data.Subset(super().train_dataloader().dataset, range(7)), batch_size=1)


def cluster_times(variant, k, updates, seed):
    """The update times of the event simulation of the same rules and delays."""
    cluster = VirtualCluster(ServerRules(Variant.create(variant, P, k)), Exponential(MEAN, seed=seed))
    times = []
    while len(times) < updates:
        if cluster.step().update is not None:
            times.append(cluster.now)
    return times


def interval_against_theory(module, variant, k, trained, updates, seed=0):
    """Trains `trained` updates with the strategy, checks they are the event simulation's, and
    returns the strategy's stats and the simulation's mean time per update over `updates`
    updates against E[T]."""
    strategy = SimulatedStaleStrategy(variant=variant, k=k, num_learners=P, delay=Exponential(MEAN, seed=seed))
    clock = WallClockLogger()
    trainer = Trainer(strategy=strategy, max_steps=trained, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      devices=1, limit_val_batches=0, callbacks=[clock])
    trainer.fit(module)
    times = cluster_times(variant, k, updates, seed)
    assert [row["time/train_s"] for row in clock.rows] == times[:trained]  # epoch ends: pauses only
    assert strategy.stats["mean_update_interval_s"] == pytest.approx(times[trained - 1] / trained)
    theory = expected_iteration_time(variant, P, strategy.variant.k, Exponential(MEAN), method="closed_form")
    return strategy.stats, times[-1] / updates / theory


# 3,000 updates per variant (Async: 15,000, the pushes of 3,000 Fully sync updates, since one
# push is one update and T's coefficient of variation is 1 there). The standard error of the
# mean is about 1% for every case, so 2% is a check at about 2 standard errors for this seed.
# The strategy trains the first 300-1,200 of them: a dozen epoch ends or more.
# The short data set ends an epoch every 1.4 rounds, where a flush would show most.
@pytest.mark.slow
@pytest.mark.parametrize("variant,k,trained,updates", [
    ("sync", None, 300, 3000), ("k_sync", 3, 400, 3000), ("k_batch_sync", 3, 400, 3000),
    ("async", None, 1200, 15000), ("k_async", 3, 400, 3000), ("k_batch_async", 3, 400, 3000)])
def test_boring_models_64_batch_epochs_keep_the_theorys_time_per_update(variant, k, trained, updates):
    stats, ratio = interval_against_theory(BoringModel(), variant, k, trained, updates)
    assert stats["epochs"] >= 12  # many epoch ends, each within a round
    assert stats["gradients_dropped"] == 0  # an epoch end drops nothing: work carries over
    assert ratio == pytest.approx(1.0, abs=0.02)


@pytest.mark.slow
def test_an_epoch_of_little_more_than_one_round_keeps_the_theorys_time_per_update():
    stats, ratio = interval_against_theory(ShortEpochs(), "sync", None, trained=300, updates=1500, seed=1)
    assert stats["epochs"] >= 200
    assert stats["gradients_dropped"] == 0
    assert ratio == pytest.approx(1.0, abs=0.03)
