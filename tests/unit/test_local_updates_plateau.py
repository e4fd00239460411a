"""``ReduceLROnPlateau`` as the inner optimizer's schedule with local updates on the real engine
(docs/how-to/local-updates.md, "On the real engine"): at every server epoch's end each learner
steps its own plateau scheduler on rank 0's value of the monitored metric, handed to it by the
server when training goes on, so the learners' learning rates stay equal, as every DDP rank's do
when it steps on the metric logged with ``sync_dist=True``. Checked on real learners in one
process (tests/inprocess.py) whose logged values differ, and through Lightning against the
simulated engine."""

from itertools import groupby

import pytest
import torch
from pytorch_lightning.utilities.exceptions import MisconfigurationException

import user_modules as um
from inprocess import InProcessRun, blob_batches
from lightning_stale import StaleStrategy
from test_local_updates_real import NESTEROV, OneSampleData, RecordingLogger, _lightning_fit

LR, FACTOR = 0.05, 0.5
# What each learner logged as "val/loss" at the end of epochs 0, 1, 2, ...: rank 0's value
# improves at some ends and not at others; the other learners' do so at other ends.
LOGGED = {0: [1.0, 1.2, 0.9, 1.0, 0.8, 0.85, 0.7, 0.75],
          1: [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3],
          2: [1.0, 0.5, 0.6, 0.4, 0.45, 0.3, 0.35, 0.2]}


class InnerPlateauClassifier(um.Classifier):
    """SGD whose rate halves when ``val/loss`` did not improve at an epoch's end (patience 0)."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=LR)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=FACTOR, patience=0)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": plateau, "monitor": "val/loss", "interval": "epoch"}}


def plateau_lrs(values: list[float]) -> list[float]:
    """By hand, ``ReduceLROnPlateau(mode="min", patience=0)``'s default rule (relative threshold
    1e-4): the rate after each of ``values``, halved at every value not below best x (1 - 1e-4)."""
    lrs, best, lr = [], float("inf"), LR
    for value in values:
        if value < best * (1 - 1e-4):
            best = value
        else:
            lr *= FACTOR
        lrs.append(lr)
    return lrs


def test_every_learner_steps_its_plateau_on_rank_0s_value_and_the_rates_stay_equal():
    torch.manual_seed(0)
    # sync, P = 3, H = 2: an epoch is 6 pushes, 2 updates; epoch e ends at version 2 (e + 1)
    run = InProcessRun(InnerPlateauClassifier(), blob_batches(), "sync", p=3, max_updates=9, local_steps=2,
                       pushes_per_epoch=6, logged=lambda rank, epoch: {"val/loss": LOGGED[rank][epoch]}).fit()
    assert run.stats["updates"] == 9 and run.stats["epochs"] == 4
    by_hand = plateau_lrs(LOGGED[0])

    def expected(version: int) -> float:  # after the epochs that ended by ``version``
        ended = version // 2
        return LR if ended == 0 else by_hand[ended - 1]

    rates: dict[int, set[float]] = {}
    for rank, steps in run.inner_lrs.items():
        assert steps, f"learner {rank} took no inner step"
        for version, lrs in steps:
            assert lrs == pytest.approx([expected(version)]), f"learner {rank}, version {version}"
            rates.setdefault(version, set()).add(lrs[0])
    assert all(len(r) == 1 for r in rates.values())  # the learners' rates equal at every version
    assert len({r for rs in rates.values() for r in rs}) >= 3  # rank 0's values halved it twice
    # stepped on its own values, a learner would have run at other rates in these epochs
    for rank in (1, 2):
        own = plateau_lrs(LOGGED[rank])
        assert any(own[e] != pytest.approx(by_hand[e]) for e in range(run.stats["epochs"] - 1)), rank
    # every learner's scheduler saw rank 0's values of the four epochs' ends (training went on after each)
    resumed = 4
    for configs in run.inner_schedulers:
        plateau = configs[0].scheduler
        assert plateau.best == min(LOGGED[0][:resumed]) and plateau.last_epoch == resumed


def test_a_learner_waits_for_rank_0s_value_before_its_first_inner_step_of_the_epoch():
    """A learner that leaves its epoch's end long before rank 0 does (rank 0 slow to come back,
    as after a long validation) still runs its next round at the rate of rank 0's value."""
    torch.manual_seed(0)

    def logged(rank, epoch):
        if rank == 0:
            import time

            time.sleep(0.3)  # rank 0's validation takes longer: the others resume first
        return {"val/loss": LOGGED[rank][epoch]}

    # sync, P = 3, H = 2, an epoch's end at every update: a round from version v follows v of them
    run = InProcessRun(InnerPlateauClassifier(), blob_batches(), "sync", p=3, max_updates=5,
                       local_steps=2, pushes_per_epoch=3, logged=logged).fit()
    by_hand = plateau_lrs(LOGGED[0])
    for rank, steps in run.inner_lrs.items():
        assert {version for version, _ in steps} == {0, 1, 2, 3, 4}, rank
        for version, lrs in steps:
            assert lrs == pytest.approx([LR if version == 0 else by_hand[version - 1]]), (rank, version)
    # (without the wait, learners 1 and 2 would have started version 2's round at the rate before
    # rank 0's value of 1.2 halved it)
    assert by_hand[:3] == pytest.approx([LR, LR * FACTOR, LR * FACTOR])


# ------------------------------------------------------------------ through Lightning's loops
class NoisyValidationData(OneSampleData):
    """Validation labels drawn at random: a validation loss that rises at some epochs' ends."""

    def __init__(self, **kwargs):
        super().__init__(val_noise_labels=True, **kwargs)


@pytest.mark.parametrize("server", ["central", "collective"])
def test_the_real_engine_steps_the_plateau_on_the_value_the_simulated_one_does(one_process, tmp_path, server):
    from pytorch_lightning.callbacks import LearningRateMonitor

    from lightning_stale import SimulatedStaleStrategy

    def fit(strategy, folder):
        logger = RecordingLogger()
        trainer = _lightning_fit(strategy, tmp_path / folder, module=um.Plateau, n=48, data=NoisyValidationData,
                                 logger=logger,
                                 log_every_n_steps=1, max_steps=29, max_epochs=20,
                                 callbacks=[LearningRateMonitor(logging_interval="step")])
        return trainer, [(step, m["lr-SGD"]) for step, m in logger.logged if "lr-SGD" in m]

    real, real_lrs = fit(StaleStrategy("sync", local_steps=3, outer_optimizer=NESTEROV, server=server,
                                       record_trace=False), "real")
    simulated, simulated_lrs = fit(SimulatedStaleStrategy("sync", num_learners=1, local_steps=3,
                                                          outer_optimizer=NESTEROV), "simulated")
    # epochs of 6 batches, 2 pushes; max_steps=29 inner steps: 10 updates, the fifth epoch's end
    # coming with the last (no round follows it: the learners step on the four before)
    for trainer in (real, simulated):
        assert trainer.strategy.stats["updates"] == 10 and trainer.global_step == 30
    assert real.strategy.stats["epochs"] == 5
    # the rates in force, in order, as the monitor logged them at every batch; on the real engine
    # a batch drawn after each of the four epochs' ends, before validation, is discarded (its
    # round restarted at the rate rank 0's value gives): logged too, at the rate before
    assert len(simulated_lrs) == 30 and len(real_lrs) == 30 + 4
    rates = [[lr for lr, _ in groupby(lr for _, lr in logged)] for logged in (real_lrs, simulated_lrs)]
    assert rates[0] == rates[1]
    assert len({lr for _, lr in real_lrs}) >= 3  # the plateau cut the rate at least twice
    plateaus = [t.lr_scheduler_configs[0].scheduler for t in (real, simulated)]
    assert plateaus[0].best == pytest.approx(plateaus[1].best)
    assert plateaus[0].last_epoch == 4  # the four epochs' ends that training went on from
    for a, b in zip(real.lightning_module.parameters(), simulated.lightning_module.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


class MissingMetricPlateau(um.Plateau):
    def configure_optimizers(self):
        configured = super().configure_optimizers()
        configured["lr_scheduler"]["monitor"] = "val/missing"
        return configured


def test_a_missing_monitored_metric_gets_lightnings_error(one_process, tmp_path):
    with pytest.raises(MisconfigurationException, match=r"ReduceLROnPlateau conditioned on metric val/missing "
                                                        r"which is not available\. Available metrics are: \[.*"
                                                        r"'val/loss'.*\]\. Condition can be set using `monitor`"):
        _lightning_fit(StaleStrategy("sync", local_steps=3, record_trace=False), tmp_path, module=MissingMetricPlateau,
                       n=48, max_steps=29, max_epochs=20)


def test_the_metrics_message_crosses_the_wire_between_processes():
    """What the server sends each learner between processes (`frames.encode`, `frames.decode`)."""
    import json

    from lightning_stale.engine.distributed.frames import decode, encode
    from lightning_stale.engine.distributed.messages import Kind, Message, payload_text, text_payload

    sent = Message(Kind.METRICS, 2, version=7, epoch=3, payload=text_payload(json.dumps({"val/loss": 0.25})))
    frame, separate = encode(sent)
    assert separate is None  # (small: inside the frame)
    received, _, _, _ = decode(frame, "the server", max_numel=1 << 20)
    assert (received.kind, received.learner, received.version, received.epoch) == (Kind.METRICS, 2, 7, 3)
    assert json.loads(payload_text(received.payload)) == {"val/loss": 0.25}
