"""Schedules and the Trainer's options as under DDP, for modules as users write them, on both
engines in this process (the simulated one with 2 or 3 learners, the real one as P = 1):
``estimated_stepping_batches`` counts server updates (a warm-up sized from it), schedulers are
stepped by the server where Lightning would step them (``LearningRateMonitor`` and checkpoints
see them; ``ReduceLROnPlateau`` with the monitored value after each epoch's validation),
``limit_train_batches``, ``max_epochs``, ``max_time`` and ``val_check_interval`` mean what they
mean, and what cannot run is refused with the reason.
"""

import csv
import time

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning import Callback
from pytorch_lightning.callbacks import LearningRateMonitor, Timer
from pytorch_lightning.loggers import CSVLogger

import user_modules as um
from engines import QUIET, books_balance, fit, server_lr

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]




class LearningRates(Callback):
    """The server's learning rate after every training batch, with the update count."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, *args):
        self.seen.append((trainer.global_step, server_lr(trainer), trainer.current_epoch))


@pytest.mark.parametrize(
    "limits", [dict(max_steps=20), dict(max_epochs=2), dict(max_epochs=3, max_steps=40)]
)
def test_linear_warmup_sized_from_estimated_stepping_batches(engine, limits):
    pl.seed_everything(0)
    model = um.WarmupAdamW(warmup=0.5)
    lrs = LearningRates()
    trainer = um.fit_user_module(
        engine, model, um.BlobData(batch_size=16), callbacks=[lrs], **limits
    )
    stats = trainer.strategy.stats
    # the warm-up was sized from the updates this fit made: max_steps, or epochs x updates per
    # epoch (K pushes of a 12-batch epoch each; the real engine's P = 1 learner makes 12)
    assert model.total_steps == stats["updates"] == trainer.global_step
    if "max_epochs" in limits and model.total_steps < limits.get("max_steps", 10**9):
        assert stats["epochs"] == limits["max_epochs"]
    warmup = int(0.5 * model.total_steps)
    for updates, lr, _ in lrs.seen:
        assert lr == pytest.approx(0.01 * min(1.0, (updates + 1) / warmup))
    assert server_lr(trainer) == pytest.approx(0.01)  # warm-up done
    assert books_balance(stats)


def test_lr_monitor_and_checkpoints_see_the_schedule_the_server_follows(engine, tmp_path):
    class SaveAt(Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 6 and not (tmp_path / "mid.ckpt").exists():
                trainer.save_checkpoint(tmp_path / "mid.ckpt")

    pl.seed_everything(0)
    model = um.WarmupAdamW(warmup=0.5)  # 12 updates: 6 of warm-up
    trainer = fit(
        engine,
        model,
        um.BlobData(),
        variant="async",
        max_steps=12,
        log_every_n_steps=1,
        logger=CSVLogger(tmp_path),
        callbacks=[LearningRateMonitor("step"), SaveAt()],
    )
    rows = list(csv.DictReader(open(trainer.logger.log_dir + "/metrics.csv")))
    logged = [(int(r["step"]), float(r["lr-AdamW"])) for r in rows if r.get("lr-AdamW")]
    assert [step for step, _ in logged] == list(range(12))  # one learner's batches: updates here
    for step, lr in logged:
        assert lr == pytest.approx(0.01 * min(1.0, (step + 1) / 6))
    saved = torch.load(tmp_path / "mid.ckpt", weights_only=False)
    assert saved["lr_schedulers"][0]["last_epoch"] == 6
    assert saved["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.01)
    # the checkpoint goes on under plain Lightning with the schedule where the server left it
    resumed = um.WarmupAdamW(warmup=0.5)
    plain = pl.Trainer(max_steps=8, **{**QUIET, "logger": False})
    plain.fit(resumed, um.BlobData(), ckpt_path=tmp_path / "mid.ckpt")
    assert plain.lr_scheduler_configs[0].scheduler.last_epoch == 8


class ValidationLosses(Callback):
    def __init__(self):
        self.losses = []

    def on_validation_end(self, trainer, *args):
        if not trainer.sanity_checking:
            self.losses.append(float(trainer.callback_metrics["val/loss"]))


def test_reduce_lr_on_plateau_falls_with_the_validation_loss(engine):
    pl.seed_everything(0)
    model = um.Plateau(lr=0.2, factor=0.5)
    seen, lrs = ValidationLosses(), LearningRates()
    trainer = fit(
        engine,
        model,
        um.BlobData(val_noise_labels=True),
        variant="async",
        max_epochs=5,
        callbacks=[seen, lrs],
    )
    # the same scheduler fed the same values after each epoch's validation, as Lightning does
    reference = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.2)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
        reference, mode="min", factor=0.5, patience=0
    )
    expected = []
    for loss in seen.losses:
        plateau.step(loss)
        expected.append(reference.param_groups[0]["lr"])
    assert len(seen.losses) == 5 and expected[-1] < 0.2  # the loss stalled: the lr fell
    # during each epoch the server used the lr set after the previous epoch's validation
    for epoch in range(1, 5):
        assert [lr for _, lr, e in lrs.seen if e == epoch][-1] == pytest.approx(expected[epoch - 1])
    assert server_lr(trainer) == pytest.approx(expected[-1])  # the last epoch's step too


@pytest.mark.parametrize("limit,epochs,pushes", [(5, 3, 15), (0.5, 2, 12)])
def test_limit_train_batches_shapes_the_servers_epochs(engine, limit, epochs, pushes):
    pl.seed_everything(0)
    trainer = fit(
        engine,
        um.Classifier(),
        um.BlobData(batch_size=16),
        variant="async",
        limit_train_batches=limit,
        max_epochs=epochs,
    )
    stats = trainer.strategy.stats
    # 12 batches of 16 per epoch, cut to `limit`; one learner's worth of pushes per DDP step
    assert stats["epochs"] == epochs and stats["gradients_received"] == pushes
    assert stats["updates"] == pushes == trainer.global_step and books_balance(stats)


def test_max_time_stops_the_fit(engine):
    pl.seed_everything(0)
    started = time.monotonic()
    trainer = fit(
        engine, um.SlowSteps(), um.BlobData(batch_size=16), variant="async", max_time={"seconds": 1}
    )
    elapsed = time.monotonic() - started
    stats = trainer.strategy.stats
    # With max_time and no other limit the fit has no end of its own (max_epochs is -1): it
    # finished because Lightning's Timer found the time spent.
    (timer,) = [c for c in trainer.callbacks if isinstance(c, Timer)]
    assert trainer.max_epochs == -1 and trainer.max_steps == -1
    assert elapsed >= 1.0 and timer.time_remaining("train") <= 0 and trainer.state.finished
    assert 0 < stats["updates"] == trainer.global_step < 100 and books_balance(stats)


def test_val_check_interval_mid_epoch_validates_the_server_or_is_refused_saying_what_to_do(engine):
    pl.seed_everything(0)
    seen = ValidationLosses()
    if engine == "stale":  # learners pause only at the server's epoch ends
        with pytest.raises(
            ValueError,
            match=r"val_check_interval must be 1.0.*check_val_every_n_epoch"
            r".*limit_train_batches",
        ):
            fit(engine, um.Classifier(), um.BlobData(), max_epochs=1, val_check_interval=0.5)
        return
    trainer = fit(
        engine,
        um.Classifier(),
        um.BlobData(),
        variant="k_async",
        learners=3,
        max_epochs=2,
        val_check_interval=0.5,
        callbacks=[seen],
    )
    assert len(seen.losses) == 4 and trainer.strategy.stats["epochs"] == 2


class TwoOptimizers(um.Classifier):
    """Several optimizers: Lightning asks for manual optimization."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self):
        return [
            torch.optim.SGD(self.net[0].parameters(), lr=0.1),
            torch.optim.Adam(self.net[2].parameters(), lr=0.01),
        ]

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        for optimizer in self.optimizers():
            optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in self.optimizers():
            optimizer.step()


class Manual(um.Classifier):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()


@pytest.mark.parametrize(
    "cls,reason",
    [
        (Manual, r"manual optimization is not supported: .*use automatic optimization"),
        (
            TwoOptimizers,
            r"manual optimization is not supported.*; exactly one optimizer is supported, got 2"
            r".*use one optimizer with a parameter group per part of the model",
        ),
    ],
)
def test_manual_optimization_and_several_optimizers_are_refused_with_the_reason(
    engine, cls, reason
):
    with pytest.raises(ValueError, match=reason):
        fit(engine, cls(), um.BlobData(), max_steps=3)
